//! A host runtime's kernel on emm's memory: loads a small PTX kernel (`kernels/axpy.ptx`,
//! `y = a * x + y` in f32) with cudarc, and launches it through cudarc's launch builder on emm
//! arrays allocated on an emm stream, under every memory manager emm registers. Each run checks
//! every element against the host's `f32::mul_add`, reads the result both through emm and
//! through cudarc's own copy, and launches once more on a stream emm created.
//!
//! `cargo run --release -p integration --example array_kernel` needs a GPU: a kernel cannot
//! run on the simulated driver. Without one it says why and exits successfully, unless
//! `EMM_REQUIRE_GPU=1` (the GPU job), which makes a missing GPU a failure.

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use emm::Runtime;
use emm_array::{DeviceArray, Order};

/// The kernel, as PTX text kept in the repository (no build step needs CUDA).
const AXPY_PTX: &str = include_str!("kernels/axpy.ptx");

/// Elements per array: a few blocks, and not a multiple of the block size, so the kernel's
/// bound check matters.
const N: usize = 100_003;

fn main() -> std::process::ExitCode {
    integration::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    if let Some(managers) = integration::on_the_gpu_under_every_manager(launch_under)? {
        println!(
            "axpy ran on emm arrays under {} managers: {managers:?}",
            managers.len()
        );
    }
    Ok(())
}

/// One manager: a runtime, the kernel, arrays on a cudarc stream made an emm stream, a launch,
/// and the checks.
fn launch_under(runtime: Runtime, manager: &str) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = runtime.context(0)?;
    // cudarc retains device 0's primary context: the one emm works in.
    let cuda = CudaContext::new(0)?;
    let module = cuda.load_module(Ptx::from_src(AXPY_PTX))?;
    let axpy = module.load_function("axpy")?;

    // A stream made by cudarc, used by emm: the arrays are allocated in its order.
    let stream = cuda.new_stream()?;
    let on = emm_array::cudarc::emm_stream(&ctx, &stream)?;
    let x_host: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let y_host: Vec<f32> = (0..N).map(|i| 1.0 - i as f32).collect();
    let x = DeviceArray::to_device_on(&ctx, &x_host, &[N], Order::C, &on)?;
    let mut y = DeviceArray::to_device_on(&ctx, &y_host, &[N], Order::C, &on)?;
    let (a, n) = (3.0f32, N as u32);
    let mut launch = stream.launch_builder(&axpy);
    launch.arg(&mut y).arg(&x).arg(&a).arg(&n);
    // SAFETY: `axpy(float *y, const float *x, float a, unsigned n)` takes exactly these four
    // arguments; `y` and `x` hold `N` f32 each and the kernel touches elements below `n == N`;
    // both arrays outlive the launch (they are read back below, after the stream finishes).
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;

    let expect: Vec<f32> = x_host
        .iter()
        .zip(&y_host)
        .map(|(x, y)| a.mul_add(*x, *y))
        .collect();
    let through_emm = y.copy_to_host_vec_on(&ctx, &on)?;
    check(manager, "read through emm", &through_emm, &expect)?;
    let mut through_cudarc = vec![0f32; N];
    stream.memcpy_dtoh(&y.cudarc_view(&stream)?, &mut through_cudarc)?;
    stream.synchronize()?;
    check(manager, "read through cudarc", &through_cudarc, &expect)?;

    // A copy through a view has finished when cudarc's call returns: the array may go (its
    // block to the next allocation) at once.
    let scratch = DeviceArray::<f32>::new(&ctx, &[N], Order::C)?;
    stream.memcpy_htod(&x_host, &mut scratch.cudarc_view(&stream)?)?;
    // SAFETY: `cu_stream` is cudarc's live stream; a query reads nothing else.
    let done = unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) };
    if done != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "{manager}: a cudarc copy into a view returned with its stream still busy ({done:?})"
        )
        .into());
    }
    drop(scratch);

    // The other direction: a stream emm created, lent to cudarc for one more launch.
    let emm_made = ctx.create_stream()?;
    {
        // SAFETY: `emm_made` outlives `lent`, which is dropped at the end of this block, after
        // the stream is synchronised; nothing is launched through it afterwards.
        let lent = unsafe { emm_array::cudarc::cudarc_stream(&cuda, &ctx, &emm_made) }?;
        let mut again = lent.launch_builder(&axpy);
        again.arg(&mut y).arg(&x).arg(&a).arg(&n);
        // SAFETY: as above; `y` and `x` are still alive and hold `N` elements.
        unsafe { again.launch(LaunchConfig::for_num_elems(n)) }?;
        emm_made.synchronize()?;
    }
    let twice: Vec<f32> = expect
        .iter()
        .zip(&x_host)
        .map(|(y, x)| a.mul_add(*x, *y))
        .collect();
    check(manager, "second launch", &y.copy_to_host_vec(&ctx)?, &twice)?;

    drop((x, y));
    on.synchronize()?;
    ctx.flush_deallocations()?;
    println!("{manager}: axpy on {N} elements matched the host, read through emm and cudarc");
    Ok(())
}

fn check(manager: &str, what: &str, got: &[f32], expect: &[f32]) -> Result<(), String> {
    match got
        .iter()
        .zip(expect)
        .position(|(g, e)| g.to_bits() != e.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{manager}, {what}: element {i} is {} but the host computed {}",
            got[i], expect[i]
        )),
    }
}
