//! Synchronisation primitives: std normally, loom's under `--cfg emm_loom`.
//!
//! The cfg is crate-specific because `RUSTFLAGS` are global: a plain `--cfg loom` would also
//! switch every dependency that checks `cfg(loom)`.

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

/// Locks for reading, ignoring poison (as [`lock`]).
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Locks for writing, ignoring poison (as [`lock`]).
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A spin lock for data that one thread uses almost always: taking it free costs one atomic
/// compare-exchange on a line that thread owns, releasing it one plain store (a `std` mutex
/// costs a second read-modify-write to release, and a poison check each way). A waiter spins
/// briefly, then yields. Hold it only for a few list operations, never across a driver call or
/// another lock's wait.
pub(crate) struct Spin<T> {
    locked: AtomicBool,
    #[cfg(not(emm_loom))]
    value: std::cell::UnsafeCell<T>,
    #[cfg(emm_loom)]
    value: loom::cell::UnsafeCell<T>,
}

// SAFETY: the lock hands the value to one thread at a time (the Acquire compare-exchange that
// takes the lock synchronises with the Release store that gave it back), as `std::sync::Mutex<T>` does, which
// is `Send + Sync` for `T: Send`.
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for Spin<T> {}
// SAFETY: as for `Sync`: owning the lock owns the value.
#[allow(unsafe_code)]
unsafe impl<T: Send> Send for Spin<T> {}

impl<T> Spin<T> {
    /// An unlocked lock over `value`.
    pub(crate) fn new(value: T) -> Spin<T> {
        Spin {
            locked: AtomicBool::new(false),
            #[cfg(not(emm_loom))]
            value: std::cell::UnsafeCell::new(value),
            #[cfg(emm_loom)]
            value: loom::cell::UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for it if another thread holds it.
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
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
            // Wait on a plain load, so that waiters do not bounce the line between them.
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins > 64 {
                    yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        SpinGuard {
            lock: self,
            #[cfg(emm_loom)]
            access: Some(self.value.get_mut()),
        }
    }
}

/// The value of a held [`Spin`]; dropping it releases the lock.
pub(crate) struct SpinGuard<'a, T> {
    lock: &'a Spin<T>,
    /// loom's record of the access, ended before the lock is released.
    #[cfg(emm_loom)]
    access: Option<loom::cell::MutPtr<T>>,
}

impl<T> std::ops::Deref for SpinGuard<'_, T> {
    type Target = T;

    #[allow(unsafe_code)]
    fn deref(&self) -> &T {
        #[cfg(not(emm_loom))]
        // SAFETY: the guard holds the lock, so no other thread touches the value.
        return unsafe { &*self.lock.value.get() };
        #[cfg(emm_loom)]
        // SAFETY: as above; the access is open until the guard drops.
        return unsafe { self.access.as_ref().expect("open until drop").deref() };
    }
}

impl<T> std::ops::DerefMut for SpinGuard<'_, T> {
    #[allow(unsafe_code)]
    fn deref_mut(&mut self) -> &mut T {
        #[cfg(not(emm_loom))]
        // SAFETY: the guard holds the lock, and `&mut self` makes this the only reference.
        return unsafe { &mut *self.lock.value.get() };
        #[cfg(emm_loom)]
        // SAFETY: as above.
        return unsafe { self.access.as_mut().expect("open until drop").deref() };
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        #[cfg(emm_loom)]
        drop(self.access.take());
        self.lock.locked.store(false, Ordering::Release);
    }
}

/// loom model of [`Spin`]: run with the crate's loom models (see `tests/loom.rs`).
#[cfg(all(test, emm_loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;

    /// Two threads each add to a value under the lock: no update is lost, and loom's cell
    /// reports any two accesses the lock failed to order.
    #[test]
    fn loom_models_spin_lock_orders_every_access() {
        loom::model(|| {
            let lock = Arc::new(Spin::new(0u32));
            let other = {
                let lock = lock.clone();
                loom::thread::spawn(move || *lock.lock() += 1)
            };
            *lock.lock() += 1;
            other.join().unwrap();
            assert_eq!(*lock.lock(), 2);
        });
    }
}
