//! emm's own tests on the simulator, in one binary (the test of selection from the process
//! environment and the check of the sources' layers run apart: `env_selection.rs`,
//! `source_checks.rs`; the loom models are in the library, `loom_models`; the call sequences
//! against the mockall mock in `integration/tests/mock_sequences.rs`, so that emm's own test
//! builds, loom's, Miri's and the benchmarks', leave the mock out).
//!
//! Run one group with a filter: `cargo test -p emm --test behaviour pools::`.
//!
//! | module | what it proves |
//! | --- | --- |
//! | `pending_policy` | the deferred-deallocation policy, one test per rule |
//! | `host_and_ipc` | host-side rules and multi-device IPC that one GPU cannot show |
//! | `selection` | choosing the manager in code, the interface-version check, each manager's capabilities |
//! | `hostile_input` | garbled IPC handles, pool descriptors and configuration are refused |
//! | `free_space` | the pool's free space, block by block, adds up to what it holds and does not lend (property test) |
//! | `held_bound` | device memory held stays bounded by memory live, for random sequences (property test) |
//! | `pools` | the device pools and the adaptors, with a property test of the pool |
//! | `pinned_pool` | the pinned host pool, with a property test of its accounting |
//! | `replays` | allocation logs (emm's, RMM's) replayed through the managers |
//! | `vmm_pool` | `vmm-pool`'s growth in place and unmapping |
//! | `pool_ipc` | IPC of stream-ordered pools between simulated processes, with a property test |
//! | `state_machine` | a context against a reference model (proptest state machine) |
//! | `in_flight` | an asynchronous copy that cannot finish leaks its buffers rather than freeing them |
//! | `out_of_memory` | the out-of-memory callback's retries, bounded, and the report a failure carries, under every manager |
//! | `graphs` | captures through graph pools, launches and ordinary memory on three streams never share a block, under every shipped manager (property test) |
//! | `stream_reuse` | stream-ordered memory under every shipped manager against a model of stream work (property test) |
//! | `sleep` | `vmm-pool`'s memory put to sleep and woken: each choice per tag, the refusals, resets and trims while asleep (property test) |
//! | `snapshots` | what a snapshot reports, segment by segment, and the out-of-memory report's holders by tag |
//! | `vmm_ipc` | `vmm-pool` memory exported as file descriptors and opened in another simulated process (Unix), with a property test |
#![cfg(not(emm_loom))]

mod common;
mod free_space;
mod graphs;
mod held_bound;
mod host_and_ipc;
mod hostile_input;
mod in_flight;
mod out_of_memory;
mod pending_policy;
mod pinned_pool;
mod pool_ipc;
mod pools;
mod replays;
mod selection;
mod sleep;
mod snapshots;
mod state_machine;
mod stream_reuse;
#[cfg(unix)]
mod vmm_ipc;
mod vmm_pool;
