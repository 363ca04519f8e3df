//! The mixed concurrent workload of the stress test and the soak: threads of random
//! allocations, clones, views, drops, short `defer_cleanup` sections, pinned and mapped host
//! memory and pins on one context, while another thread resets the context now and then.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use emm::{Context, HostMemory, MemoryPointer, PinnableBuffer};

/// Worker threads of [`mixed_operations`].
pub const THREADS: usize = 16;

/// A small deterministic generator per thread (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

enum Held {
    Mem(MemoryPointer),
    /// Held only to be dropped later.
    Host(#[allow(dead_code)] HostMemory),
}

/// Runs `total_ops` operations spread over [`THREADS`] threads on `ctx` while another thread
/// resets the context every 2 ms; returns how many resets ran. Every handle is dropped before
/// it returns.
pub fn mixed_operations(ctx: &Context, total_ops: usize) -> Result<usize, String> {
    let per_thread = total_ops / THREADS;
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let resetter = s.spawn(|| {
            let mut resets = 0usize;
            while !done.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(2));
                ctx.reset().map_err(|e| format!("reset: {e}"))?;
                resets += 1;
            }
            Ok::<usize, String>(resets)
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|id| {
                let ctx = ctx.clone();
                s.spawn(move || -> Result<(), String> {
                    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (id as u64 + 1));
                    let mut held: Vec<Held> = Vec::new();
                    for _ in 0..per_thread {
                        // At most 64 handles a thread: beyond that, drop.
                        let roll = if held.len() >= 64 { 50 } else { rng.below(100) };
                        match roll {
                            0..=34 => {
                                let bytes = 1 + rng.below(4096) as usize;
                                held.push(Held::Mem(
                                    ctx.memalloc(bytes).map_err(|e| e.to_string())?,
                                ));
                            }
                            35..=44 => {
                                if let Some(Held::Mem(m)) = held.last() {
                                    let copy = if rng.below(2) == 0 {
                                        m.clone()
                                    } else {
                                        m.view(m.size() / 2, None).map_err(|e| e.to_string())?
                                    };
                                    held.push(Held::Mem(copy));
                                }
                            }
                            85..=89 if rng.below(40) == 0 => {
                                // A short deferred section, as a runtime brackets a launch
                                // (rare: while any thread is in one, nothing is freed).
                                let _guard = ctx.defer_cleanup().map_err(|e| e.to_string())?;
                                for _ in 0..3 {
                                    let m = ctx.memalloc(256).map_err(|e| e.to_string())?;
                                    if !held.is_empty() {
                                        let i = rng.below(held.len() as u64) as usize;
                                        drop(held.swap_remove(i));
                                    }
                                    held.push(Held::Mem(m));
                                }
                            }
                            45..=89 => {
                                if !held.is_empty() {
                                    let i = rng.below(held.len() as u64) as usize;
                                    drop(held.swap_remove(i));
                                }
                            }
                            90..=94 => {
                                let mapped = rng.below(2) == 0;
                                let h = ctx
                                    .memhostalloc(256, mapped, false, false)
                                    .map_err(|e| e.to_string())?;
                                held.push(Held::Host(h));
                            }
                            _ => {
                                let buffer = Arc::new(PinnableBuffer::zeroed(4096));
                                let h = ctx
                                    .pin(buffer, rng.below(2) == 0)
                                    .map_err(|e| e.to_string())?;
                                held.push(Held::Host(h));
                            }
                        }
                    }
                    drop(held);
                    Ok(())
                })
            })
            .collect();
        let mut outcome = Ok(());
        for w in workers {
            let r = w
                .join()
                .map_err(|_| "a worker panicked".to_string())
                .and_then(|r| r);
            outcome = outcome.and(r);
        }
        done.store(true, Ordering::Release);
        let resets = resetter
            .join()
            .map_err(|_| "the resetter panicked".to_string())
            .and_then(|r| r);
        outcome.and(resets)
    })
}
