//! Dense per-thread indices, for the per-thread shards of the `pool` manager and the pinned
//! host pool: a thread claims the lowest free slot the first time it asks and hands it back when
//! it exits, so that live threads hold distinct indices however many threads came and went.

/// The slots, a bit each: a thread claims the lowest free one the first time it uses a pool
/// and gives it back when it exits, so that the live threads hold distinct indices (below their
/// number) however many threads came and went, and two live threads share a shard only when
/// there are more of them than shards. Only spreads threads over shards, never a
/// synchronisation point for the pools' data, so std atomics (loom's threads are counted per
/// execution instead, below).
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
        use std::sync::atomic::Ordering::Relaxed;
        for (w, word) in SLOTS.iter().enumerate() {
            let mut bits = word.load(Relaxed);
            while bits != u64::MAX {
                let bit = (!bits).trailing_zeros() as usize;
                match word.compare_exchange_weak(bits, bits | 1 << bit, Relaxed, Relaxed) {
                    Ok(_) => return Slot(Some(w * 64 + bit)),
                    Err(now) => bits = now,
                }
            }
        }
        Slot(None)
    }

    fn index(&self) -> usize {
        self.0
            .unwrap_or_else(|| OVERFLOW.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            SLOTS[i / 64].fetch_and(!(1 << (i % 64)), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[cfg(not(emm_loom))]
thread_local! {
    static THREAD_SLOT: (Slot, usize) = {
        let slot = Slot::claim();
        let index = slot.index();
        (slot, index)
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
    static THREAD_SLOT: (Slot, usize) = {
        let mut next = LOOM_NEXT.lock().unwrap_or_else(|p| p.into_inner());
        *next += 1;
        (Slot(None), *next - 1)
    };
}

/// This thread's index (0 while the thread is being torn down, after its slot was returned).
pub(crate) fn thread_index() -> usize {
    THREAD_SLOT.try_with(|(_, i)| *i).unwrap_or(0)
}

/// How many shards a per-thread structure has: twice the cores, a power of two from 4 to 64.
pub(crate) fn shard_count() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * 2).next_power_of_two().clamp(4, 64)
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::thread_index;

    /// Threads that come and go hand their index back: after hundreds of short-lived threads
    /// a new one still gets a low index (a counter would be past 300), and threads alive at
    /// once never share one.
    #[test]
    fn live_threads_hold_distinct_indices_however_many_came_and_went() {
        // Miri interprets every step: fewer threads there (still more than the 128 bound).
        let churn = if cfg!(miri) { 140 } else { 300 };
        let churned: Vec<usize> = (0..churn)
            .map(|_| std::thread::spawn(thread_index).join().expect("thread"))
            .collect();
        // Other tests' threads run beside this one and hold slots too, but far fewer than 128.
        assert!(churned.iter().all(|&i| i < 128), "{churned:?}");
        let barrier = std::sync::Barrier::new(8);
        let live: Vec<usize> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let i = thread_index();
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
}
