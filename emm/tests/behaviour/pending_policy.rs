//! The deferred-deallocation policy, one sentence of the rule per test (numba-emm-spec §2).
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_mock::{Fault, Op, SimConfig, SimDriver};
use driver_sys::{ContextHandle, DeviceOrdinal, Driver, ErrorKind};
use emm::plugin::{ContextLiveness, DeallocConfig, Free, PendingDeallocs};

struct Setup {
    sim: Arc<SimDriver>,
    ctx: ContextHandle,
    liveness: Arc<ContextLiveness>,
    queue: Arc<PendingDeallocs>,
}

fn setup(config: DeallocConfig, capacity: usize) -> Setup {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    sim.init().unwrap();
    let ctx = sim.primary_ctx_retain(DeviceOrdinal(0)).unwrap();
    let liveness = Arc::new(ContextLiveness::new());
    let queue = Arc::new(PendingDeallocs::new(
        sim.clone(),
        DeviceOrdinal(0),
        ctx,
        liveness.clone(),
        config,
    ));
    if capacity > 0 {
        assert!(queue.set_capacity_once(capacity));
    }
    Setup {
        sim,
        ctx,
        liveness,
        queue,
    }
}

impl Setup {
    /// Queues `item` on the queue.
    fn push(&self, item: Free) -> Result<(), emm::EmmError> {
        // SAFETY: every free these tests queue names memory the test allocated in the queue's
        // context for it and queues once (`device_free`), or is queued after the context died,
        // when nothing reaches the driver.
        unsafe { self.queue.push(item) }
    }

    fn device_free(&self, bytes: usize) -> Free {
        let ptr = self.sim.mem_alloc(self.ctx, bytes).unwrap();
        Free::Device { ptr, bytes }
    }
}

#[test]
fn eleventh_item_flushes() {
    let s = setup(DeallocConfig::default(), 1 << 30);
    for i in 1..=10 {
        s.push(s.device_free(8)).unwrap();
        assert_eq!(s.queue.len(), i);
    }
    s.push(s.device_free(8)).unwrap();
    assert_eq!(s.queue.len(), 0);
    assert_eq!(s.sim.count(Op::MemFree), 11);
    assert!(s.sim.leak_report().no_memory_leaked());
}

#[test]
fn exactly_max_bytes_does_not_flush_one_more_does() {
    let s = setup(
        DeallocConfig {
            max_count: 10,
            max_ratio: 0.5,
        },
        2000,
    );
    assert_eq!(s.queue.max_pending_bytes(), 1000);
    s.push(s.device_free(1000)).unwrap();
    assert_eq!(s.queue.len(), 1, "equal to the budget: no flush");
    s.push(s.device_free(1)).unwrap();
    assert_eq!(s.queue.len(), 0, "over the budget: flush");
    assert_eq!(s.queue.pending_bytes(), 0);
}

#[test]
fn unknown_capacity_flushes_any_sized_free_at_once() {
    let s = setup(DeallocConfig::default(), 0);
    assert_eq!(s.queue.max_pending_bytes(), 0);
    s.push(s.device_free(1)).unwrap();
    assert_eq!(s.queue.len(), 0);
}

#[test]
fn capacity_is_set_once() {
    let s = setup(DeallocConfig::default(), 0);
    assert!(s.queue.set_capacity_once(100));
    assert!(!s.queue.set_capacity_once(200));
    assert_eq!(s.queue.capacity(), 100);
}

#[test]
fn disabled_queue_grows_without_flushing_and_resuming_does_not_flush() {
    let s = setup(DeallocConfig::default(), 1 << 30);
    let guard = s.queue.defer_cleanup();
    for _ in 0..25 {
        s.push(s.device_free(8)).unwrap();
    }
    assert_eq!(s.queue.len(), 25);
    assert_eq!(s.queue.flush().unwrap(), 0);
    drop(guard);
    assert!(!s.queue.is_disabled());
    assert_eq!(s.queue.len(), 25, "leaving defer_cleanup does not flush");
    assert_eq!(s.queue.flush().unwrap(), 25);
}

#[test]
fn a_failed_free_leaves_the_queue_later_ones_stay_and_bytes_are_kept() {
    let s = setup(DeallocConfig::default(), 1 << 30);
    let guard = s.queue.defer_cleanup();
    for _ in 0..4 {
        s.push(s.device_free(100)).unwrap();
    }
    drop(guard);
    s.sim
        .inject(Fault::nth(Op::MemFree, 2, ErrorKind::InvalidValue));
    let err = s.queue.flush().unwrap_err();
    assert_eq!(err.driver_kind(), Some(ErrorKind::InvalidValue));
    assert!(
        err.to_string()
            .starts_with("deferred deallocation on device 0: cuMemFree failed"),
        "{err}"
    );
    assert_eq!(
        s.queue.len(),
        2,
        "the failing entry is dropped, the later two stay"
    );
    assert_eq!(
        s.queue.pending_bytes(),
        400,
        "bytes are not reset after a failure (Numba)"
    );
    assert_eq!(s.queue.flush().unwrap(), 2);
    assert_eq!(s.queue.pending_bytes(), 0);
}

#[test]
fn dead_context_discards_instead_of_freeing() {
    let s = setup(DeallocConfig::default(), 1 << 30);
    s.push(s.device_free(8)).unwrap();
    s.liveness.kill();
    assert_eq!(s.queue.flush().unwrap(), 0);
    assert_eq!(s.queue.len(), 0);
    s.push(Free::Device {
        ptr: driver_sys::DevicePtr(0x1234),
        bytes: 8,
    })
    .unwrap();
    assert_eq!(
        s.queue.len(),
        0,
        "frees for a destroyed context are dropped"
    );
    assert_eq!(s.sim.count(Op::MemFree), 0, "nothing reached the driver");
}

#[test]
fn nested_guards_and_plugin_parts_release_together() {
    let s = setup(DeallocConfig::default(), 1 << 30);
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    struct Flag(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let outer = s.queue.defer_cleanup();
    let inner = s
        .queue
        .defer_cleanup()
        .join(emm::plugin::DeferCleanup::plugin(Box::new(Flag(
            dropped.clone(),
        ))));
    drop(inner);
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    assert!(s.queue.is_disabled(), "the outer guard still holds");
    drop(outer);
    assert!(!s.queue.is_disabled());
}
