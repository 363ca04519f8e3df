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

use crate::sync::{AtomicUsize, Ordering, yield_now};

/// The high bit of the state word: the context is dead.
const DEAD: usize = 1 << (usize::BITS - 1);

/// Whether a context is alive, plus a count of driver calls in flight on its behalf.
///
/// Both live in one atomic word (`DEAD` bit | count), so whether an `enter` came before or
/// after a `kill` is decided by that word's modification order alone: no reasoning about
/// orderings across two locations is needed (and loom can check it exhaustively).
#[derive(Debug)]
pub struct ContextLiveness {
    state: AtomicUsize,
}

/// Proof that a context was alive when the call began; it stays usable until dropped.
#[derive(Debug)]
pub struct LiveGuard<'a> {
    owner: &'a ContextLiveness,
}

impl ContextLiveness {
    /// A live context.
    pub fn new() -> ContextLiveness {
        ContextLiveness {
            state: AtomicUsize::new(0),
        }
    }

    /// Enters a driver call on this context, or `None` if the context is dead.
    pub fn enter(&self) -> Option<LiveGuard<'_>> {
        let before = self.state.fetch_add(1, Ordering::Acquire);
        if before & DEAD == 0 {
            Some(LiveGuard { owner: self })
        } else {
            self.state.fetch_sub(1, Ordering::Relaxed);
            None
        }
    }

    /// Whether the context is alive now.
    pub fn is_alive(&self) -> bool {
        self.state.load(Ordering::Acquire) & DEAD == 0
    }

    /// Marks the context dead and waits until no call entered before is still in flight.
    /// Everything those calls did happens-before this returns.
    ///
    /// Must not be called by a thread that holds a [`LiveGuard`] of this context.
    pub fn kill(&self) {
        self.state.fetch_or(DEAD, Ordering::AcqRel);
        while self.state.load(Ordering::Acquire) & !DEAD != 0 {
            yield_now();
        }
    }
}

impl Default for ContextLiveness {
    fn default() -> Self {
        ContextLiveness::new()
    }
}

impl Drop for LiveGuard<'_> {
    fn drop(&mut self) {
        self.owner.state.fetch_sub(1, Ordering::Release);
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
