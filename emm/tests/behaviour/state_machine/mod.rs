//! A proptest state-machine test of a context: random sequences of allocation (device, pinned,
//! mapped, pins), clones and views, drops, `defer_cleanup` enter and leave, flushes,
//! `initialize`, resets, and IPC export / open / close in a second simulated process, checked
//! after every step against a reference model (`reference.rs`): the pending queue, what the
//! simulator holds and the other process's mappings agree; at the end a reset leaves no leak
//! and nothing was freed twice.
//!
//! 48 cases of up to 48 steps in CI; `PROPTEST_CASES=2000 cargo test -p emm --test
//! state_machine` for a longer run.

mod reference;
mod sut;

use proptest::test_runner::Config;
use proptest_state_machine::prop_state_machine;
use sut::ContextSut;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

#[cfg(not(miri))]
prop_state_machine! {
    #![proptest_config(Config { cases: cases(), failure_persistence: None, ..Config::default() })]

    #[test]
    fn context_matches_the_model(sequential 1..48 => ContextSut);
}

// Under Miri (in CI, `.ci/run`): short sequences of small allocations, the same checks.
#[cfg(miri)]
prop_state_machine! {
    #![proptest_config(Config { cases: cases(), failure_persistence: None, ..Config::default() })]

    #[test]
    fn context_matches_the_model(sequential 1..12 => ContextSut);
}
