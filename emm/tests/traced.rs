//! What the pool traces, read back from a subscriber installed as the process's global
//! default. These tests live in a binary of their own: `tracing` caches each call site's
//! interest for the whole process, and while a single scoped subscriber is registered a call
//! site first reached by another test's thread is cached as disabled for every thread, so a
//! scoped subscriber among the behaviour suite's parallel tests may see nothing.
#![cfg(not(emm_loom))]

use std::sync::{Arc, Mutex, OnceLock};

use driver_mock::{SimConfig, SimDriver};

// The behaviour suite's helpers; this binary uses some of them.
#[allow(dead_code)]
#[path = "behaviour/common.rs"]
mod common;

const MIB: usize = 1 << 20;

/// What the global subscriber wrote, for a test to read.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// The process's subscriber, at debug level, installed by the first test to ask.
fn captured() -> &'static Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED.get_or_init(|| {
        let captured = Captured::default();
        tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .init();
        captured
    })
}

/// A pool that grows for a stream says so at debug level, with the free space the stream
/// arena holds: a request larger than each of its free blocks grows the pool though it holds
/// more free bytes than it asks, which is what free space split across chunks costs.
#[test]
fn a_stream_growth_is_traced_with_the_streams_free_space() {
    let captured = captured();
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = common::runtime_with(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    // Stream a's 100 MiB chunk: 30 MiB free, 30 MiB live, 40 MiB free.
    let a = ctx.create_stream().unwrap();
    drop(ctx.memalloc_on(100 * MIB, &a).unwrap());
    let first = ctx.memalloc_on(30 * MIB, &a).unwrap();
    let live = ctx.memalloc_on(30 * MIB, &a).unwrap();
    drop(first);
    a.synchronize().unwrap();
    // 50 MiB on stream b: no free block of a's holds it.
    let b = ctx.create_stream().unwrap();
    let grown = ctx.memalloc_on(50 * MIB, &b).unwrap();
    drop((grown, live));
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .rfind(|l| l.contains("pool grows for a stream"))
        .unwrap_or_else(|| panic!("no growth traced:\n{text}"));
    for field in [
        format!("requested={}", 50 * MIB),
        format!("streams_free={}", 70 * MIB),
        "free_blocks=2".to_owned(),
        format!("largest_free={}", 40 * MIB),
    ] {
        assert!(line.contains(&field), "{field} in {line}");
    }
}
