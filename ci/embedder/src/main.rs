//! README's first program, as an embedder outside the workspace writes it: the real driver, device 0, eighty bytes to the
//! device and back, a deferred free flushed. Without a GPU it exits with the driver's message
//! (status 1), never a panic.

use std::process::ExitCode;
use std::sync::Arc;

use emm::{Runtime, driver_sys::CudaDriver};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let runtime = Runtime::new(Arc::new(CudaDriver::load()?))?; // manager from EMM_MEMORY_MANAGER
    let ctx = runtime.context(0)?; // device 0; initialize() runs on each use
    let buf = ctx.to_device(&[0u8; 80])?; // memalloc + copy
    let mut back = [0xffu8; 80];
    ctx.copy_to_host(&mut back, &buf)?;
    assert_eq!(back, [0u8; 80]);
    drop(buf); // the free is queued, not issued
    let issued = ctx.flush_deallocations()?; // issued now (or at the 11th pending free)
    println!("emm-embedder: 80 bytes to device 0 and back, {issued} deferred free issued");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("emm-embedder: {e}");
            ExitCode::FAILURE
        }
    }
}
