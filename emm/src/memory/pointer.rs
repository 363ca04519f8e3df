//! Device memory as a handle: [`MemoryPointer`], and how an allocation is released when its
//! last pointer drops ([`ReleaseFn`], [`ReleaseHook`], an allocation table).

use std::fmt;
use std::sync::Arc;
// std's lock, not loom's: stream records are recycled through process-wide depots (statics,
// `record.rs`), which would outlive a loom execution.
use std::sync::Mutex;

pub(crate) use super::stream_use::{
    KeptHook, StreamRecord, empty_stream_record, into_stream_use, lock_use, stream_record_on,
    use_mut,
};
pub use super::stream_use::{OrderedOn, StreamUse};

mod parked;

pub(crate) use parked::ParkedPointer;

use super::record::{Parked, Record, forget_kept, recycle_per_thread};

use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, StreamHandle};

use crate::error::EmmError;
use crate::memory::host::HostOwner;
use crate::sync::{AtomicBool, Ordering};

/// A plugin's release action: called once, with the allocation's base and size, when the last
/// pointer to it drops.
pub type ReleaseFn = Box<dyn FnOnce(DevicePtr, usize) + Send>;

/// How a plugin that hands out many allocations releases them without a closure per
/// allocation; see [`MemoryPointer::with_hook`].
pub trait ReleaseHook: Send + Sync {
    /// The last pointer to the allocation at `base` (of `size` bytes, stamped with `tag`)
    /// dropped. Runs on the dropping thread; must not panic.
    fn release(&self, base: DevicePtr, size: usize, tag: u64);

    /// Whether memory stamped with `tag` is still valid (false once the plugin was reset).
    fn is_live(&self, tag: u64) -> bool;

    /// The last pointer to a stream-ordered allocation dropped (one made by
    /// [`MemoryPointer::with_hook_on`]): `streams` says which stream to free it on and which
    /// other streams used it. The default forgets the streams and calls
    /// [`release`](Self::release); a hook that hands out stream-ordered memory overrides it,
    /// since a block reused before those streams' work is done is a data race.
    fn release_on_streams(&self, base: DevicePtr, size: usize, tag: u64, streams: StreamUse) {
        let _ = streams;
        self.release(base, size, tag);
    }
}

/// The release hook of a built-in pool's pointers ([`MemoryPointer::with_stashed_hook`]): a
/// [`ReleaseHook`] whose clone stays with the pointer's recycled record, and which may keep the
/// whole record, block and all, when the last pointer drops ([`park`](Self::park)).
///
/// # Safety
///
/// `park` must not drop the record it is offered, on any path: the record holds the clone of
/// the hook that keeps `self` alive while the call runs. It keeps the record or hands it back.
#[allow(unsafe_code)] // the contract above
pub(crate) unsafe trait PoolHook: ReleaseHook {
    /// Offered the record of a pointer whose last clone dropped (`size` bytes at its base,
    /// stamped `tag`), when it was made with `park`: keeps it (`None`), or hands it back
    /// (`Some`) to be released through [`ReleaseHook::release`]. The default hands it back.
    fn park(&self, record: ParkedPointer, size: usize, tag: u64) -> Option<ParkedPointer> {
        let _ = (size, tag);
        Some(record)
    }

    /// The release of a pointer's block (`size` bytes at `base`, stamped `tag`, on `streams`
    /// if it was stream ordered) with the history stamp its allocation was given
    /// ([`ParkedPointer::stamp`]), for a pool whose history orders the free after it. The
    /// default releases through [`ReleaseHook`] and drops the stamp.
    fn release_stamped(
        &self,
        base: DevicePtr,
        size: usize,
        (tag, stamp): (u64, u64),
        streams: Option<StreamUse>,
    ) {
        let _ = stamp;
        match streams {
            Some(streams) => self.release_on_streams(base, size, tag, streams),
            None => self.release(base, size, tag),
        }
    }
}

/// A pool manager is dropped: the spare boxes in the process-wide depot let go of their clones
/// of its `hooks` (the threads' own lists keep theirs until the boxes are reused), so that the
/// depot does not keep the manager's shared state alive.
pub(crate) fn forget_hooks<'a>(hooks: impl IntoIterator<Item = &'a Arc<dyn PoolHook>>) {
    let hooks: Vec<&Arc<dyn PoolHook>> = hooks.into_iter().collect();
    forget_kept::<Allocation>(|kept| hooks.iter().any(|h| Arc::ptr_eq(&kept.hook, h)));
}

/// A table that owns allocations by key (the host layer's allocation table, Numba's
/// `allocations`): what a pointer it made calls when its last clone drops.
///
/// # Safety
///
/// [`park`](Self::park) must not drop the record it is offered, on any path: the record holds
/// the clone of the table that keeps `self` alive while the call runs. It keeps the record or
/// hands it back.
#[allow(unsafe_code)] // the contract above
pub(crate) unsafe trait AllocationOwner: Send + Sync {
    /// The allocation recorded under `key` at `generation` is no longer used; `streams` is
    /// set for a stream-ordered allocation (boxed as the pointer kept it: most allocations
    /// have none, and the box is one word to hand over).
    fn release(&self, key: u64, generation: u64, streams: Option<StreamRecord>);

    /// The table's current generation (a reset bumps it).
    fn generation(&self) -> u64;

    /// Runs `access` (a host-side read or write of the memory) if memory stamped `generation`
    /// is still the table's, holding off a reset, which frees it, until the access is done;
    /// returns whether it ran. The default checks the generation only.
    fn keep_while(&self, generation: u64, access: &mut dyn FnMut()) -> bool {
        let live = self.generation() == generation;
        if live {
            access();
        }
        live
    }

    /// Offered the record of a plain tracked pointer (no streams, no owner) whose last clone
    /// dropped, recorded under `key` at `generation`: a table that releases the entry and
    /// keeps the record, to revive it for its next allocation
    /// ([`ParkedPointer::revive_tracked`]), returns `None`; otherwise it hands the record back
    /// untouched, to be released as usual. The default hands it back.
    fn park(&self, record: ParkedPointer, key: u64, generation: u64) -> Option<ParkedPointer> {
        let _ = (key, generation);
        Some(record)
    }
}

/// The generation a parked tracked record is stamped with: its entry is gone, and no table
/// reaches this generation, so a release of it (were it dropped rather than revived) finds
/// nothing to release.
pub(crate) const PARKED_GENERATION: u64 = u64::MAX;

pub(crate) enum Release {
    /// Owned by a built-in manager's table under `key`; `generation` is the table's generation
    /// when the allocation was made (a reset bumps it and releases everything itself).
    Tracked {
        table: Arc<dyn AllocationOwner>,
        key: u64,
        generation: u64,
    },
    /// An opened IPC mapping: released by `IpcHandle::close`, never by the pointer; `open`
    /// turns false at the close, which makes every pointer into it stale.
    Mapping { open: Arc<AtomicBool> },
    /// A plugin's own action.
    Custom(Mutex<Option<ReleaseFn>>),
    /// A shared release hook with a per-allocation tag (no allocation of its own per pointer).
    Hook {
        hook: Arc<dyn ReleaseHook>,
        tag: u64,
    },
    /// A built-in pool's block, released through `hook` as `Hook` is; the pointer's clone of
    /// the hook stays with its record when the record is recycled, and with `park` the last
    /// drop first offers the whole record to the hook (see
    /// [`MemoryPointer::with_stashed_hook`]). Such a pointer has no owner; a stream-ordered
    /// pool's has streams ([`MemoryPointer::with_stashed_hook_on`]).
    Pool {
        hook: Arc<dyn PoolHook>,
        tag: u64,
        park: bool,
        /// The allocation's stamp in the pool's history ([`ParkedPointer::stamp`]).
        stamp: u64,
    },
    /// An adaptor's wrapper around another manager's pointer: the hook is told, then the inner
    /// pointer drops (and releases the memory its own way).
    Wrapped {
        inner: MemoryPointer,
        hook: Arc<dyn ReleaseHook>,
        tag: u64,
    },
    /// Not owned: nothing to do.
    Unowned,
}

impl Release {
    /// A release by `action`, run once with the allocation's base and size.
    pub(crate) fn custom(action: impl FnOnce(DevicePtr, usize) + Send + 'static) -> Release {
        Release::Custom(Mutex::new(Some(Box::new(action))))
    }

    /// The hook and tag of a `Hook` or `Pool` release.
    fn shared_hook(&self) -> Option<(&dyn ReleaseHook, u64)> {
        match self {
            Release::Hook { hook, tag } => Some((&**hook, *tag)),
            Release::Pool { hook, tag, .. } => Some((&**hook, *tag)),
            _ => None,
        }
    }
}

pub(crate) struct Allocation {
    device: DeviceOrdinal,
    ctx: ContextHandle,
    base: DevicePtr,
    size: usize,
    release: Release,
    /// Set for a stream-ordered allocation: its streams, changed by `record_stream` and
    /// `free_on` while pointers live, handed to the release.
    streams: Option<StreamRecord>,
    /// Kept alive as long as the memory (the host buffer behind a mapped pin). Dropped after
    /// `release` ran, since fields drop after `Drop::drop`.
    _owner: Option<HostOwner>,
}

recycle_per_thread!(Allocation, KeptHook, Allocation::retire, Allocation::park);

impl Allocation {
    /// For a pool's pointer (`stash`): runs the hook's release and hands the hook's clone and
    /// the emptied stream-use record to the recycled record, for the next pointer made in it,
    /// leaving the allocation empty (no release, no streams, no owner: the record skips its
    /// drop). Anything else releases in `drop`.
    fn retire(&mut self) -> Option<KeptHook> {
        let (hook, tag, stamp) = self.take_pool_hook()?;
        let (streams, emptied) = match self.streams.take() {
            Some(record) => {
                let (streams, emptied) = empty_stream_record(record);
                (Some(streams), Some(emptied))
            }
            None => (None, None),
        };
        hook.release_stamped(self.base, self.size, (tag, stamp), streams);
        // Dropped after the release, as the fields would drop after `Drop::drop`.
        drop(self._owner.take());
        Some(KeptHook {
            hook,
            streams: emptied,
        })
    }

    /// A pool's pointer: its hook, tag and history stamp, the release left `Unowned` (nothing to run when the
    /// allocation drops). Anything else: `None`, the release untouched.
    #[inline(always)]
    fn take_pool_hook(&mut self) -> Option<(Arc<dyn PoolHook>, u64, u64)> {
        if !matches!(self.release, Release::Pool { .. }) {
            return None;
        }
        match std::mem::replace(&mut self.release, Release::Unowned) {
            Release::Pool {
                hook, tag, stamp, ..
            } => Some((hook, tag, stamp)),
            _ => unreachable!("matched above"),
        }
    }

    /// A pool's pointer made with `park`: offers the whole record to its hook
    /// ([`PoolHook::park`]), which keeps it or hands it back to be retired.
    #[inline(always)]
    #[allow(unsafe_code)] // the hook reached through the record it is handed
    fn park(record: Parked<Allocation>) -> Option<Parked<Allocation>> {
        let a = record.value();
        let Release::Pool {
            hook,
            tag,
            park: true,
            ..
        } = &a.release
        else {
            return Self::park_tracked(record);
        };
        let (size, tag) = (a.size, *tag);
        let hook: *const dyn PoolHook = Arc::as_ptr(hook);
        // SAFETY: `hook` points into the `Arc` the record holds (the hook itself lives in the
        // `Arc`'s allocation, not in the record's box, so moving the record moves only the
        // `Arc`). `PoolHook::park` never drops the record it is given (the trait's contract):
        // the record, and the `Arc` in it, live until the call returns, kept or handed back.
        unsafe { &*hook }
            .park(ParkedPointer(record), size, tag)
            .map(|p| p.0)
    }

    /// [`park`](Self::park) of a tracked pointer with no streams and no owner: offers the
    /// record to its table ([`AllocationOwner::park`]). Out of line, so that the record's drop
    /// stays small enough to be inlined into the `pool` pair.
    #[inline(never)]
    #[allow(unsafe_code)] // the table reached through the record it is handed
    fn park_tracked(record: Parked<Allocation>) -> Option<Parked<Allocation>> {
        let a = record.value();
        let Release::Tracked {
            table,
            key,
            generation,
        } = &a.release
        else {
            return Some(record);
        };
        if a.streams.is_some() || a._owner.is_some() {
            return Some(record);
        }
        let (key, generation) = (*key, *generation);
        let table: *const dyn AllocationOwner = Arc::as_ptr(table);
        // SAFETY: `table` points into the `Arc` the record holds (the table lives in the
        // `Arc`'s allocation, not in the record's box). `AllocationOwner::park` never drops the
        // record it is given (the trait's contract): the record, and the `Arc` in it, live
        // until the call returns, kept or handed back.
        unsafe { &*table }
            .park(ParkedPointer(record), key, generation)
            .map(|p| p.0)
    }
}

/// Tells `hook` the allocation at `base` is released: on its streams if it was stream ordered.
#[inline]
fn run_hook(
    hook: &dyn ReleaseHook,
    base: DevicePtr,
    size: usize,
    tag: u64,
    streams: Option<StreamUse>,
) {
    match streams {
        Some(streams) => hook.release_on_streams(base, size, tag, streams),
        None => hook.release(base, size, tag),
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        match &mut self.release {
            Release::Tracked {
                table,
                key,
                generation,
            } => {
                table.release(*key, *generation, self.streams.take());
            }
            Release::Custom(action) => {
                let action = action.get_mut().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(action) = action {
                    action(self.base, self.size);
                }
            }
            // A pool's is released by `retire` (under loom too) or emptied by
            // `ParkedPointer::into_base`; it is here for completeness.
            Release::Hook { .. } | Release::Pool { .. } => {
                let (hook, tag) = self.release.shared_hook().expect("a shared hook");
                let streams = self.streams.take().map(|s| into_stream_use(*s));
                run_hook(hook, self.base, self.size, tag, streams)
            }
            Release::Wrapped { hook, tag, .. } => {
                // The streams are the inner allocation's (a wrapper records none of its own).
                hook.release(self.base, self.size, *tag);
            }
            Release::Mapping { .. } | Release::Unowned => {}
        }
    }
}

/// Device memory: an allocation, or a view of part of one.
///
/// Cloning is cheap and shares the allocation; the memory is released when the last clone or
/// view drops. The handle never frees memory itself.
///
/// A `MemoryPointer` is a cheap handle: clones and views share one allocation record, and the
/// allocation is released when the last of them drops (Numba's `OwnedPointer` reference count,
/// with an `Arc`-like record doing the counting, its box recycled per thread). How it is released is data chosen by whoever made it:
///
/// - the built-in managers queue a [`Free`](crate::memory::pending::Free) on their deferred-deallocation queue;
/// - a plugin passes its own release action ([`MemoryPointer::with_release`]);
/// - memory owned elsewhere is wrapped with [`MemoryPointer::unowned`] and never released.
#[derive(Clone)]
pub struct MemoryPointer {
    alloc: Record<Allocation>,
    offset: usize,
    size: usize,
}

impl MemoryPointer {
    pub(crate) fn from_release(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        release: Release,
        owner: Option<HostOwner>,
    ) -> MemoryPointer {
        Self::from_parts(device, ctx, base, size, release, owner, None)
    }

    pub(crate) fn from_parts(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        release: Release,
        owner: Option<HostOwner>,
        stream: Option<StreamHandle>,
    ) -> MemoryPointer {
        MemoryPointer {
            alloc: Record::new(Allocation {
                device,
                ctx,
                base,
                size,
                release,
                streams: stream.map(|s| Box::new(Mutex::new(StreamUse::on(s)))),
                _owner: owner,
            }),
            offset: 0,
            size,
        }
    }

    /// Device memory a plugin allocated, released by `release` when the last pointer to it
    /// drops (Numba's `MemoryPointer(context, pointer, size, finalizer=...)`).
    ///
    /// # Safety
    ///
    /// `base .. base + size` is device memory of context `ctx` on `device` (or memory every
    /// device of it reaches, such as mapped or managed memory), which the caller owns and
    /// keeps valid until the release runs: emm's safe copies and sets read and write that range
    /// through the driver, trusting it.
    #[allow(unsafe_code)] // the constructor's contract; its body is safe
    pub unsafe fn with_release(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        release: impl FnOnce(DevicePtr, usize) + Send + 'static,
    ) -> MemoryPointer {
        Self::from_release(device, ctx, base, size, Release::custom(release), None)
    }

    /// Device memory a plugin allocated and releases through a shared `hook`: when the last
    /// pointer drops, `hook.release(base, size, tag)` runs. Unlike
    /// [`with_release`](Self::with_release) this allocates nothing besides the pointer itself,
    /// which is what a pool's hot path wants; `tag` is the plugin's (a generation number, say).
    ///
    /// # Safety
    ///
    /// `base .. base + size` is device memory of context `ctx` on `device` (or memory every
    /// device of it reaches, such as mapped or managed memory), which the caller owns and
    /// keeps valid until the release runs: emm's safe copies and sets read and write that range
    /// through the driver, trusting it.
    #[allow(unsafe_code)] // the constructor's contract; its body is safe
    pub unsafe fn with_hook(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        hook: Arc<dyn ReleaseHook>,
        tag: u64,
    ) -> MemoryPointer {
        Self::hooked(device, ctx, base, size, hook, tag, None)
    }

    /// As [`with_hook`](Self::with_hook), for a built-in pool's hot path: the pointer's clone
    /// of `hook` stays with its record when the record is recycled (`record.rs`), and the next
    /// pointer made in that record on the same pool reuses it, so that in the steady state
    /// neither the allocation nor the free changes the hook's reference count (an atomic
    /// read-modify-write on a line that every thread allocating or freeing from the pool
    /// shares). A hook may so outlive its last pointer in up to 64 spare records per thread,
    /// until they are reused or the thread exits, and in the spare boxes threads handed to the
    /// process-wide depot, until its manager drops ([`forget_hooks`]). With `park`, the last
    /// drop first offers the whole record to the hook ([`PoolHook::park`]). The pointer is
    /// tagged `tag` for the hook, and carries `stamp`, its allocation's place in the pool's
    /// history ([`ParkedPointer::stamp`]; 0 for a manager that keeps none).
    #[allow(clippy::too_many_arguments)] // the allocation's fields, as `from_parts`
    #[inline(always)]
    pub(crate) fn with_stashed_hook(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        hook: &Arc<dyn PoolHook>,
        (tag, stamp): (u64, u64),
        park: bool,
    ) -> MemoryPointer {
        Self::stashed(device, ctx, base, size, hook, (tag, stamp), park, None)
    }

    /// As [`with_stashed_hook`](Self::with_stashed_hook), for memory allocated on `stream`, as
    /// [`with_hook_on`](Self::with_hook_on) makes it: the last drop hands the streams to the
    /// hook's [`ReleaseHook::release_on_streams`] (or, with `park`, offers the record, stream
    /// record and all, to [`PoolHook::park`], which frees the block on its streams), and the
    /// hook's clone and the emptied stream-use record stay with the recycled record
    /// ([`KeptHook`]). Threads allocating on one stream then share no reference count, and the
    /// next pointer made on a stream allocates no stream-use record.
    #[allow(clippy::too_many_arguments)] // the allocation's fields, as `from_parts`
    pub(crate) fn with_stashed_hook_on(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        hook: &Arc<dyn PoolHook>,
        (tag, stamp): (u64, u64),
        stream: StreamHandle,
        park: bool,
    ) -> MemoryPointer {
        Self::stashed(
            device,
            ctx,
            base,
            size,
            hook,
            (tag, stamp),
            park,
            Some(stream),
        )
    }

    /// The constructor of both: with `stream`, the pointer records its streams.
    #[allow(clippy::too_many_arguments)] // the allocation's fields, as `from_parts`
    #[inline(always)]
    fn stashed(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        hook: &Arc<dyn PoolHook>,
        (tag, stamp): (u64, u64),
        park: bool,
        stream: Option<StreamHandle>,
    ) -> MemoryPointer {
        // Built here, not through `from_parts`: the hook clone is only known once the spare
        // record is taken, while `from_parts` builds its value before (one constructor that
        // builds after would lengthen the default manager's pair).
        MemoryPointer {
            alloc: Record::new_with(|kept| {
                let (kept_hook, kept_streams) = match kept {
                    Some(KeptHook { hook, streams }) => (Some(hook), streams),
                    None => (None, None),
                };
                Allocation {
                    device,
                    ctx,
                    base,
                    size,
                    release: Release::Pool {
                        hook: match kept_hook {
                            Some(kept) if Arc::ptr_eq(&kept, hook) => kept,
                            _ => Arc::clone(hook),
                        },
                        tag,
                        park,
                        stamp,
                    },
                    streams: stream.map(|s| stream_record_on(kept_streams, s)),
                    _owner: None,
                }
            }),
            offset: 0,
            size,
        }
    }

    /// As [`with_hook`](Self::with_hook), for memory allocated on `stream` (a manager's
    /// `memalloc_on`): the pointer records the streams that use it
    /// ([`record_stream`](Self::record_stream), [`free_on`](Self::free_on)), and the last drop
    /// hands them to [`ReleaseHook::release_on_streams`].
    ///
    /// # Safety
    ///
    /// `base .. base + size` is device memory of context `ctx` on `device` (or memory every
    /// device of it reaches, such as mapped or managed memory), which the caller owns and
    /// keeps valid until the release runs: emm's safe copies and sets read and write that range
    /// through the driver, trusting it.
    #[allow(unsafe_code)] // the constructor's contract; its body is safe
    pub unsafe fn with_hook_on(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        hook: Arc<dyn ReleaseHook>,
        tag: u64,
        stream: StreamHandle,
    ) -> MemoryPointer {
        Self::hooked(device, ctx, base, size, hook, tag, Some(stream))
    }

    fn hooked(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
        hook: Arc<dyn ReleaseHook>,
        tag: u64,
        stream: Option<StreamHandle>,
    ) -> MemoryPointer {
        let release = Release::Hook { hook, tag };
        Self::from_parts(device, ctx, base, size, release, None, stream)
    }

    /// Wraps another manager's pointer (an adaptor's view of it): same address and size; when
    /// the last clone of the wrapper drops, `hook.release(address, size, tag)` runs and then
    /// `inner` drops. Liveness is `inner`'s.
    pub fn wrapping(inner: MemoryPointer, hook: Arc<dyn ReleaseHook>, tag: u64) -> MemoryPointer {
        let (device, ctx, base, size) = (
            inner.device(),
            inner.context(),
            inner.device_ptr(),
            inner.size(),
        );
        Self::from_release(
            device,
            ctx,
            base,
            size,
            Release::Wrapped { inner, hook, tag },
            None,
        )
    }

    /// Device memory owned by someone else; emm never releases it.
    ///
    /// # Safety
    ///
    /// `base .. base + size` is device memory of context `ctx` on `device` that stays allocated
    /// while the pointer and its clones live: emm's copies and memsets through it check only
    /// the range it claims.
    #[allow(unsafe_code)] // the contract above
    pub unsafe fn unowned(
        device: DeviceOrdinal,
        ctx: ContextHandle,
        base: DevicePtr,
        size: usize,
    ) -> MemoryPointer {
        Self::from_release(device, ctx, base, size, Release::Unowned, None)
    }

    /// The device address this pointer starts at (the allocation's base plus the view offset).
    pub fn device_ptr(&self) -> DevicePtr {
        // Wrapping: a plugin may hand any base; the driver refuses an address that wrapped.
        DevicePtr(self.alloc.base.0.wrapping_add(self.offset as u64))
    }

    /// Bytes this pointer covers.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The base address of the whole allocation.
    pub fn allocation_base(&self) -> DevicePtr {
        self.alloc.base
    }

    /// The size of the whole allocation.
    pub fn allocation_size(&self) -> usize {
        self.alloc.size
    }

    /// Offset of this pointer from the allocation's base.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The device the memory is on.
    pub fn device(&self) -> DeviceOrdinal {
        self.alloc.device
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> ContextHandle {
        self.alloc.ctx
    }

    /// Whether the memory is asleep: its context put it to sleep
    /// ([`Context::sleep`](crate::Context::sleep)) and has not woken it, so that a kernel
    /// that touched it now would fault on the device. Code that hands the address to work
    /// emm does not see (a kernel launch) asks this first; one atomic load while no context
    /// of the process sleeps.
    #[inline]
    pub fn is_asleep(&self) -> bool {
        super::liveness::sleeping(self.alloc.ctx.raw(), self.device_ptr().0, self.size)
    }

    /// How many pointers (clones and views) share the allocation (Numba's `refct`).
    pub fn refct(&self) -> usize {
        Record::count(&self.alloc)
    }

    /// Whether `self` and `other` share one allocation.
    pub fn same_allocation(&self, other: &MemoryPointer) -> bool {
        Record::ptr_eq(&self.alloc, &other.alloc)
    }

    /// A view of bytes `start..stop` of this pointer (`stop` defaults to the end), sharing the
    /// allocation. Unlike Numba, the range is checked: a view never reaches past the memory.
    pub fn view(&self, start: usize, stop: Option<usize>) -> Result<MemoryPointer, EmmError> {
        let stop = stop.unwrap_or(self.size);
        if start > stop || stop > self.size {
            return Err(EmmError::OutOfBounds {
                what: "view",
                start,
                end: stop,
                size: self.size,
            });
        }
        Ok(MemoryPointer {
            alloc: self.alloc.clone(),
            offset: self.offset + start,
            size: stop - start,
        })
    }

    /// The stream-use record of the allocation (an adaptor's wrapper reaches its inner
    /// pointer's), `None` for memory not allocated on a stream.
    fn stream_record(&self) -> Option<&Mutex<StreamUse>> {
        match &self.alloc.release {
            Release::Wrapped { inner, .. } => inner.stream_record(),
            _ => self.alloc.streams.as_deref(),
        }
    }

    /// The streams of a stream-ordered allocation (allocated with `memalloc_on`): where it was
    /// allocated, where it will be freed, and which other streams were recorded as using it.
    /// `None` for memory not allocated on a stream.
    pub fn streams(&self) -> Option<StreamUse> {
        self.stream_record().map(|s| lock_use(s).clone())
    }

    /// The stream the memory was allocated on, for a stream-ordered allocation.
    pub fn stream(&self) -> Option<StreamHandle> {
        self.stream_record().map(|s| lock_use(s).stream)
    }

    /// The address of the stream-use record and a copy of what it holds (tests of its reuse).
    #[cfg(all(test, not(emm_loom)))]
    pub(crate) fn stream_use_record(&self) -> Option<(usize, StreamUse)> {
        self.stream_record()
            .map(|s| (std::ptr::from_ref(s) as usize, lock_use(s).clone()))
    }

    /// Records that work queued on `stream` uses this memory (PyTorch's `record_stream`):
    /// when the memory is freed, the manager does not reuse it until the work queued on
    /// `stream` before the free is done. Recording a stream twice, or the stream it is freed
    /// on, changes nothing.
    ///
    /// Memory not allocated on a stream (by `memalloc`) is refused: its free is not stream
    /// ordered, so the caller must synchronise before dropping it.
    pub fn record_stream(&self, stream: &(impl OrderedOn + ?Sized)) -> Result<(), EmmError> {
        let record = self.stream_record().ok_or(EmmError::NotStreamOrdered {
            what: "record_stream",
        })?;
        let mut use_ = lock_use(record);
        let handle = stream.stream_handle();
        if handle != use_.free_on && !use_.recorded.contains(&handle) {
            use_.recorded.push(handle);
            use_.keep(stream);
        }
        Ok(())
    }

    /// Keeps `stream` (the allocation stream) alive while the memory may need it.
    pub(crate) fn keep_stream(&mut self, stream: &(impl OrderedOn + ?Sized)) {
        // A pointer just made is its allocation's only owner: its stream record is reached
        // without the lock (one shared since locks it).
        if let Some(alloc) = Record::get_mut(&mut self.alloc) {
            match &mut alloc.release {
                // The streams are the wrapped pointer's.
                Release::Wrapped { inner, .. } => inner.keep_stream(stream),
                _ => {
                    if let Some(record) = alloc.streams.as_deref_mut() {
                        use_mut(record).keep(stream);
                    }
                }
            }
            return;
        }
        if let Some(record) = self.stream_record() {
            lock_use(record).keep(stream);
        }
    }

    /// Frees the memory on `stream` instead of the stream it was allocated on; the allocation
    /// stream's work queued before the free still completes before anything else reuses it.
    /// Refused for memory not allocated on a stream.
    pub fn free_on(&self, stream: &(impl OrderedOn + ?Sized)) -> Result<(), EmmError> {
        let record = self
            .stream_record()
            .ok_or(EmmError::NotStreamOrdered { what: "free_on" })?;
        let mut use_ = lock_use(record);
        let handle = stream.stream_handle();
        // The stream it was to be freed on stays among those that used it (the allocation
        // stream always does, through `other_streams`).
        let previous = std::mem::replace(&mut use_.free_on, handle);
        if previous != handle && previous != use_.stream && !use_.recorded.contains(&previous) {
            use_.recorded.push(previous);
        }
        use_.recorded.retain(|s| *s != handle);
        use_.keep(stream);
        Ok(())
    }

    /// Whether this points into an opened IPC mapping (released by the handle's `close`), rather
    /// than into memory of its own (a staged IPC copy is memory of its own).
    pub fn is_ipc_mapping(&self) -> bool {
        match &self.alloc.release {
            Release::Mapping { .. } => true,
            Release::Wrapped { inner, .. } => inner.is_ipc_mapping(),
            _ => false,
        }
    }

    /// The tag a shared release hook stamped the allocation with (a [`with_hook`](Self::with_hook)
    /// or built-in pool's pointer, or the pointer an adaptor wraps): `None` for any other.
    #[cfg_attr(not(unix), allow(dead_code))] // the IPC export's check, on Unix only
    pub(crate) fn hook_tag(&self) -> Option<u64> {
        match &self.alloc.release {
            Release::Wrapped { inner, .. } => inner.hook_tag(),
            release => release.shared_hook().map(|(_, tag)| tag),
        }
    }

    /// Runs `access` (a host-side read or write through the memory: mapped and managed
    /// memory) if the memory is live ([`is_live`](Self::is_live)), and for memory a built-in
    /// manager tracks, with its reset held off until the access is done; `None` where the
    /// memory is no longer live. Memory another owner answers for is checked, then accessed.
    pub(crate) fn keep_while<R>(&self, access: impl FnOnce() -> R) -> Option<R> {
        match &self.alloc.release {
            Release::Tracked {
                table, generation, ..
            } => {
                let mut access = Some(access);
                let mut out = None;
                table.keep_while(*generation, &mut || out = access.take().map(|f| f()));
                out
            }
            Release::Wrapped { inner, .. } => inner.keep_while(access),
            _ => self.is_live().then(access),
        }
    }

    /// Whether the memory is still valid as far as its owner knows: false once the built-in
    /// manager that made it was reset. Plugin and unowned memory always answer true.
    pub fn is_live(&self) -> bool {
        match &self.alloc.release {
            Release::Tracked {
                table, generation, ..
            } => table.generation() == *generation,
            Release::Mapping { open } => open.load(Ordering::Acquire),
            Release::Hook { .. } | Release::Pool { .. } => {
                let (hook, tag) = self.alloc.release.shared_hook().expect("a shared hook");
                hook.is_live(tag)
            }
            Release::Wrapped { inner, .. } => inner.is_live(),
            Release::Custom(_) | Release::Unowned => true,
        }
    }
}

impl fmt::Debug for MemoryPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPointer")
            .field("device", &self.alloc.device)
            .field("ptr", &self.device_ptr())
            .field("size", &self.size)
            .field("allocation", &self.alloc.base)
            .field("refct", &self.refct())
            .finish()
    }
}
