//! The `stats` adaptor: current, peak and total bytes and counts per kind of memory.

use crate::adaptors::{Event, Observer};
use crate::contract::info::{KindUsage, Usage};
use crate::sync::{AtomicU64, AtomicUsize, Ordering};

#[derive(Debug, Default)]
pub(super) struct KindCounters {
    pub(super) current_bytes: AtomicUsize,
    pub(super) peak_bytes: AtomicUsize,
    pub(super) total_bytes: AtomicU64,
    pub(super) current_count: AtomicUsize,
    pub(super) peak_count: AtomicUsize,
    pub(super) total_count: AtomicU64,
}

#[derive(Debug, Default)]
pub(super) struct Stats {
    pub(super) kinds: [KindCounters; 5],
}

impl Observer for Stats {
    fn allocated(&self, e: &Event) {
        if e.addr.is_none() {
            return;
        }
        let k = &self.kinds[e.kind.index()];
        let bytes = k.current_bytes.fetch_add(e.bytes, Ordering::Relaxed) + e.bytes;
        k.peak_bytes.fetch_max(bytes, Ordering::Relaxed);
        k.total_bytes.fetch_add(e.bytes as u64, Ordering::Relaxed);
        let count = k.current_count.fetch_add(1, Ordering::Relaxed) + 1;
        k.peak_count.fetch_max(count, Ordering::Relaxed);
        k.total_count.fetch_add(1, Ordering::Relaxed);
    }

    fn freed(&self, e: &Event) {
        let k = &self.kinds[e.kind.index()];
        k.current_bytes.fetch_sub(e.bytes, Ordering::Relaxed);
        k.current_count.fetch_sub(1, Ordering::Relaxed);
    }

    fn usage(&self) -> Option<Usage> {
        let read = |k: &KindCounters| KindUsage {
            current_bytes: k.current_bytes.load(Ordering::Relaxed),
            peak_bytes: k.peak_bytes.load(Ordering::Relaxed),
            total_bytes: k.total_bytes.load(Ordering::Relaxed),
            current_count: k.current_count.load(Ordering::Relaxed),
            peak_count: k.peak_count.load(Ordering::Relaxed),
            total_count: k.total_count.load(Ordering::Relaxed),
        };
        Some(Usage {
            device: read(&self.kinds[0]),
            pinned: read(&self.kinds[1]),
            mapped: read(&self.kinds[2]),
            pin: read(&self.kinds[3]),
            managed: read(&self.kinds[4]),
        })
    }
}
