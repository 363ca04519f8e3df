//! [`Context::sleep`] and [`Context::wake`]: a context's device memory given back to the
//! driver and mapped again, every address kept (`vmm-pool`).
#![allow(unsafe_code)]

use super::context::Context;
use crate::contract::sleep::{SleepBlock, SleepChoice, SleepOptions, SleepReport, WakeReport};
use crate::contract::snapshot::BlockState;
use crate::error::EmmError;

impl Context {
    /// Puts the context's device memory to sleep: the physical memory behind it goes back to
    /// the driver while every address stays reserved, so pointers held anywhere (PyTorch,
    /// CuPy, Numba, Rust) are valid again after [`wake`](Self::wake). Each live allocation is
    /// kept mapped, offloaded (copied to page-locked host memory, and back at the wake) or
    /// discarded, as `options` says for its [`Tag`](crate::Tag); only `vmm-pool` can, other
    /// managers refuse with [`EmmError::NotSupported`].
    ///
    /// The rules:
    ///
    /// - The sleep waits for all work queued on the context's streams (`cuCtxSynchronize`)
    ///   and issues the pending deallocations first.
    /// - While asleep, allocations are refused ([`EmmError::Sleep`]), as are emm's own copies
    ///   to or from an allocation offloaded or discarded. Frees are taken. A kernel that reads
    ///   or writes sleeping memory faults on the device (its addresses are reserved with
    ///   nothing mapped). emm sees a kernel's arguments only where they pass through it:
    ///   `emm-array` refuses sleeping arrays as cudarc launch arguments (a panic), cudarc
    ///   views and DLPack exports (an error); other code asks
    ///   [`MemoryPointer::is_asleep`](crate::MemoryPointer::is_asleep).
    /// - Choices by tag need every live allocation's tag, which the `history` adaptor records
    ///   (`EMM_MEMORY_ADAPTORS=history`); without it, options whose choices differ by tag are
    ///   refused, and one choice for all memory works.
    /// - Graph pools' segments, and memory to share ([`memalloc_shared`](Self::memalloc_shared),
    ///   which another process may map), stay mapped.
    /// - A reset while asleep gives up everything, the offloaded contents too; the context is
    ///   awake after it.
    ///
    /// A failure before any memory went back (the copies, a refused option) leaves the context
    /// awake, as it was.
    ///
    /// ```
    /// use emm::{SleepChoice, SleepOptions};
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim)
    ///     .ignore_env()
    ///     .memory_manager_name("vmm-pool")
    ///     .build()?;
    /// let ctx = runtime.context(0)?;
    /// let weights = ctx.to_device(&[7u8; 4096])?;
    /// let slept = ctx.sleep(&SleepOptions::new(SleepChoice::Offload))?;
    /// assert_eq!(slept.offloaded_bytes, 4096);
    /// assert_eq!(slept.held_asleep, 0);
    /// assert!(ctx.memalloc(64).is_err(), "allocations wait for the wake");
    /// ctx.wake()?;
    /// let mut back = [0u8; 4096];
    /// ctx.copy_to_host(&mut back, &weights)?;
    /// assert_eq!(back, [7u8; 4096]);
    /// # Ok::<(), emm::EmmError>(())
    /// ```
    pub fn sleep(&self, options: &SleepOptions) -> Result<SleepReport, EmmError> {
        const WHAT: &str = "sleep";
        let began = std::time::Instant::now();
        let inner = &*self.inner;
        let cx = &inner.cx;
        cx.ensure_alive(WHAT)?;
        self.refuse_inside_callback("Context::sleep")?;
        if !cx.liveness.fall_asleep(cx.context.raw()) {
            return Err(EmmError::Sleep {
                what: WHAT,
                device: cx.device,
                reason: "the context is asleep already; call Context::wake first",
            });
        }
        let slept = self.sleep_planned(options);
        if slept.is_err() {
            cx.liveness.wake();
        }
        let mut report = slept?;
        report.elapsed = began.elapsed();
        tracing::info!(device = %cx.device, elapsed_ms = report.elapsed.as_millis() as u64, "context memory asleep");
        Ok(report)
    }

    /// [`sleep`](Self::sleep) with allocations refused already: waits for the device, plans
    /// each live allocation's choice and hands the plan to the manager.
    fn sleep_planned(&self, options: &SleepOptions) -> Result<SleepReport, EmmError> {
        const WHAT: &str = "sleep";
        let inner = &*self.inner;
        let cx = &inner.cx;
        // Copies and launches already checked finish before the device is waited for; later
        // ones see the ranges put to sleep.
        let Some(_uses) = cx.liveness.exclusive_memory() else {
            return Err(self.reset_inside_reset("Context::sleep"));
        };
        {
            let _live = cx.enter(WHAT)?;
            cx.driver
                .ctx_synchronize(cx.context)
                .map_err(|e| cx.driver_error(WHAT, e))?;
        }
        self.flush_deallocations()?;
        let history = inner.history();
        let complete = history.as_ref().is_some_and(|h| h.complete);
        if options.depends_on_tags() && !complete {
            return Err(EmmError::InvalidArgument {
                what: "sleep options",
                reason: "their choices differ by tag, and the manager's history does not record \
                         every live allocation's tag (the pool's own keeps each thread's last \
                         events); add the history adaptor (EMM_MEMORY_ADAPTORS=history), or \
                         give one choice for all memory"
                    .into(),
            });
        }
        let snapshot = Self::snapshot_with(inner, history);
        let mut blocks = Vec::new();
        for block in snapshot.segments.iter().flat_map(|s| &s.blocks) {
            if block.state != BlockState::InUse {
                continue;
            }
            let choice = if block.graph_pool.is_some() {
                SleepChoice::Keep
            } else {
                options.choice_for(block.allocation.as_ref().map(|a| a.tag))
            };
            blocks.push(SleepBlock {
                address: block.address,
                bytes: block.bytes,
                choice,
            });
        }
        cx.liveness.set_asleep_ranges(
            blocks
                .iter()
                .filter(|b| b.choice != SleepChoice::Keep)
                .map(|b| (b.address, b.address + b.bytes as u64))
                .collect(),
        );
        inner.sleeper("sleep")?.sleep(&blocks, options)
    }

    /// Wakes the context's memory ([`sleep`](Self::sleep)): physical memory is mapped again
    /// behind every address the sleep released and the offloaded allocations are copied back;
    /// allocations are taken again. A failure leaves the context asleep (a later wake maps
    /// what is left).
    pub fn wake(&self) -> Result<WakeReport, EmmError> {
        let cx = &self.inner.cx;
        cx.ensure_alive("wake")?;
        if !cx.liveness.is_asleep() {
            return Err(EmmError::Sleep {
                what: "wake",
                device: cx.device,
                reason: "the context is not asleep; there is nothing to wake",
            });
        }
        let began = std::time::Instant::now();
        let mut report = self.inner.sleeper("wake")?.wake()?;
        cx.liveness.wake();
        report.elapsed = began.elapsed();
        tracing::info!(device = %cx.device, elapsed_ms = report.elapsed.as_millis() as u64, "context memory awake");
        Ok(report)
    }

    /// Whether the context's memory is asleep ([`sleep`](Self::sleep)).
    pub fn is_asleep(&self) -> bool {
        self.inner.cx.liveness.is_asleep()
    }
}
