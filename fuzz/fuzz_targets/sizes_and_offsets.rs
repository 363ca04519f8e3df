//! Allocation and pin sizes, view offsets and copy lengths, from 0 and 1 to `usize::MAX`:
//! never a panic, never a touch outside the allocation (the simulator refuses any copy that
//! leaves one), and typed errors for every refusal.
#![no_main]

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::{EmmError, PinnableBuffer, Runtime};
use libfuzzer_sys::fuzz_target;

fn word(data: &[u8], i: usize) -> usize {
    let mut b = [0u8; 8];
    for (k, slot) in b.iter_mut().enumerate() {
        *slot = data.get(i * 8 + k).copied().unwrap_or(0);
    }
    usize::from_le_bytes(b)
}

/// Small values most of the time, the edges sometimes.
fn shape(v: usize) -> usize {
    match v % 8 {
        0 => 0,
        1 => 1,
        2 => usize::MAX,
        3 => usize::MAX / 2,
        _ => (v >> 3) % (96 << 10),
    }
}

fuzz_target!(|data: &[u8]| {
    let sim = Arc::new(SimDriver::new(SimConfig::single(64 << 20)));
    let rt = Runtime::builder(sim.clone()).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let (size, start, stop, copy) = (
        shape(word(data, 0)),
        shape(word(data, 1)),
        shape(word(data, 2)),
        shape(word(data, 3)),
    );
    if let Ok(m) = ctx.memalloc(size) {
        let stop = if word(data, 4) % 2 == 0 {
            None
        } else {
            Some(stop)
        };
        if let Ok(v) = m.view(start, stop) {
            let buf = vec![1u8; copy.min(1 << 20)];
            match ctx.copy_to_device(&v, &buf) {
                Ok(()) => assert!(buf.len() <= v.size()),
                Err(e) => assert!(matches!(e, EmmError::OutOfBounds { .. })),
            }
            let mut out = vec![0u8; copy.min(1 << 20)];
            let _ = ctx.copy_to_host(&mut out, &v);
            let _ = ctx.memset(&v, 3, copy);
        }
    }
    let pin = Arc::new(PinnableBuffer::zeroed(size.min(1 << 16)));
    let _ = ctx.pin(pin, word(data, 5) % 2 == 0);
    let _ = ctx.memhostalloc(size.min(1 << 20), word(data, 6) % 2 == 0, false, false);
    let refused: Vec<_> = sim
        .calls()
        .into_iter()
        .filter(|c| {
            c.outcome.is_err()
                && !matches!(
                    c.op,
                    driver_mock::Op::MemAlloc
                        | driver_mock::Op::MemHostRegister
                        | driver_mock::Op::MemHostAlloc
                )
        })
        .collect();
    assert!(
        refused.is_empty(),
        "emm let a bad request reach the driver: {refused:?}"
    );
});
