//! Dense per-thread indices, for the per-thread shards of the `pool` manager and the pinned
//! host pool: a thread claims the lowest free slot the first time it asks and hands it back when
//! it exits, so that live threads hold distinct indices however many threads came and went.

use crate::sync::{Bias, Biased, BiasedGuard};

/// The slots, a bit each: a thread claims the lowest free one the first time it uses a pool
/// and gives it back when it exits, so that the live threads hold distinct indices (below their
/// number) however many threads came and went. A thread owns the shard of its slot's index
/// (`sync::Biased`: it enters it without a lock), so the slot passes that shard from a thread
/// that exited to the next one that claims it: the release of a slot is Release and its claim
/// Acquire, ordering the old owner's last use of the shard before the new owner's first. std
/// atomics, not loom's: loom's threads are counted per execution instead, below.
static SLOTS: [std::sync::atomic::AtomicU64; SLOT_WORDS] =
    [const { std::sync::atomic::AtomicU64::new(0) }; SLOT_WORDS];
const SLOT_WORDS: usize = 16;
/// Indices for threads beyond the slots' 1 024, handed out round-robin and never returned.
#[cfg_attr(emm_loom, allow(dead_code))] // loom's threads count per execution instead
static OVERFLOW: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct Slot(Option<usize>);

#[cfg_attr(emm_loom, allow(dead_code))] // loom's threads count per execution instead
impl Slot {
    fn claim() -> Slot {
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        for (w, word) in SLOTS.iter().enumerate() {
            let mut bits = word.load(Relaxed);
            while bits != u64::MAX {
                let bit = (!bits).trailing_zeros() as usize;
                match word.compare_exchange_weak(bits, bits | 1 << bit, Acquire, Relaxed) {
                    Ok(_) => return Slot(Some(w * 64 + bit)),
                    Err(now) => bits = now,
                }
            }
        }
        Slot(None)
    }

    /// The thread's index, and whether no other live thread can hold it (a claimed slot; an
    /// index past the slots is shared).
    fn index(&self) -> (usize, bool) {
        match self.0 {
            Some(i) => (i, true),
            None => (
                SLOT_WORDS * 64 + OVERFLOW.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                false,
            ),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            SLOTS[i / 64].fetch_and(!(1 << (i % 64)), std::sync::atomic::Ordering::Release);
        }
    }
}

#[cfg(not(emm_loom))]
thread_local! {
    static THREAD_SLOT: (Slot, (usize, bool), (usize, bool)) = {
        let slot = Slot::claim();
        let index = slot.index();
        (slot, index, shard_of(index))
    };
}

// loom runs a model's threads on one OS thread: its own thread-locals give each of them its own
// index, so that the models see threads on different shards. The index must not depend on
// anything outside the execution (loom replays a schedule and expects the same steps; the
// process-wide slots, claimed by other tests running beside it, broke that), so under loom it
// is a count of the execution's threads in the order they first ask, which loom's own
// `lazy_static` resets for each execution.
#[cfg(emm_loom)]
loom::lazy_static! {
    static ref LOOM_NEXT: std::sync::Mutex<usize> = std::sync::Mutex::new(0);
}

#[cfg(emm_loom)]
loom::thread_local! {
    static THREAD_SLOT: (Slot, (usize, bool), (usize, bool)) = {
        let mut next = LOOM_NEXT.lock().unwrap_or_else(|p| p.into_inner());
        *next += 1;
        let index = (*next - 1, true);
        (Slot(None), index, shard_of(index))
    };
}

/// This thread's index, and whether it is this thread's alone among live threads (false past
/// the slots, and while the thread is being torn down, after its slot was returned: index 0).
#[cfg(all(test, not(emm_loom)))]
fn thread_index() -> (usize, bool) {
    THREAD_SLOT.try_with(|t| t.1).unwrap_or((0, false))
}

/// The shard of a thread whose index is `index` ([`thread_shard`]).
fn shard_of((index, alone): (usize, bool)) -> (usize, bool) {
    let owned = shard_count();
    if alone && index < owned {
        (index, shard_bias(index) != Bias::None)
    } else {
        (owned + (index & (owned - 1)), false)
    }
}

/// This thread's shard among a per-thread structure's [`shard_total`], and whether the thread
/// owns it (enters it without a lock: [`Biased::enter`]). A thread whose slot is below
/// [`shard_count`] has the shard of that index, which no other live thread enters but to
/// reclaim, and owns it when the process can bias shards ([`Bias::available`]); any other
/// thread (past the slots, or torn down) shares one of the shards from [`shard_count`] up, by
/// lock. Worked out once per thread.
#[inline]
pub(crate) fn thread_shard() -> (usize, bool) {
    THREAD_SLOT
        .try_with(|t| t.2)
        .unwrap_or_else(|_| (shard_count(), false))
}

/// How many owned shards a per-thread structure has (and as many shared ones): twice the cores,
/// a power of two from 4 to 64; decided once per process.
pub(crate) fn shard_count() -> usize {
    static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        (cores * 2).next_power_of_two().clamp(4, 64)
    })
}

/// Whether the per-thread shards of the `pool` manager (its size classes) and of the pinned
/// host pool are entered by their threads without a lock in this process: true on Linux
/// when the kernel lets the process register for `membarrier`'s private expedited command
/// (Linux 4.14 and later, unless a seccomp policy forbids it); false elsewhere, where every
/// operation on a shard takes its spin lock (one uncontended compare-exchange). Decided once
/// per process; the `pool` manager's cached pairs are faster with it.
pub fn shards_without_locks() -> bool {
    Bias::available() == Bias::Membarrier
}

/// How many shards a per-thread structure has: [`shard_count`] owned, as many shared.
pub(crate) fn shard_total() -> usize {
    2 * shard_count()
}

/// The bias of shard `i` of a per-thread structure: the process's ([`Bias::available`]) for
/// the owned ones, none for the shared ones.
pub(crate) fn shard_bias(i: usize) -> Bias {
    if i < shard_count() {
        Bias::available()
    } else {
        Bias::None
    }
}

/// One shard of a per-thread structure (the `pool` manager's free lists, the pinned host
/// pool's), on its own cache lines. In a structure built by [`Shard::all`] the first half of
/// the shards are owned, one each
/// by the live thread whose slot has its index, which enters it without a lock or any
/// read-modify-write ([`Biased`]); threads past them share the second half, by lock
/// ([`thread_shard`]). Reclaiming and counting (`trim`, `reset`, `stats`) take every shard as
/// a thread that owns none, with one heavy fence for all ([`Biased::lock_all`]).
#[repr(align(128))]
pub(crate) struct Shard<T> {
    pub(crate) inner: Biased<T>,
}

impl<T> Shard<T> {
    /// A structure's [`shard_total`] shards, each holding `new()`, with their biases
    /// ([`shard_bias`]).
    pub(crate) fn all(new: impl Fn() -> T) -> Box<[Shard<T>]> {
        (0..shard_total())
            .map(|i| Shard {
                inner: Biased::new(new(), shard_bias(i)),
            })
            .collect()
    }
}

/// Takes every shard of `shards` as a thread that owns none ([`Biased::lock_all`]).
pub(crate) fn lock_all<T>(shards: &[Shard<T>]) -> Vec<BiasedGuard<'_, T>> {
    Biased::lock_all(shards.iter().map(|s| &s.inner))
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::{Bias, shard_count, shard_total, thread_index, thread_shard};

    /// Threads that come and go hand their index back: after hundreds of short-lived threads
    /// a new one still gets a low index (a counter would be past 300), and threads alive at
    /// once never share one.
    #[test]
    fn live_threads_hold_distinct_indices_however_many_came_and_went() {
        // Miri interprets every step: fewer threads there (still more than the 128 bound).
        let churn = if cfg!(miri) { 140 } else { 300 };
        let churned: Vec<usize> = (0..churn)
            .map(|_| std::thread::spawn(thread_index).join().expect("thread"))
            .map(|(i, alone)| {
                assert!(alone, "slot {i} should be the thread's own");
                i
            })
            .collect();
        // Other tests' threads run beside this one and hold slots too, but far fewer than 128.
        assert!(churned.iter().all(|&i| i < 128), "{churned:?}");
        let barrier = std::sync::Barrier::new(8);
        let live: Vec<usize> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let (i, _) = thread_index();
                        barrier.wait(); // all eight alive, each holding its slot
                        i
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        let mut distinct = live.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 8, "{live:?}");
    }

    /// Eight live threads: those that own a shard own distinct ones below `shard_count`, and
    /// each of them owns its slot's shard when the process can bias shards; the others share
    /// shards from `shard_count` up. With 8 threads and at least 4 owned shards (this
    /// machine's count, or more), some thread must be on either side unless the count is 8 or
    /// more, so only the partition is asserted.
    #[test]
    fn owners_hold_distinct_shards_and_the_rest_share_the_upper_half() {
        let barrier = std::sync::Barrier::new(8);
        let seen: Vec<((usize, bool), (usize, bool))> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let got = (thread_index(), thread_shard());
                        barrier.wait(); // all eight alive at once
                        got
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        let owned = shard_count();
        let biased = Bias::available() != Bias::None;
        let mut owners = Vec::new();
        for &((index, alone), (shard, owner)) in &seen {
            assert!(shard < shard_total(), "{seen:?}");
            if alone && index < owned {
                assert_eq!((shard, owner), (index, biased), "{seen:?}");
            } else {
                assert!(!owner && shard >= owned, "{seen:?}");
            }
            if owner {
                owners.push(shard);
            }
        }
        let count = owners.len();
        owners.sort_unstable();
        owners.dedup();
        assert_eq!(
            owners.len(),
            count,
            "two live threads own one shard: {seen:?}"
        );
    }

    /// On Linux the kernel offers `membarrier` (4.14 and later): the build machines and the
    /// GPU machine must use it, or the pools' fast paths silently take locks again. Elsewhere
    /// the shards are plain spin locks.
    #[test]
    fn linux_enters_owned_shards_without_a_lock() {
        let expected = cfg!(all(target_os = "linux", not(miri)));
        assert_eq!(
            super::shards_without_locks(),
            expected,
            "membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) was refused here: an old \
             kernel or a seccomp policy; allow the call (the pools still work, with a lock)"
        );
    }
}
