//! A CUDA graph over emm memory: captures a cudarc kernel launch (`kernels/axpy.ptx`,
//! `y = a * x + y`) on a cudarc stream made an emm stream, with a scratch array allocated
//! during the capture from the graph pool `Context::capture` begins, then replays the graph
//! and checks every element, under every memory manager emm registers. Device memory held is
//! the same after the last replay as after the first.
//!
//! `cargo run --release -p integration --example graph_kernel` needs a GPU: a kernel cannot run
//! on the simulated driver. Without one it says why and exits successfully, unless
//! `EMM_REQUIRE_GPU=1` (the GPU job), which makes a missing GPU a failure.

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use emm::Runtime;
use emm::driver_sys::CaptureMode;
use emm_array::{DeviceArray, Order};

const AXPY_PTX: &str = include_str!("kernels/axpy.ptx");

/// Elements per array.
const N: usize = 65_537;
/// Launches of the captured graph.
const REPLAYS: usize = 50;

fn main() -> std::process::ExitCode {
    integration::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    if let Some(managers) = integration::on_the_gpu_under_every_manager(replay_under)? {
        println!(
            "a captured axpy replayed {REPLAYS} times under {} managers",
            managers.len()
        );
    }
    Ok(())
}

fn replay_under(runtime: Runtime, manager: &str) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = runtime.context(0)?;
    let cuda = CudaContext::new(0)?;
    let module = cuda.load_module(Ptx::from_src(AXPY_PTX))?;
    let axpy = module.load_function("axpy")?;
    let stream = cuda.new_stream()?;
    let on = emm_array::cudarc::emm_stream(&ctx, &stream)?;
    let x_host: Vec<f32> = (0..N).map(|i| (i % 97) as f32 * 0.25).collect();
    let x = DeviceArray::to_device_on(&ctx, &x_host, &[N], Order::C, &on)?;
    let mut y = DeviceArray::<f32>::to_device_on(&ctx, &vec![0.0; N], &[N], Order::C, &on)?;
    let (a, n) = (2.0f32, N as u32);

    // Captured: x copied into a scratch array of the graph's pool, then y += a * scratch.
    let mut failed: Option<Box<dyn std::error::Error>> = None;
    let (graph, scratch) = ctx.capture(&on, CaptureMode::Global, |s| {
        let mut scratch = match DeviceArray::<f32>::new_on(&ctx, &[N], Order::C, s) {
            Ok(a) => a,
            Err(e) => {
                failed = Some(e.into());
                return Ok(None);
            }
        };
        let (dst, src) = (scratch.memory().cloned(), x.memory().cloned());
        if let (Some(dst), Some(src)) = (dst, src) {
            ctx.copy_device_async(&dst, &src, s)?.wait()?;
        }
        let mut launch = stream.launch_builder(&axpy);
        launch.arg(&mut y).arg(&mut scratch).arg(&a).arg(&n);
        // SAFETY: `axpy(float *y, const float *x, float a, unsigned n)` takes these four
        // arguments; `y` and `scratch` hold `N` f32 each and outlive every launch of the graph
        // (dropped after the last replay is waited for).
        if let Err(e) = unsafe { launch.launch(LaunchConfig::for_num_elems(n)) } {
            failed = Some(e.into());
        }
        Ok(Some(scratch))
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    let used = || -> Result<usize, emm::EmmError> {
        let info = ctx.get_memory_info()?;
        Ok(info.total - info.free)
    };
    let mut held_after_first = 0;
    for k in 1..=REPLAYS {
        graph.launch(&on)?;
        on.synchronize()?;
        if k == 1 {
            held_after_first = used()?;
        }
    }
    let got = y.copy_to_host_vec_on(&ctx, &on)?;
    let mut expect = vec![0f32; N];
    for _ in 0..REPLAYS {
        for (e, x) in expect.iter_mut().zip(&x_host) {
            *e = a.mul_add(*x, *e);
        }
    }
    if let Some(i) = got
        .iter()
        .zip(&expect)
        .position(|(g, e)| g.to_bits() != e.to_bits())
    {
        return Err(format!(
            "{manager}: element {i} is {} after {REPLAYS} replays, the host computed {}",
            got[i], expect[i]
        )
        .into());
    }
    let held_after_last = used()?;
    if held_after_last != held_after_first {
        return Err(format!(
            "{manager}: device memory used went from {held_after_first} to {held_after_last} bytes over the replays"
        )
        .into());
    }
    let pool = graph.pool().clone();
    drop((graph, scratch));
    if pool.stats().in_use_blocks != 0 {
        return Err(format!(
            "{manager}: the graph pool still has blocks: {:?}",
            pool.stats()
        )
        .into());
    }
    drop(pool);
    drop((x, y));
    on.synchronize()?;
    ctx.flush_deallocations()?;
    println!("{manager}: {REPLAYS} replays of a captured axpy matched the host; memory held flat");
    Ok(())
}
