//! emm in one page, after NBEP 7's example (`d_a = cuda.to_device(np.zeros(10))`): put ten
//! zeros (f64) on the device as a typed array, read them back, look at them as a 2 × 5 view,
//! drop the array, and watch the free being deferred and then flushed.
//!
//! `cargo run --example quickstart` runs on the GPU where one is usable and on the simulated
//! driver otherwise (it says which). `EMM_DRIVER=sim|cuda` forces the choice; `EMM_LOG=debug`
//! shows emm's tracing events.

use emm::Runtime;
use emm_array::{DeviceArray, Order};

fn main() -> std::process::ExitCode {
    integration::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    integration::log_from_env();

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

    // Ten zeros (f64), to the device as a typed array and back.
    let d_a = DeviceArray::to_device(&ctx, &[0f64; 10], &[10], Order::C)?;
    let mem = d_a.memory().expect("ten elements take memory");
    println!(
        "Allocated {} bytes at {} for an array of shape {:?}.",
        mem.size(),
        mem.device_ptr(),
        d_a.shape()
    );
    let values = d_a.copy_to_host_vec(&ctx)?;
    println!("Read back: {values:?}");
    let view = d_a.reshape(&[2, 5])?; // a view of the same memory
    println!(
        "As a {:?} view: strides {:?} bytes, C-contiguous {}.",
        view.shape(),
        view.strides(),
        view.is_c_contiguous()
    );

    // Dropping the buffer defers its free.
    let pending = ctx
        .deallocations()
        .expect("the default manager defers frees");
    let before = ctx.get_memory_info()?;
    drop((d_a, view)); // the memory is freed once its last view is gone
    println!(
        "Dropped the array: {} free(s) pending, {} bytes ({} allowed before a flush).",
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
