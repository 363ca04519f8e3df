//! `vmm-pool`'s sleep and wake ([`PoolShared::sleep`], [`PoolShared::wake`]): the pieces no
//! kept allocation lies in are unmapped and released, the offloaded allocations copied to a
//! page-locked host buffer first and back after the pieces are mapped again (the parent
//! module's text gives the rules).

use driver_sys::{DevicePtr, HostPtr, PhysHandle};

use super::super::PoolShared;
use super::VmmSpace;
use crate::contract::sleep::{SleepBlock, SleepChoice, SleepReport, WakeReport};
use crate::error::EmmError;
use crate::memory::overlaps_sorted;
use crate::sync::lock;

/// The contents of the allocations a sleep offloaded: one page-locked host buffer, and where
/// each allocation's bytes lie in it.
pub(super) struct Stash {
    host: HostPtr,
    /// The buffer's size: at least the offloaded bytes.
    bytes: usize,
    /// The wake keeps the buffer for the next sleep instead of freeing it.
    keep: bool,
    /// (device address, bytes, offset in the buffer) of each allocation.
    blocks: Vec<(u64, usize, usize)>,
}

impl PoolShared {
    /// `vmm-pool`: [`Sleeper::sleep`](crate::contract::Sleeper::sleep). The caller (the
    /// context) waited for the device and refuses allocations. The allocations to offload are
    /// copied to one page-locked host buffer first (a failure leaves the pool as it was);
    /// then every piece that no kept allocation lies in is unmapped and released, its range
    /// left reserved and the arena's.
    #[allow(unsafe_code)]
    pub(in crate::managers::pool) fn sleep(
        &self,
        blocks: &[SleepBlock],
        keep_buffer: bool,
    ) -> Result<SleepReport, EmmError> {
        const WHAT: &str = "sleep";
        let cx = &self.cx;
        let Some(vmm) = &self.vmm else {
            return Err(EmmError::no_sleep(WHAT, super::super::POOL_MANAGER));
        };
        let _live = cx.enter(WHAT)?;
        // Chunks given back inside a defer_cleanup that has since ended go first.
        self.release_chunks(Vec::new(), false);
        if lock(&vmm.inner).sleeping {
            return Err(EmmError::Sleep {
                what: WHAT,
                device: cx.device,
                reason: "the pool is asleep already; call Context::wake first",
            });
        }
        let mut report = SleepReport::default();
        let mut kept = Vec::new();
        let mut offload = Vec::new();
        for b in blocks {
            match b.choice {
                SleepChoice::Keep => {
                    report.kept_bytes += b.bytes;
                    kept.push((b.address, b.address + b.bytes as u64));
                }
                SleepChoice::Offload => {
                    report.offloaded_bytes += b.bytes;
                    offload.push(*b);
                }
                SleepChoice::Discard => report.discarded_bytes += b.bytes,
            }
        }
        kept.sort_unstable();
        let (stash, copying, reused) = self.offload(vmm, &offload, keep_buffer)?;
        report.offload_elapsed = copying;
        report.host_buffer_reused = reused;
        let mut inner = lock(&vmm.inner);
        report.held_before = inner.mapped_bytes();
        let released: Vec<(u64, usize, PhysHandle)> = inner
            .handles
            .iter()
            .filter(|&(&base, &(size, _))| !overlaps_sorted(&kept, base, base + size as u64))
            .map(|(&base, &(size, handle))| (base, size, handle))
            .collect();
        for (base, size, handle) in released {
            // Unmapped first: a piece whose unmapping failed stays mapped, and held.
            if self.unmap_only(base, size) {
                inner.handles.remove(&base);
                self.release_piece(handle);
                inner.asleep.insert(base, size);
            }
        }
        inner.sleeping = true;
        report.held_asleep = inner.mapped_bytes();
        drop(inner);
        *lock(&vmm.stash) = stash;
        tracing::info!(device = %cx.device, held_before = report.held_before, held_asleep = report.held_asleep, kept = report.kept_bytes, offloaded = report.offloaded_bytes, discarded = report.discarded_bytes, "vmm-pool asleep");
        Ok(report)
    }

    /// Copies `blocks` into one page-locked host buffer (`None` for none): the one an earlier
    /// wake kept where it holds them, else a new one (a kept one too small is freed first;
    /// with nothing to copy, a kept one stays only if `keep`). Returns the stash, how long the copies took and
    /// whether the buffer was a kept one; on failure the buffer is freed and nothing else
    /// changed.
    #[allow(unsafe_code)]
    fn offload(
        &self,
        vmm: &VmmSpace,
        blocks: &[SleepBlock],
        keep: bool,
    ) -> Result<(Option<Stash>, std::time::Duration, bool), EmmError> {
        const WHAT: &str = "sleep (offload)";
        let cx = &self.cx;
        let bytes: usize = blocks.iter().map(|b| b.bytes).sum();
        let mut kept = lock(&vmm.kept_buffer);
        if bytes == 0 {
            // Nothing to copy: a kept buffer stays for a later sleep that asks for it.
            if !keep && let Some((host, size)) = kept.take() {
                drop(kept);
                self.free_host_buffer(host, size);
            }
            return Ok((None, std::time::Duration::ZERO, false));
        }
        let kept = kept.take();
        let reuse = kept.filter(|&(_, size)| size >= bytes);
        if reuse.is_none()
            && let Some((host, size)) = kept
        {
            self.free_host_buffer(host, size);
        }
        let (host, size) = match reuse {
            Some(buffer) => buffer,
            None => {
                let host = cx
                    .driver
                    .mem_host_alloc(cx.context, bytes, 0)
                    .map_err(|e| cx.driver_error(WHAT, e))?;
                (host, bytes)
            }
        };
        let mut stash = Stash {
            host,
            bytes: size,
            keep,
            blocks: Vec::with_capacity(blocks.len()),
        };
        let mut at = 0;
        let began = std::time::Instant::now();
        for b in blocks {
            // SAFETY: `host .. host + bytes` is page-locked memory allocated above and owned
            // by `stash` alone; the blocks' sizes sum to `bytes`, so `at .. at + b.bytes` lies
            // inside it, and no other slice over it lives.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    std::ptr::with_exposed_provenance_mut::<u8>(host.0 + at),
                    b.bytes,
                )
            };
            // SAFETY: `b` is a live allocation of this pool, in mapped pieces (the sleep has
            // unmapped none yet); the device is idle and allocations are refused, so nothing
            // writes it during the copy.
            let copied = unsafe { cx.driver.memcpy_dtoh(cx.context, dst, DevicePtr(b.address)) };
            if let Err(e) = copied {
                self.free_stash(stash);
                return Err(cx.driver_error(WHAT, e));
            }
            stash.blocks.push((b.address, b.bytes, at));
            at += b.bytes;
        }
        Ok((Some(stash), began.elapsed(), reuse.is_some()))
    }

    /// Frees a stash's host buffer ([`free_host_buffer`](Self::free_host_buffer)).
    fn free_stash(&self, stash: Stash) {
        self.free_host_buffer(stash.host, stash.bytes);
    }

    /// After a wake's copies: the stash's buffer is kept for the next sleep where it asked,
    /// else freed.
    fn finish_stash(&self, vmm: &VmmSpace, stash: Stash) {
        if stash.keep {
            *lock(&vmm.kept_buffer) = Some((stash.host, stash.bytes));
        } else {
            self.free_stash(stash);
        }
    }

    /// Frees the host buffer a wake kept, if any ([`Context::trim`](crate::Context::trim), a
    /// reset); its bytes.
    pub(in crate::managers::pool) fn free_kept_buffer(&self) -> usize {
        let Some(vmm) = &self.vmm else {
            return 0;
        };
        let Some((host, size)) = lock(&vmm.kept_buffer).take() else {
            return 0;
        };
        self.free_host_buffer(host, size);
        size
    }

    /// Frees a page-locked buffer of a sleep's (a failure is logged and recorded for the next
    /// flush to return; once the context is gone, its destruction freed it).
    #[allow(unsafe_code)]
    fn free_host_buffer(&self, host: HostPtr, bytes: usize) {
        let cx = &self.cx;
        let Some(_live) = cx.liveness.enter() else {
            return;
        };
        // SAFETY: allocated by `offload` with cuMemHostAlloc and freed once, here (its owner,
        // a stash or the kept buffer, was consumed); no slice over it outlives the copies.
        if let Err(e) = unsafe { cx.driver.mem_free_host(cx.context, host) } {
            tracing::error!(device = %cx.device, error = %e, bytes, "freeing the host memory of a sleep's offloaded allocations failed");
            self.queue
                .record_error(EmmError::driver("cuMemFreeHost", cx.device, e));
        }
    }

    /// `vmm-pool`: [`Sleeper::wake`](crate::contract::Sleeper::wake). A new piece is made
    /// and mapped at each address the sleep released (and not given back since), access is
    /// granted once per run of them, and the offloaded allocations are copied back. On a
    /// failure the pool stays asleep, with the pieces mapped so far kept and the offloaded
    /// contents too: a later wake maps the rest and copies them.
    #[allow(unsafe_code)]
    pub(in crate::managers::pool) fn wake(&self) -> Result<WakeReport, EmmError> {
        const WHAT: &str = "wake";
        let cx = &self.cx;
        let Some(vmm) = &self.vmm else {
            return Err(EmmError::no_sleep(WHAT, super::super::POOL_MANAGER));
        };
        let _live = cx.enter(WHAT)?;
        let mut report = WakeReport::default();
        let mut inner = lock(&vmm.inner);
        if !inner.sleeping {
            return Err(EmmError::Sleep {
                what: WHAT,
                device: cx.device,
                reason: "the pool is not asleep; there is nothing to wake",
            });
        }
        // Pieces a failed wake left mapped without access get it first.
        for base in std::mem::take(&mut inner.ungranted) {
            let Some(&(size, _)) = inner.handles.get(&base) else {
                // Given back since (a trim or a reset unmapped it).
                continue;
            };
            let granted = vmm.access.iter().try_for_each(|&d| {
                cx.driver
                    .mem_set_access(cx.context, DevicePtr(base), size, d)
            });
            if let Err(e) = granted {
                inner.ungranted.insert(base);
                return Err(cx.driver_error(WHAT, e));
            }
        }
        // Runs of pieces side by side, each piece made again at its size: one access grant
        // per run.
        let mut runs: Vec<Vec<(u64, usize)>> = Vec::new();
        for (&base, &size) in &inner.asleep {
            match runs.last_mut() {
                Some(run) if run.last().is_some_and(|&(b, s)| b + s as u64 == base) => {
                    run.push((base, size));
                }
                _ => runs.push(vec![(base, size)]),
            }
        }
        for run in runs {
            let mut pieces = Vec::with_capacity(run.len());
            // New physical memory only (the spares are a growth's).
            let layout: Vec<_> = run.iter().map(|&(base, size)| (base, size, None)).collect();
            let mapped = self.map_pieces(vmm, &layout, &mut pieces);
            for &(base, size, handle) in &pieces {
                inner.asleep.remove(&base);
                inner.handles.insert(base, (size, handle));
            }
            if let Err(e) = mapped {
                // The run's mapped pieces go back to sleep; one that cannot be unmapped stays
                // mapped, and the next wake grants its access.
                for &(base, _, _) in &pieces {
                    if let Some((size, handle)) = inner.handles.remove(&base) {
                        if self.unmap_only(base, size) {
                            self.release_piece(handle);
                            inner.asleep.insert(base, size);
                        } else {
                            inner.handles.insert(base, (size, handle));
                            inner.ungranted.insert(base);
                        }
                    }
                }
                return Err(cx.driver_error(WHAT, e));
            }
            report.mapped_bytes += run.iter().map(|&(_, size)| size).sum::<usize>();
        }
        report.held_after = inner.mapped_bytes();
        let stash = lock(&vmm.stash).take();
        // An allocation freed while asleep may have had its pieces given back (a trim): it
        // is not copied back. One whose pieces are all mapped again is copied, live or not
        // (free pool memory, which no allocation took while asleep).
        let restorable = |&(address, bytes, _): &(u64, usize, usize)| {
            mapped_through(&inner.handles, address, address + bytes as u64)
        };
        let stash = stash.map(|mut s| {
            s.blocks.retain(restorable);
            s
        });
        drop(inner);
        if let Some(stash) = stash {
            let copying = std::time::Instant::now();
            match self.restore(&stash) {
                Ok(restored) => report.restored_bytes = restored,
                Err(e) => {
                    // Still asleep, every piece mapped: the next wake copies them again.
                    *lock(&vmm.stash) = Some(stash);
                    return Err(e);
                }
            }
            report.restore_elapsed = copying.elapsed();
            self.finish_stash(vmm, stash);
        }
        lock(&vmm.inner).sleeping = false;
        tracing::info!(device = %cx.device, mapped = report.mapped_bytes, restored = report.restored_bytes, held_after = report.held_after, "vmm-pool awake");
        Ok(report)
    }

    /// Copies a stash's allocations back to their addresses; the bytes copied.
    #[allow(unsafe_code)]
    fn restore(&self, stash: &Stash) -> Result<usize, EmmError> {
        const WHAT: &str = "wake (restore)";
        let cx = &self.cx;
        let mut restored = 0;
        for &(address, bytes, at) in &stash.blocks {
            // SAFETY: `at .. at + bytes` lies in the stash's page-locked buffer, which it owns
            // and which nothing writes while this slice lives.
            let src = unsafe {
                std::slice::from_raw_parts(
                    std::ptr::with_exposed_provenance::<u8>(stash.host.0 + at),
                    bytes,
                )
            };
            // SAFETY: `address .. address + bytes` was a live allocation of this pool at the
            // sleep, in pieces the wake mapped again (the range stays the arena's while
            // asleep); allocations were refused meanwhile, so it is that allocation's, or
            // free pool memory if it was freed while asleep.
            unsafe { cx.driver.memcpy_htod(cx.context, DevicePtr(address), src) }
                .map_err(|e| cx.driver_error(WHAT, e))?;
            restored += bytes;
        }
        Ok(restored)
    }

    /// A reset ends a sleep: the offloaded contents go (their allocations were given up).
    pub(in crate::managers::pool) fn end_sleep(&self) {
        let Some(vmm) = &self.vmm else {
            return;
        };
        lock(&vmm.inner).sleeping = false;
        if let Some(stash) = lock(&vmm.stash).take() {
            self.free_stash(stash);
        }
        self.free_kept_buffer();
    }
}

/// Whether the pieces of `handles` (size and handle by base) map every byte of `start .. end`.
fn mapped_through(
    handles: &std::collections::BTreeMap<u64, (usize, PhysHandle)>,
    start: u64,
    end: u64,
) -> bool {
    let mut at = start;
    while at < end {
        match handles.range(..=at).next_back() {
            Some((&base, &(size, _))) if base + size as u64 > at => at = base + size as u64,
            _ => return false,
        }
    }
    true
}
