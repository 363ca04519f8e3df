//! emm in one page, after NBEP 7's example: put ten zeros on the device, read them back, drop
//! the buffer, and watch the free being deferred and then flushed.
//!
//! `cargo run --example quickstart` runs on the GPU where one is usable and on the simulated
//! driver otherwise (it says which). `EMM_DRIVER=sim|cuda` forces the choice; `EMM_LOG=debug`
//! shows emm's tracing events.

use emm::Runtime;

fn main() -> std::process::ExitCode {
    integration::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("EMM_LOG"))
        .init();

    let choice = integration::driver_from_env()?;
    if choice.simulated {
        println!("Running on the simulated CUDA driver: {}.", choice.reason);
    } else {
        println!("Running on the GPU: {}.", choice.reason);
    }

    // One runtime; the manager comes from EMM_MEMORY_MANAGER ("default" unless set).
    let runtime = Runtime::new(choice.driver)?;
    let ctx = runtime.context(0)?;
    println!("Device 0, memory manager '{}'.", ctx.memory_manager_name());

    // Ten zeros (f64), to the device and back.
    let zeros = vec![0u8; 10 * size_of::<f64>()];
    let d_ary = ctx.to_device(&zeros)?;
    println!(
        "Allocated {} bytes at {}.",
        d_ary.size(),
        d_ary.device_ptr()
    );
    let mut back = vec![0xffu8; zeros.len()];
    ctx.copy_to_host(&mut back, &d_ary)?;
    let values: Vec<f64> = back
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    println!("Read back: {values:?}");

    // Dropping the buffer defers its free.
    let pending = ctx
        .deallocations()
        .expect("the default manager defers frees");
    let before = ctx.get_memory_info()?;
    drop(d_ary);
    println!(
        "Dropped the buffer: {} free(s) pending, {} bytes ({} allowed before a flush).",
        pending.len(),
        pending.pending_bytes(),
        pending.max_pending_bytes()
    );

    // A flush (or the 11th pending free, or out-of-memory) issues it.
    let freed = pending.flush()?;
    let after = ctx.get_memory_info()?;
    println!(
        "Flushed: {freed} free(s) issued, {} pending. Free memory {} -> {} of {} bytes.",
        pending.len(),
        before.free,
        after.free,
        after.total
    );
    Ok(())
}
