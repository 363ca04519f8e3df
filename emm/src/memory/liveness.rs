//! [`ContextLiveness`]: whether a context may still reach the driver.
//!
//! A device reset destroys the primary context, and the real driver hands out the same context
//! handle when the device is used again. A free or copy that arrives late, from a pointer that
//! outlived the reset, must therefore never reach the driver: it would hit whatever the new
//! context has at that address. Every driver call made on a context's behalf runs inside
//! [`ContextLiveness::enter`]; [`ContextLiveness::kill`] marks the context dead and waits until
//! no call is in flight, so once it returns nothing of the old context reaches the driver.
//!
//! Entering is re-entrant on one thread (an allocation that flushes after out-of-memory enters
//! twice), which a read-write lock would not allow.
//!
//! A thread that owns a per-thread slot ([`thread_slots`](crate::thread_slots), in a process
//! that can bias them: Linux with `membarrier`) counts its calls in a word of its own, with
//! plain stores and a compiler fence, where every other thread counts in the shared word: no
//! locked instruction on an owner's allocations and frees. `kill` pays for it: one
//! `membarrier`, then a look at every slot.

use std::cell::RefCell;

use crate::sync::{
    AtomicBool, AtomicUsize, Bias, Ordering, RwLock, RwLockReadGuard, RwLockWriteGuard, yield_now,
};
use crate::thread_slots::{shard_count, thread_shard};

/// What a thread is doing inside a context that its other calls must know of
/// ([`ThreadMark`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Running a user's callback from inside a call of the context, which is still in flight:
    /// the callback must not kill the context ([`ContextLiveness::calling_back`]).
    CallingBack,
    /// Holding the context's memory exclusively, while running user code (a reset's release
    /// hooks) that may use the same context ([`ContextLiveness::exclusive_memory`]).
    Exclusive,
}

// This thread's marks: the contexts (their liveness, by address) and what it does in each,
// innermost last. Under loom, each model thread has its own (loom runs them on one OS thread).
#[cfg(not(emm_loom))]
std::thread_local! {
    static MARKS: RefCell<Vec<(usize, Role)>> = const { RefCell::new(Vec::new()) };
}
#[cfg(emm_loom)]
loom::thread_local! {
    static MARKS: RefCell<Vec<(usize, Role)>> = RefCell::new(Vec::new());
}

/// The high bit of the state word: the context is dead.
const DEAD: usize = 1 << (usize::BITS - 1);

/// Whether a context is alive, plus a count of driver calls in flight on its behalf.
///
/// The shared count and the `DEAD` bit live in one atomic word, so whether a shared `enter`
/// came before or after a `kill` is decided by that word's modification order alone. A thread
/// that owns a slot counts in `owned` instead, and the two sides order themselves as
/// the biased shards' owner and reclaimer do (`sync::Biased`; Dekker's protocol): the owner
/// stores its count, fences (lightly), and reads `DEAD`; `kill` sets `DEAD`, fences (heavily),
/// and reads every count. At least one sees the other's store: the call steps back, or `kill`
/// waits for it. loom checks the owners' path (its threads own slots:
/// `kill_waits_for_calls_in_flight`, `kill_waits_for_nested_calls_in_flight`); the shared
/// word's is the one loom checked before the owners' counts came.
#[derive(Debug)]
pub struct ContextLiveness {
    state: AtomicUsize,
    /// The context's memory is asleep (`Context::sleep`): its allocations are refused.
    asleep: AtomicBool,
    /// While asleep, the ranges (start, end) of the allocations put to sleep (offloaded or
    /// discarded), sorted and disjoint: copies through the context to or from them are
    /// refused.
    asleep_ranges: RwLock<Vec<(u64, u64)>>,
    /// Held shared while emm checks caller-given memory of the context and issues driver work
    /// on it (a copy, a set, an export, a graph's launch), and exclusively while memory is
    /// freed or unmapped under pointers that still exist (a reset, a sleep, an IPC close):
    /// memory never goes between a use's check and its driver call, and a use that comes after
    /// sees the memory stale. Taken before any host-memory lock of the context's manager.
    memory_use: RwLock<()>,
    /// How the owners' counts are ordered against `kill`.
    bias: Bias,
    /// One count per owned thread slot, each on its own lines, written only by the thread
    /// that owns the slot (a plain load and store: no read-modify-write); empty when the
    /// process cannot bias slots.
    owned: Box<[OwnedCount]>,
}

/// One owner's count of calls in flight, on cache lines no other count shares.
#[derive(Debug)]
#[repr(align(128))]
struct OwnedCount(AtomicUsize);

/// Proof that a context was alive when the call began; it stays usable until dropped, on the
/// thread that entered (it is not `Send`: an owner's count is written by its thread alone).
#[derive(Debug)]
pub struct LiveGuard<'a> {
    owner: &'a ContextLiveness,
    /// The owner's count this call is in, or `None` for the shared one.
    count: Option<&'a AtomicUsize>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ContextLiveness {
    /// A live context.
    pub fn new() -> ContextLiveness {
        let bias = Bias::available();
        let owners = if bias == Bias::None { 0 } else { shard_count() };
        ContextLiveness {
            state: AtomicUsize::new(0),
            asleep: AtomicBool::new(false),
            asleep_ranges: RwLock::new(Vec::new()),
            memory_use: RwLock::new(()),
            bias,
            owned: (0..owners)
                .map(|_| OwnedCount(AtomicUsize::new(0)))
                .collect(),
        }
    }

    /// Enters a driver call on this context, or `None` if the context is dead.
    #[inline]
    pub fn enter(&self) -> Option<LiveGuard<'_>> {
        let (shard, owner) = thread_shard();
        if owner && let Some(OwnedCount(count)) = self.owned.get(shard) {
            // Only this thread writes `count`: a load and a store count the call in.
            let before = count.load(Ordering::Relaxed);
            count.store(before + 1, Ordering::Relaxed);
            self.bias.light_fence();
            if self.state.load(Ordering::Acquire) & DEAD == 0 {
                return Some(LiveGuard::new(self, Some(count)));
            }
            count.store(before, Ordering::Release);
            return None;
        }
        let before = self.state.fetch_add(1, Ordering::Acquire);
        if before & DEAD == 0 {
            Some(LiveGuard::new(self, None))
        } else {
            self.state.fetch_sub(1, Ordering::Relaxed);
            None
        }
    }

    /// Whether the context is alive now.
    pub fn is_alive(&self) -> bool {
        self.state.load(Ordering::Acquire) & DEAD == 0
    }

    /// Whether the context's memory is asleep (`Context::sleep`).
    #[inline]
    pub fn is_asleep(&self) -> bool {
        self.asleep.load(Ordering::Acquire)
    }

    /// Marks the context (`context`) asleep, refusing its allocations from now on, and lists
    /// it among the process's sleepers for [`sleeping`]; `false` where it was asleep already.
    pub(crate) fn fall_asleep(self: &std::sync::Arc<Self>, context: u64) -> bool {
        if self.asleep.swap(true, Ordering::AcqRel) {
            return false;
        }
        note_asleep(context, self);
        true
    }

    /// Records the ranges (start, end) of the allocations put to sleep, for the checks of
    /// [`sleeps_in`](Self::sleeps_in).
    pub(crate) fn set_asleep_ranges(&self, mut ranges: Vec<(u64, u64)>) {
        ranges.sort_unstable();
        *self
            .asleep_ranges
            .write()
            .unwrap_or_else(|e| e.into_inner()) = ranges;
    }

    /// Marks the context awake: its memory is mapped again (or was given up by a reset).
    pub(crate) fn wake(self: &std::sync::Arc<Self>) {
        self.asleep_ranges
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.asleep.store(false, Ordering::Release);
        note_awake(self);
    }

    /// Whether `len` bytes at `start` overlap an allocation put to sleep.
    pub(crate) fn sleeps_in(&self, start: u64, len: usize) -> bool {
        if !self.is_asleep() {
            return false;
        }
        let end = start.saturating_add(len.max(1) as u64);
        let ranges = self.asleep_ranges.read().unwrap_or_else(|e| e.into_inner());
        super::overlaps_sorted(&ranges, start, end)
    }

    /// Holds the context's memory for a use of caller-given pointers: reset, sleep and IPC
    /// close wait until the returned guard drops. A thread takes it once per use, never
    /// nested (a waiting reset would block the inner one while it waits for the outer), and
    /// calls no user code while holding it.
    ///
    /// On the thread that holds the memory exclusively (a reset running a release hook, user
    /// code, that uses memory of the same context), it holds nothing: the reset made every
    /// pointer of the context stale before it frees, so the use is refused.
    pub(crate) fn use_memory(&self) -> MemoryInUse<'_> {
        let held = match self.memory_use.try_read() {
            Ok(held) => held,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                if self.exclusive_here() {
                    return MemoryInUse { _held: None };
                }
                (self.memory_use.read()).unwrap_or_else(|poisoned| poisoned.into_inner())
            }
        };
        MemoryInUse { _held: Some(held) }
    }

    /// Waits until no use of the context's memory is in flight and holds off new ones until
    /// the returned guard drops: taken by whatever frees or unmaps memory under live pointers.
    /// `None` where this thread holds it already (a release hook run by a reset closes an IPC
    /// handle, or asks for another reset): nothing else can be in flight then.
    pub(crate) fn exclusive_memory(&self) -> Option<MemoryExclusive<'_>> {
        if self.exclusive_here() {
            return None;
        }
        let held = (self.memory_use.write()).unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(MemoryExclusive {
            _mark: ThreadMark::new(self, Role::Exclusive),
            _held: held,
        })
    }

    /// Whether this thread holds the context's memory exclusively.
    fn exclusive_here(&self) -> bool {
        ThreadMark::is_set(self, Role::Exclusive)
    }

    /// Marks this thread, inside a call of this context, as running a user's callback (the
    /// out-of-memory callback) until the returned guard drops: [`kill`](Self::kill) from the
    /// callback would wait for the call the callback runs in, forever, and whoever would kill
    /// the context asks [`called_back_here`](Self::called_back_here) first.
    pub(crate) fn calling_back(&self) -> ThreadMark {
        ThreadMark::new(self, Role::CallingBack)
    }

    /// Whether this thread runs a user's callback from inside a call of this context
    /// ([`calling_back`](Self::calling_back)): it must not kill the context.
    pub(crate) fn called_back_here(&self) -> bool {
        ThreadMark::is_set(self, Role::CallingBack)
    }

    /// Marks the context dead and waits until no call entered before is still in flight.
    /// Everything those calls did happens-before this returns.
    ///
    /// Must not be called by a thread that holds a [`LiveGuard`] of this context.
    pub fn kill(&self) {
        self.state.fetch_or(DEAD, Ordering::AcqRel);
        if !self.owned.is_empty() {
            // After `DEAD` is stored: an owner entering from now on sees it, or this sees its
            // count (the owners' side of the fence pair is in `enter`).
            self.bias.heavy_fence();
        }
        while self.state.load(Ordering::Acquire) & !DEAD != 0 {
            yield_now();
        }
        for OwnedCount(count) in self.owned.iter() {
            // Acquire: the call's work happens-before its count's Release store to leave.
            while count.load(Ordering::Acquire) != 0 {
                yield_now();
            }
        }
    }
}

/// A use of the context's memory in flight ([`ContextLiveness::use_memory`]).
#[must_use = "the memory is held while the guard lives"]
pub(crate) struct MemoryInUse<'a> {
    /// `None` on the thread that holds the memory exclusively.
    _held: Option<RwLockReadGuard<'a, ()>>,
}

/// Memory of the context being freed or unmapped under live pointers
/// ([`ContextLiveness::exclusive_memory`]).
#[must_use = "uses are held off while the guard lives"]
pub(crate) struct MemoryExclusive<'a> {
    /// This thread's mark ([`Role::Exclusive`]).
    _mark: ThreadMark,
    _held: RwLockWriteGuard<'a, ()>,
}

/// This thread's mark of what it does inside a context ([`Role`]), taken off when dropped.
#[must_use = "the mark lasts while the guard lives"]
pub(crate) struct ThreadMark {
    /// The liveness's address.
    at: usize,
    role: Role,
}

impl ThreadMark {
    fn new(owner: &ContextLiveness, role: Role) -> ThreadMark {
        let at = owner as *const ContextLiveness as usize;
        MARKS.with(|m| m.borrow_mut().push((at, role)));
        ThreadMark { at, role }
    }

    /// Whether this thread carries a mark of `role` for `owner`.
    fn is_set(owner: &ContextLiveness, role: Role) -> bool {
        let at = owner as *const ContextLiveness as usize;
        MARKS.with(|m| m.borrow().contains(&(at, role)))
    }
}

impl Drop for ThreadMark {
    fn drop(&mut self) {
        MARKS.with(|m| {
            let mut m = m.borrow_mut();
            if let Some(k) = m.iter().rposition(|&e| e == (self.at, self.role)) {
                m.remove(k);
            }
        });
    }
}

impl Default for ContextLiveness {
    fn default() -> Self {
        ContextLiveness::new()
    }
}

impl<'a> LiveGuard<'a> {
    #[inline(always)]
    fn new(owner: &'a ContextLiveness, count: Option<&'a AtomicUsize>) -> LiveGuard<'a> {
        LiveGuard {
            owner,
            count,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for LiveGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        match self.count {
            // The entering thread (the guard is not `Send`) is the count's only writer.
            Some(count) => count.store(count.load(Ordering::Relaxed) - 1, Ordering::Release),
            None => {
                self.owner.state.fetch_sub(1, Ordering::Release);
            }
        }
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;

    #[test]
    fn enter_fails_after_kill_and_nests_before() {
        let l = ContextLiveness::new();
        {
            let a = l.enter().expect("alive");
            let b = l.enter().expect("entering twice on one thread works");
            drop((a, b));
        }
        l.kill();
        assert!(!l.is_alive());
        assert!(l.enter().is_none());
    }
}

/// The contexts whose memory is asleep, by context handle, for [`sleeping`]: each entry is
/// added by `Context::sleep` and taken out by its wake or a reset. A static, so std's lock
/// (loom's cannot be one); no loom model puts memory to sleep.
static SLEEPERS: std::sync::Mutex<Vec<(u64, std::sync::Weak<ContextLiveness>)>> =
    std::sync::Mutex::new(Vec::new());

/// How many contexts are in [`SLEEPERS`]: [`sleeping`] costs one load while none is. A
/// static, so std's atomic (loom's cannot be one).
static ANY_ASLEEP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Records that `context`'s memory (whose liveness is `liveness`) is asleep now.
fn note_asleep(context: u64, liveness: &std::sync::Arc<ContextLiveness>) {
    let mut sleepers = SLEEPERS.lock().unwrap_or_else(|e| e.into_inner());
    let this = std::sync::Arc::downgrade(liveness);
    sleepers.retain(|(_, l)| !l.ptr_eq(&this) && l.strong_count() > 0);
    sleepers.push((context, this));
    ANY_ASLEEP.store(sleepers.len(), std::sync::atomic::Ordering::Release);
}

/// Records that the memory of the context whose liveness is `liveness` is awake (or was
/// given up by a reset). By the liveness, not the handle: simulated machines in one process
/// hand out the same handles.
fn note_awake(liveness: &std::sync::Arc<ContextLiveness>) {
    let mut sleepers = SLEEPERS.lock().unwrap_or_else(|e| e.into_inner());
    let this = std::sync::Arc::downgrade(liveness);
    sleepers.retain(|(_, l)| !l.ptr_eq(&this) && l.strong_count() > 0);
    ANY_ASLEEP.store(sleepers.len(), std::sync::atomic::Ordering::Release);
}

/// Whether `len` bytes at `start` of `context`'s memory lie in an allocation its context put
/// to sleep: one atomic load while no context of the process sleeps.
#[inline]
pub(crate) fn sleeping(context: u64, start: u64, len: usize) -> bool {
    if ANY_ASLEEP.load(std::sync::atomic::Ordering::Acquire) == 0 {
        return false;
    }
    let mut sleepers = SLEEPERS.lock().unwrap_or_else(|e| e.into_inner());
    // Contexts dropped while asleep go, so that the count falls back to none.
    sleepers.retain(|(_, l)| l.strong_count() > 0);
    ANY_ASLEEP.store(sleepers.len(), std::sync::atomic::Ordering::Release);
    sleepers
        .iter()
        .filter(|(c, _)| *c == context)
        .filter_map(|(_, l)| l.upgrade())
        .any(|l| l.sleeps_in(start, len))
}
