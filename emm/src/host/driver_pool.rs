//! `memhostalloc` from the driver's pool in host memory (`EMM_HOST_MEMORY_POOL`, or
//! `RuntimeBuilder::host_memory_pool`): what cuda.core's pinned memory resource allocates
//! from, behind NBEP 7's `memhostalloc` under any manager.
//!
//! - The pool (`cuMemPoolCreate` at `CU_MEM_LOCATION_TYPE_HOST`, release threshold at its
//!   maximum) and a private non-blocking stream are made at the first allocation, and the
//!   context's device is granted access where it has none.
//! - An allocation is `cuMemAllocFromPoolAsync` on the private stream, which is then
//!   synchronised, so the host may touch the memory at once as `cuMemHostAlloc`'s. The memory
//!   is one address for the host and the device, so mapped and unmapped requests get the same
//!   memory.
//! - A free is `cuMemFreeAsync` on the private stream when the last handle drops: not
//!   deferred, and not ordered after other streams' work (as with `memhostalloc` memory in
//!   Numba, work that uses it must be complete before it is dropped).
//! - `reset` frees what is live and destroys the pool and the stream.

#![allow(unsafe_code)]

use std::sync::Arc;

use driver_sys::{
    DevicePtr, DriverError, HostPtr, MemLocation, MemPoolHandle, StreamHandle, stream_flags,
};

use crate::contract::factory::ManagerContext;
use crate::error::EmmError;
use crate::memory::AddressSet;
use crate::memory::host::HostKeeper;
use crate::memory::pointer::ReleaseHook;
use crate::sync::{AtomicU64, Mutex, Ordering, lock};

struct State {
    pool: Option<(MemPoolHandle, StreamHandle)>,
    live: AddressSet,
}

/// The driver's host memory pool of one host layer.
pub(crate) struct DriverHostPool {
    cx: ManagerContext,
    state: Mutex<State>,
    /// Bumped by `reset` (with the state locked); handles of older generations free nothing.
    generation: AtomicU64,
}

impl std::fmt::Debug for DriverHostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverHostPool")
            .field("pool", &lock(&self.state).pool)
            .finish()
    }
}

impl DriverHostPool {
    pub(crate) fn new(cx: &ManagerContext) -> DriverHostPool {
        DriverHostPool {
            cx: cx.clone(),
            state: Mutex::new(State {
                pool: None,
                live: AddressSet::default(),
            }),
            generation: AtomicU64::new(0),
        }
    }

    /// The pool and its stream, made at the first use. The caller holds the liveness.
    fn pool(&self, state: &mut State) -> Result<(MemPoolHandle, StreamHandle), DriverError> {
        if let Some(p) = state.pool {
            return Ok(p);
        }
        let (d, ctx) = (&self.cx.driver, self.cx.context);
        let pool = d.mem_pool_create_limited(ctx, MemLocation::Host, false, 0)?;
        // SAFETY: created just above, handed to no one.
        let pool = unsafe { self.cx.adopt_new_pool(pool, true) }?;
        match d.stream_create(ctx, stream_flags::NON_BLOCKING) {
            Ok(stream) => {
                tracing::debug!(device = %self.cx.device, ?pool, "host memory pool created for memhostalloc");
                state.pool = Some((pool, stream));
                Ok((pool, stream))
            }
            Err(e) => {
                // SAFETY: created just above, handed to no one.
                self.cx.log_failed_undo("a new host memory pool", unsafe {
                    d.mem_pool_destroy(ctx, pool)
                });
                Err(e)
            }
        }
    }

    /// Makes the pool and its stream if they are not made yet. The caller holds the liveness.
    pub(crate) fn prepare(&self) -> Result<(), DriverError> {
        self.pool(&mut lock(&self.state)).map(drop)
    }

    /// `bytes` of page-locked host memory from the pool, ordered on the pool's stream: its
    /// address and the generation to stamp its handle with. The caller holds the liveness
    /// (inside the host layer's out-of-memory retry) and calls [`ready`](Self::ready) before
    /// the host touches the memory.
    pub(crate) fn allocate(&self, bytes: usize) -> Result<(DevicePtr, u64), DriverError> {
        let mut state = lock(&self.state);
        let (pool, stream) = self.pool(&mut state)?;
        let ptr = self
            .cx
            .driver
            .mem_alloc_from_pool_async(self.cx.context, pool, bytes, stream)?;
        state.live.insert(ptr.0);
        Ok((ptr, self.generation.load(Ordering::Acquire)))
    }

    /// Waits until the allocation at `ptr` reached the host (the pool's stream ran it); on an
    /// error the allocation is freed again, or, where that free fails too, kept live (logged)
    /// for the manager's reset to free. The caller holds the liveness.
    pub(crate) fn ready(&self, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut state = lock(&self.state);
        let Some((_, stream)) = state.pool else {
            return Ok(()); // reset meanwhile: the memory went with it
        };
        let (d, ctx) = (&self.cx.driver, self.cx.context);
        let synced = d.stream_synchronize(ctx, stream);
        if synced.is_err() && state.live.remove(&ptr.0) {
            // SAFETY: allocated by `allocate` and handed to no one yet, freed once (it left
            // the live set).
            if let Err(e) = unsafe { d.mem_free_async(ctx, ptr, stream) } {
                tracing::error!(device = %self.cx.device, error = %e, ptr = %ptr, "freeing host pool memory whose allocation failed also failed; it stays allocated until the manager's reset");
                state.live.insert(ptr.0);
            }
        }
        synced
    }

    /// Frees everything live and destroys the pool and its stream; returns the first error.
    pub(crate) fn reset(&self) -> Result<(), EmmError> {
        let mut state = lock(&self.state);
        self.generation.fetch_add(1, Ordering::AcqRel);
        let live = std::mem::take(&mut state.live);
        let Some((pool, stream)) = state.pool.take() else {
            return Ok(());
        };
        let Some(_live) = self.cx.liveness.enter() else {
            return Ok(()); // gone with the context
        };
        // SAFETY: the pool is this layer's own, destroyed once (taken out of the state) and
        // allocating nothing after; `live` are its allocations not freed, whose handles are
        // stale from the generation bump on, so emm neither uses nor frees them again.
        let pool_done = unsafe { self.cx.free_and_destroy_pool(pool, live, stream) };
        // SAFETY: the layer's own stream (taken out of the state), destroyed once; the frees
        // on it ran above.
        let stream_done = unsafe { self.cx.driver.stream_destroy(self.cx.context, stream) };
        pool_done
            .and(stream_done)
            .map_err(|e| self.cx.driver_error("reset of the host memory pool", e))
    }
}

/// An access to the pool's memory holds the pool's lock (a free or a reset waits for it) and
/// its context's liveness; memory a reset freed (an older generation) or whose context is gone
/// is refused.
impl HostKeeper for DriverHostRelease {
    fn keep_while(
        &self,
        host: HostPtr,
        tag: u64,
        what: &'static str,
        access: &mut dyn FnMut(),
    ) -> Result<(), EmmError> {
        let pool = &self.pool;
        let state = lock(&pool.state);
        if pool.generation.load(Ordering::Acquire) != tag || !state.live.contains(&(host.0 as u64))
        {
            return Err(EmmError::Stale {
                what,
                device: pool.cx.device,
                reason: "a reset of its manager freed the driver's host memory pool it came from",
            });
        }
        let Some(_live) = pool.cx.liveness.enter() else {
            return Err(pool.cx.stale(what));
        };
        access();
        drop(state);
        Ok(())
    }
}

/// The release of the pool's memory: `cuMemFreeAsync` on the pool's stream.
#[derive(Debug)]
pub(crate) struct DriverHostRelease {
    pub(crate) pool: Arc<DriverHostPool>,
    pub(crate) queue: Arc<crate::memory::pending::PendingDeallocs>,
}

impl DriverHostRelease {
    /// Frees the memory at `ptr`, stamped with `tag`, once.
    pub(crate) fn free(&self, ptr: u64, tag: u64) {
        let pool = &self.pool;
        let mut state = lock(&pool.state);
        if pool.generation.load(Ordering::Acquire) != tag || !state.live.remove(&ptr) {
            return;
        }
        let Some((_, stream)) = state.pool else {
            return;
        };
        let Some(_live) = pool.cx.liveness.enter() else {
            return;
        };
        // SAFETY: `ptr` came from this pool (it was live in this generation) and its last
        // handle dropped, so it is freed once and not used after.
        if let Err(e) = unsafe {
            pool.cx
                .driver
                .mem_free_async(pool.cx.context, DevicePtr(ptr), stream)
        } {
            tracing::error!(device = %pool.cx.device, error = %e, ptr, "freeing host pool memory failed; it stays allocated until the manager's reset, and the error is returned by the next flush");
            state.live.insert(ptr);
            self.queue
                .record_error(pool.cx.driver_error("free of host pool memory", e));
        }
    }
}

impl ReleaseHook for DriverHostRelease {
    fn release(&self, base: DevicePtr, _size: usize, tag: u64) {
        self.free(base.0, tag);
    }

    fn is_live(&self, tag: u64) -> bool {
        self.pool.generation.load(Ordering::Acquire) == tag
    }
}
