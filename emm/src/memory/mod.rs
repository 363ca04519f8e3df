//! Layer 1, memory objects and deallocation: what the contract hands out and how it goes back.
//!
//! | file | holds |
//! | --- | --- |
//! | `pointer` | [`MemoryPointer`] (device memory; clones and views share one allocation) and how an allocation is released ([`ReleaseFn`], [`ReleaseHook`], an allocation table) |
//! | `host` | [`HostMemory`]: [`PinnedMemory`], [`MappedMemory`], and [`PinnableBuffer`] to pin safely |
//! | `pending` | [`PendingDeallocs`] (Numba's `_PendingDeallocs`), the [`Free`] items it holds, [`DeferCleanup`] |
//! | `policy` | [`DeallocConfig`]: when the queue flushes (Numba's count and ratio thresholds) |
//! | `liveness` | [`ContextLiveness`]: whether a context may still reach the driver |
//! | `record` | the reference-counted allocation record behind a pointer, its box recycled per thread |

pub(crate) mod host;
pub(crate) mod liveness;
pub(crate) mod pending;
pub(crate) mod pointer;
pub(crate) mod policy;
pub(crate) mod record;
pub(crate) mod stream_use;

pub use host::{
    HostAllocFlags, HostMemory, HostOwner, HostReleaseFn, HostReleaseHook, ManagedMemory,
    MappedMemory, PinnableBuffer, PinnedMemory,
};
pub use liveness::{ContextLiveness, LiveGuard};
pub use pending::{DeferCleanup, Free, PendingDeallocs};
pub use pointer::{MemoryPointer, ReleaseFn, ReleaseHook};
pub use policy::DeallocConfig;
pub use stream_use::{OrderedOn, StreamUse};

/// A set of device or host addresses, hashed with foldhash's fixed-seed hasher instead of
/// SipHash: the keys are addresses the driver chose, not input an attacker picks, and the
/// allocation hot paths insert and remove one per pair, where SipHash would be a large share of
/// the pair.
pub(crate) type AddressSet = std::collections::HashSet<u64, foldhash::fast::FixedState>;

/// A map keyed by address, hashed as [`AddressSet`].
pub(crate) type AddressMap<V> = std::collections::HashMap<u64, V, foldhash::fast::FixedState>;

/// Whether any of `ranges` (start, end), sorted by start and disjoint, overlaps
/// `start .. end`: a binary search, since disjoint sorted ranges have sorted ends too.
pub(crate) fn overlaps_sorted(ranges: &[(u64, u64)], start: u64, end: u64) -> bool {
    let i = ranges.partition_point(|&(_, e)| e <= start);
    ranges.get(i).is_some_and(|&(s, _)| s < end)
}
