//! scratch (not committed)
use driver_mock::{SimConfig, SimDriver};
use emm::Runtime;
use std::sync::Arc;
fn main() {
    let which = std::env::args().nth(1).unwrap_or("default".into());
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name(&which)
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    for _ in 0..100 {
        drop(ctx.memalloc(256).unwrap());
    }
    if let Some(q) = ctx.deallocations() {
        q.flush().unwrap();
    }
    for _ in 0..100_000 {
        drop(std::hint::black_box(
            ctx.memalloc(std::hint::black_box(256)).unwrap(),
        ));
    }
}
