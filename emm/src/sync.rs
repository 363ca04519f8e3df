//! Synchronisation primitives: std normally, loom's under `--cfg emm_loom`.
//!
//! The cfg is crate-specific because `RUSTFLAGS` are global: a plain `--cfg loom` would also
//! switch every dependency that checks `cfg(loom)`.
//!
//! Every atomic and lock of emm comes from here, but process-wide statics (ids, counts of
//! threads' slots and of capture pools, a panic count), which loom's atomics cannot be: those
//! are std's, named in full where they are declared, each with the reason.

#[cfg(emm_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(emm_loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
#[cfg(emm_loom)]
pub(crate) use loom::thread::yield_now;

#[cfg(not(emm_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(not(emm_loom))]
pub(crate) use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
#[cfg(not(emm_loom))]
pub(crate) use std::thread::yield_now;

/// Locks, ignoring poison: a panic on one thread must not turn every later free into a panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How a [`Biased`] value's owner and the other threads order their accesses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Bias {
    /// No owner: every thread takes the lock (a spin lock).
    None,
    /// The owner announces itself with a plain store and a compiler fence; another thread
    /// makes every running thread of the process execute a full fence (Linux's
    /// `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`) before it reads the announcement.
    #[cfg_attr(
        not(all(target_os = "linux", not(emm_loom), not(miri))),
        allow(dead_code) // Linux only
    )]
    Membarrier,
    /// Both sides execute a sequentially consistent fence: the same protocol with both fences
    /// real, for loom and Miri, which cannot run the system call.
    Fences,
}

impl Bias {
    /// The owner's side of the fence pair (Dekker's), after its announcing store: a compiler
    /// fence under [`Bias::Membarrier`] (the other side makes it a full fence), else a full one.
    #[inline(always)]
    pub(crate) fn light_fence(self) {
        match self {
            Bias::Membarrier => std::sync::atomic::compiler_fence(Ordering::SeqCst),
            _ => fence(Ordering::SeqCst),
        }
    }

    /// The other side, after its own store: every running thread of the process executes a
    /// full fence under [`Bias::Membarrier`] (a system call), else this thread does.
    pub(crate) fn heavy_fence(self) {
        match self {
            #[cfg(all(target_os = "linux", not(emm_loom), not(miri)))]
            Bias::Membarrier => membarrier::heavy(),
            _ => fence(Ordering::SeqCst),
        }
    }

    /// The bias this process can have: [`Bias::Membarrier`] on Linux when the kernel allows the
    /// process to register for it (decided once), [`Bias::Fences`] under loom and Miri, else
    /// [`Bias::None`].
    pub(crate) fn available() -> Bias {
        if cfg!(any(emm_loom, miri)) {
            return Bias::Fences;
        }
        #[cfg(all(target_os = "linux", not(emm_loom), not(miri)))]
        {
            static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            if *REGISTERED.get_or_init(membarrier::register) {
                return Bias::Membarrier;
            }
        }
        Bias::None
    }
}

/// Linux's `membarrier` system call (`man 2 membarrier`), the heavy side of [`Bias::Membarrier`].
#[cfg(all(target_os = "linux", not(emm_loom), not(miri)))]
mod membarrier {
    // The commands, from the kernel's `include/uapi/linux/membarrier.h`.
    const QUERY: libc::c_long = 0;
    const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    const REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

    #[allow(unsafe_code)]
    fn call(cmd: libc::c_long) -> libc::c_long {
        // SAFETY: `membarrier(cmd, flags = 0, cpu_id = 0)` takes no pointer and touches no
        // memory of this process; an unknown command or a refusal (old kernel, seccomp) is
        // an error return, never undefined behaviour.
        unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                cmd,
                0 as libc::c_uint,
                0 as libc::c_int,
            )
        }
    }

    /// Registers the process for private expedited barriers; false when the kernel does not
    /// offer them or refuses (the pools then take a lock on every operation, as before).
    pub(super) fn register() -> bool {
        let supported = call(QUERY);
        let ok = supported >= 0
            && supported & PRIVATE_EXPEDITED != 0
            && supported & REGISTER_PRIVATE_EXPEDITED != 0
            && call(REGISTER_PRIVATE_EXPEDITED) == 0;
        if ok {
            tracing::debug!(
                "membarrier registered: pool shards are used by their threads without a lock"
            );
        } else {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "membarrier is not available: pool shards take a lock on every operation"
            );
        }
        ok
    }

    /// A full memory fence on every running thread of this process, before this returns.
    pub(super) fn heavy() {
        if call(PRIVATE_EXPEDITED) == 0 {
            return;
        }
        // A process forked from the one that registered may not carry the registration: the
        // kernel refuses the barrier (EPERM) until this process registers itself.
        if call(REGISTER_PRIVATE_EXPEDITED) == 0 && call(PRIVATE_EXPEDITED) == 0 {
            return;
        }
        // Going on would let a thread reclaim a shard its owner is still using.
        panic!(
            "membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed after the process registered \
             for it ({}); please report this with your kernel version",
            std::io::Error::last_os_error()
        );
    }
}

/// A value that one thread, its owner, uses almost always, and other threads rarely (to reclaim
/// or count what it holds): the owner enters it with two plain stores and a load, and no
/// read-modify-write (see [`Bias`]); any other thread takes its lock, then makes sure the owner
/// is out (the costly side: a system call, microseconds). Without an owner ([`Bias::None`])
/// it is a spin lock: taking it free costs one compare-exchange, releasing it one store.
///
/// The protocol is Dekker's: the owner stores `busy`, fences, reads `locked`; another thread
/// stores `locked` (its compare-exchange), fences, reads `busy`. The fences order both pairs, so
/// at least one of them sees the other's store: either the owner sees the lock and steps back
/// (it waits for the lock like any thread), or the other thread sees the owner inside and waits
/// for it to leave. The owner's store to leave is Release, and so is the lock's release; each
/// side's Acquire read of it orders the value's accesses.
pub(crate) struct Biased<T> {
    /// The owner is inside, or about to check `locked`.
    busy: AtomicBool,
    /// A thread other than the owner holds the value, or the owner does after stepping back.
    locked: AtomicBool,
    bias: Bias,
    #[cfg(not(emm_loom))]
    value: std::cell::UnsafeCell<T>,
    #[cfg(emm_loom)]
    value: loom::cell::UnsafeCell<T>,
}

// SAFETY: the protocol above hands the value to one thread at a time, with a happens-before
// edge from each holder to the next (the Release stores that end a hold, read with Acquire),
// as `std::sync::Mutex<T>` does, which is `Send + Sync` for `T: Send`.
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for Biased<T> {}
// SAFETY: as for `Sync`: holding the value owns it.
#[allow(unsafe_code)]
unsafe impl<T: Send> Send for Biased<T> {}

impl<T> Biased<T> {
    /// A value nobody holds, with `bias` (an owner's fast path when it is not [`Bias::None`]).
    pub(crate) fn new(value: T, bias: Bias) -> Biased<T> {
        Biased {
            busy: AtomicBool::new(false),
            locked: AtomicBool::new(false),
            bias,
            #[cfg(not(emm_loom))]
            value: std::cell::UnsafeCell::new(value),
            #[cfg(emm_loom)]
            value: loom::cell::UnsafeCell::new(value),
        }
    }

    /// Whether an owner enters without the lock.
    pub(crate) fn is_biased(&self) -> bool {
        self.bias != Bias::None
    }

    /// Enters the value: without the lock when `owner` (the caller is the one thread that owns
    /// it, and the value is biased), else through [`lock`](Self::lock).
    ///
    /// Passing `owner` from two threads at once lets both in: the owner is decided by a
    /// per-thread slot that no two live threads share (`thread_slots`).
    #[inline(always)]
    pub(crate) fn enter(&self, owner: bool) -> BiasedGuard<'_, T> {
        if owner {
            debug_assert!(self.is_biased(), "only a biased value has an owner");
            self.busy.store(true, Ordering::Relaxed);
            // The light side of the fence pair, after the owner's store to `busy`.
            self.bias.light_fence();
            if !self.locked.load(Ordering::Acquire) {
                return self.guard(&self.busy);
            }
            // Another thread holds it: step back, and wait for the lock like any thread (the
            // owner need not wait for itself, so no heavy fence).
            self.busy.store(false, Ordering::Release);
            self.take_lock();
            return self.guard(&self.locked);
        }
        self.lock()
    }

    /// Takes the value as a thread that is not its owner: the lock, then (when biased) the
    /// heavy fence and a wait for the owner to leave.
    pub(crate) fn lock(&self) -> BiasedGuard<'_, T> {
        self.take_lock();
        if self.is_biased() {
            // The heavy side, after the lock is taken.
            self.bias.heavy_fence();
            self.wait_for_owner();
        }
        self.guard(&self.locked)
    }

    /// Takes every value of `all` as a thread that is not their owner, in order, with one heavy
    /// fence for all of them (a reset or a trim pays for one system call, not one per shard).
    /// Callers that take several must take them in one order (the slice's) to avoid deadlock.
    pub(crate) fn lock_all<'a>(
        all: impl IntoIterator<Item = &'a Biased<T>>,
    ) -> Vec<BiasedGuard<'a, T>>
    where
        T: 'a,
    {
        let taken: Vec<&Biased<T>> = all.into_iter().inspect(|b| b.take_lock()).collect();
        if let Some(biased) = taken.iter().find(|b| b.is_biased()) {
            biased.bias.heavy_fence();
        }
        taken
            .into_iter()
            .map(|b| {
                if b.is_biased() {
                    b.wait_for_owner();
                }
                b.guard(&b.locked)
            })
            .collect()
    }

    fn take_lock(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            if cfg!(emm_loom) {
                // loom may show a plain load the stale value forever; the compare-exchange
                // always reads the latest.
                yield_now();
                continue;
            }
            // Wait on a plain load, so that waiters do not bounce the line between them; spin
            // briefly, then yield (a holder keeps it for a few list operations, never across a
            // driver call or another lock's wait).
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins > 64 {
                    yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Waits until the owner is out (after this thread's heavy fence).
    fn wait_for_owner(&self) {
        // The first read is the one Dekker's argument is about: a plain load after the fence.
        if !self.busy.load(Ordering::Acquire) {
            return;
        }
        let mut spins = 0u32;
        loop {
            // Under loom, a yield every time, which lets loom run the owner (a spin would be
            // explored forever). The read is a plain load under loom too: a loom-only
            // compare-exchange of false for false, once here, wrote to `busy` as the code never
            // does, and let loom report at 3 preemptions an overlap that the fences rule out.
            spins += 1;
            if cfg!(emm_loom) || spins > 64 {
                yield_now();
            } else {
                std::hint::spin_loop();
            }
            if !self.busy.load(Ordering::Acquire) {
                return;
            }
        }
    }

    /// A guard that leaves by storing false to `leave` (`busy` or `locked`).
    fn guard<'a>(&'a self, leave: &'a AtomicBool) -> BiasedGuard<'a, T> {
        BiasedGuard {
            cell: self,
            leave,
            #[cfg(emm_loom)]
            access: Some(self.value.get_mut()),
        }
    }
}

/// The value of an entered [`Biased`]; dropping it leaves.
pub(crate) struct BiasedGuard<'a, T> {
    #[cfg_attr(
        emm_loom,
        allow(dead_code, reason = "under loom the value is reached through `access`")
    )]
    cell: &'a Biased<T>,
    /// The flag whose Release store of false leaves: the owner's `busy`, or `locked`.
    leave: &'a AtomicBool,
    /// loom's record of the access, ended before the value is left.
    #[cfg(emm_loom)]
    access: Option<loom::cell::MutPtr<T>>,
}

impl<T> std::ops::Deref for BiasedGuard<'_, T> {
    type Target = T;

    #[allow(unsafe_code)]
    fn deref(&self) -> &T {
        #[cfg(not(emm_loom))]
        // SAFETY: the guard holds the value (`Biased`'s protocol), so no other thread touches
        // it.
        return unsafe { &*self.cell.value.get() };
        #[cfg(emm_loom)]
        // SAFETY: as above; the access is open until the guard drops.
        return unsafe { self.access.as_ref().expect("open until drop").deref() };
    }
}

impl<T> std::ops::DerefMut for BiasedGuard<'_, T> {
    #[allow(unsafe_code)]
    fn deref_mut(&mut self) -> &mut T {
        #[cfg(not(emm_loom))]
        // SAFETY: the guard holds the value, and `&mut self` makes this the only reference.
        return unsafe { &mut *self.cell.value.get() };
        #[cfg(emm_loom)]
        // SAFETY: as above.
        return unsafe { self.access.as_mut().expect("open until drop").deref() };
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    fn drop(&mut self) {
        #[cfg(emm_loom)]
        drop(self.access.take());
        self.leave.store(false, Ordering::Release);
    }
}

/// loom models of [`Biased`] (run with the crate's loom models: see `loom_models.rs`). Under
/// loom both sides' fences are real sequentially consistent fences ([`Bias::Fences`]), which
/// loom models exactly; in a process, the owner's is a compiler fence and the other side's a
/// `membarrier`, which makes every running thread execute a full fence, the same order.
#[cfg(all(test, emm_loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;

    /// The owner and another thread each add to the value, twice: no update is lost, and
    /// loom's cell reports any two accesses the protocol failed to order.
    #[test]
    fn loom_models_owner_and_another_thread_never_share_the_value() {
        loom::model(|| {
            let cell = Arc::new(Biased::new(0u32, Bias::Fences));
            let other = {
                let cell = cell.clone();
                loom::thread::spawn(move || {
                    *cell.lock() += 1;
                    *cell.lock() += 10;
                })
            };
            *cell.enter(true) += 100;
            *cell.enter(true) += 1000;
            other.join().unwrap();
            assert_eq!(*cell.lock(), 1111);
        });
    }

    /// A biased value and a shared one, and a thread that adds 1 to both, taking them together
    /// as a thread that owns neither (as a trim takes every shard).
    fn cells_and_a_lock_all() -> (Arc<[Biased<u32>; 2]>, loom::thread::JoinHandle<()>) {
        let cells = Arc::new([
            Biased::new(0u32, Bias::Fences),
            Biased::new(0u32, Bias::None),
        ]);
        let other = {
            let cells = cells.clone();
            loom::thread::spawn(move || {
                for mut v in Biased::lock_all(cells.iter()) {
                    *v += 1;
                }
            })
        };
        (cells, other)
    }

    /// The owner of the biased value enters it twice while another thread takes both values:
    /// nothing is lost, and the other thread waits for the owner to leave.
    #[test]
    fn loom_models_lock_all_races_an_owner() {
        loom::model(|| {
            let (cells, other) = cells_and_a_lock_all();
            *cells[0].enter(true) += 10;
            *cells[0].enter(true) += 100;
            other.join().unwrap();
            assert_eq!(*cells[0].lock(), 111);
            assert_eq!(*cells[1].lock(), 1);
        });
    }

    /// Two threads take the same two values together, in the slice's order, as every holder of
    /// several does: they never deadlock, and neither loses the other's update. (Two threads
    /// only: with a third that spins, loom also explores the unfair schedules in which the two
    /// spinners take turns forever and the holder never runs.)
    #[test]
    fn loom_models_two_lock_alls_take_turns() {
        loom::model(|| {
            let (cells, other) = cells_and_a_lock_all();
            for mut v in Biased::lock_all(cells.iter()) {
                *v += 10;
            }
            other.join().unwrap();
            assert_eq!(*cells[0].lock(), 11);
            assert_eq!(*cells[1].lock(), 11);
        });
    }
}

/// The production protocol run natively: loom and Miri check [`Bias::Fences`], never the
/// system call, so this test drives [`Bias::available`]'s bias (`membarrier` on Linux where
/// the kernel allows it) with real threads: an owner entering without the lock while other
/// threads take it, each hold updating two plain fields that must stay equal and lose no
/// update. A stress test finds an ordering bug only with some probability; it runs for a
/// fixed count of holds (`EMM_BIASED_STRESS_ROUNDS` multiplies them).
#[cfg(all(test, not(emm_loom), not(miri)))]
mod native_stress {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::{Bias, Biased};

    /// Stays inside a hold a while, with its value in memory, so that a broken protocol lets
    /// another holder in within the window (without it the window is a few instructions).
    fn dwell(held: &mut (u64, u64)) {
        for _ in 0..64 {
            std::hint::black_box(&mut *held);
            std::hint::spin_loop();
        }
    }

    #[test]
    fn the_owner_and_the_other_threads_never_hold_the_value_at_once() {
        let rounds: u64 = std::env::var("EMM_BIASED_STRESS_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let bias = Bias::available();
        if cfg!(target_os = "linux") && bias != Bias::Membarrier {
            eprintln!(
                "membarrier is not available to this process ({bias:?}): the stress test runs the \
                 lock path only"
            );
        }
        let value = Arc::new(Biased::new((0u64, 0u64), bias));
        let (owner_holds, other_holds, others) = (200_000 * rounds, 5_000 * rounds, 3u64);
        let done = Arc::new(AtomicBool::new(false));
        let owner = {
            let (value, done) = (Arc::clone(&value), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut n = 0;
                // The owner keeps entering until the others are done, at least its count.
                while n < owner_holds || !done.load(Ordering::Relaxed) {
                    let mut held = value.enter(bias != Bias::None);
                    let (a, b) = *held;
                    assert_eq!(a, b, "two threads held the value at once");
                    // Two writes apart: an overlapping holder would see them differ.
                    held.0 = a + 1;
                    dwell(&mut held);
                    held.1 = b + 1;
                    n += 1;
                }
                n
            })
        };
        let workers: Vec<_> = (0..others)
            .map(|_| {
                let value = Arc::clone(&value);
                std::thread::spawn(move || {
                    for _ in 0..other_holds {
                        let mut held = value.lock();
                        let (a, b) = *held;
                        assert_eq!(a, b, "two threads held the value at once");
                        held.0 = a + 1;
                        dwell(&mut held);
                        held.1 = b + 1;
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a locking thread");
        }
        done.store(true, Ordering::Relaxed);
        let owner_count = owner.join().expect("the owner");
        let (a, b) = *value.lock();
        assert_eq!(a, b);
        assert_eq!(a, owner_count + others * other_holds, "an update was lost");
    }
}
