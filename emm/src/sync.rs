//! Synchronisation primitives: std normally, loom's under `--cfg emm_loom`.
//!
//! The cfg is crate-specific because `RUSTFLAGS` are global: a plain `--cfg loom` would also
//! switch every dependency that checks `cfg(loom)`.

#[cfg(emm_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(emm_loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
#[cfg(emm_loom)]
pub(crate) use loom::thread::yield_now;

#[cfg(not(emm_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
