//! What an `InFlight` does when the work it waits for can never finish (the simulator reports
//! such a wait instead of hanging, as a GPU would): dropping it leaks the buffers the work uses
//! rather than freeing them under the work. Simulator only: on a GPU the drop would wait forever.

use driver_sys::{Driver, wait_value};

use crate::common::{runtime_with, sim};

#[test]
fn an_in_flight_copy_that_cannot_finish_leaks_instead_of_freeing() {
    for manager in ["default", "pool", "async-pool"] {
        let sim = sim();
        let rt = runtime_with(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let s = ctx.create_stream_with(true, 0).unwrap();
        let flag = ctx.memhostalloc(64, true, false, false).unwrap();
        flag.write(0, &0u32.to_le_bytes()).unwrap();
        let at = flag.mapped().unwrap().device().device_ptr();
        sim.stream_wait_value32(ctx.handle(), s.handle(), at, 1, wait_value::EQ)
            .unwrap();
        let dst = ctx.memalloc(4096).unwrap();
        let dst_addr = dst.device_ptr();
        let src = ctx.memhostalloc(4096, false, false, false).unwrap();
        let src_addr = src.host_ptr();
        let queued = ctx.copy_to_device_async(&dst, src, &s).unwrap();
        assert!(!queued.is_done().unwrap(), "{manager}: held");
        drop(dst);
        // The drop cannot wait (nothing will write the flag): the memory is leaked.
        drop(queued);
        ctx.flush_deallocations().unwrap();
        let held = sim.leak_report();
        assert!(
            held.host_allocations.iter().any(|(p, _)| *p == src_addr),
            "{manager}: the source is still allocated"
        );
        if manager == "default" {
            assert!(
                held.allocations.iter().any(|(_, p, _)| *p == dst_addr),
                "{manager}: the destination is still allocated"
            );
        }
        assert!(
            sim.rejected_frees().is_empty(),
            "{manager}: no free was refused"
        );
        // The work can finish once the flag is written; the leak stays a leak.
        flag.write(0, &1u32.to_le_bytes()).unwrap();
        assert_eq!(sim.run_streams(), 0, "{manager}: nothing left waiting");
    }
}
