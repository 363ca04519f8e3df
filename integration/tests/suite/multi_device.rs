//! Several devices: contexts on each, IPC between processes on different devices, directly
//! between peers and through the staged path (forced, and chosen when the devices are not
//! peers). On the simulator both with and without peer access; on the GPU where there are two.

use driver_mock::{SimConfig, SimDeviceConfig};
use integration::{IpcMode, Target, TestCtx, open_in_other_process};
use libtest_mimic::Failed;

fn machine(target: Target, peers: bool) -> Result<TestCtx, Failed> {
    let devices = vec![
        SimDeviceConfig::new(128 << 20),
        SimDeviceConfig::new(128 << 20),
    ];
    Ok(TestCtx::with_sim_config(
        target,
        SimConfig::with_devices(devices).peer_access(peers),
        |b| b,
    )?)
}

/// The peer settings to try: both on the simulator; what the hardware has on the GPU.
fn peer_settings(target: Target) -> Vec<bool> {
    match target {
        Target::Sim => vec![true, false],
        Target::Cuda => vec![true],
    }
}

/// Every device gets its own context and memory; resetting one device leaves the other alone.
pub fn contexts_on_every_device(target: Target) -> Result<(), Failed> {
    let t = machine(target, true)?;
    let n = t.runtime.device_count()?;
    ensure!(n >= 2, "needs two devices, has {n}");
    let mut held = Vec::new();
    for d in 0..n {
        let ctx = t.runtime.context(d)?;
        let data = vec![d as u8 + 1; 4096];
        let mem = ctx.to_device(&data)?;
        held.push((ctx, mem, data));
    }
    ensure!(
        held[0].0.handle() != held[1].0.handle(),
        "distinct contexts"
    );
    ensure!(
        held[0].1.device_ptr() != held[1].1.device_ptr(),
        "distinct memory"
    );
    t.runtime.reset_device(0)?;
    let (ctx1, mem1, data1) = &held[1];
    let mut back = vec![0u8; 4096];
    ctx1.copy_to_host(&mut back, mem1)?;
    ensure!(
        &back == data1,
        "device 1's memory survived device 0's reset"
    );
    ensure!(!held[0].0.is_alive() && ctx1.is_alive());
    Ok(())
}

/// Export on device 0, open in another process on device 1: directly (peers) or staged (not
/// peers, or forced); the data arrives intact every way, and the exporter's memory is freed once.
pub fn ipc_between_processes_on_different_devices(target: Target) -> Result<(), Failed> {
    for peers in peer_settings(target) {
        let t = machine(target, peers)?;
        let n = t.runtime.device_count()?;
        ensure!(n >= 2, "needs two devices, has {n}");
        let ctx = t.runtime.context(0)?;
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let mem = ctx.to_device(&data)?;
        let view = mem.view(1000, Some(3000))?;
        let bytes = ctx.get_ipc_handle(&view)?.to_bytes();
        for mode in [IpcMode::Auto, IpcMode::Staged] {
            let seen = open_in_other_process(&t, &bytes, mode, 1)?;
            ensure!(
                seen == data[1000..3000],
                "peers {peers}, {mode:?}: the data differs"
            );
        }
        let mut back = vec![0u8; 4096];
        ctx.copy_to_host(&mut back, &mem)?;
        ensure!(back == data, "the exporter's memory is untouched");
        drop((view, mem));
        ctx.deallocations().expect("queue").flush()?;
        ctx.trim()?;
        if let Some(sim) = t.sim() {
            ensure!(
                sim.rejected_frees().is_empty(),
                "{:?}",
                sim.rejected_frees()
            );
            ensure!(
                sim.leak_report().no_memory_leaked(),
                "{}",
                sim.leak_report()
            );
        }
    }
    Ok(())
}

/// Memory of device 0 used through device 1's context, as measured on two H200s: with unified
/// addressing a copy or a free reaches it, but `cuMemGetAddressRange` (a per-context lookup)
/// answers `CUDA_ERROR_NOT_FOUND`. emm refuses the misuse itself with `WrongContext`, before
/// any driver call.
pub fn wrong_context_conformance(target: Target) -> Result<(), Failed> {
    #![allow(unsafe_code)]
    use driver_sys::{DeviceOrdinal, Driver};
    let t = machine(target, true)?;
    let d: &dyn Driver = &*t.driver;
    let (c0, c1) = (
        d.primary_ctx_retain(DeviceOrdinal(0))?,
        d.primary_ctx_retain(DeviceOrdinal(1))?,
    );
    let a = d.mem_alloc(c0, 4096)?;
    let range = d.mem_get_address_range(c1, a);
    // SAFETY: `a` is a live 4096-byte allocation of this test, used by no one else.
    let copy = unsafe { d.memcpy_htod(c1, a, &[1u8; 64]) };
    // SAFETY: frees `a` once (through the other device's context: the misuse under test).
    let free = unsafe { d.mem_free(c1, a) };
    let outcome = format!("address range {range:?}, copy {copy:?}, free {free:?}");
    if free.is_err() {
        // SAFETY: the misuse did not free it; free it properly, once.
        unsafe { d.mem_free(c0, a)? };
    }
    // SAFETY: match the two retains above.
    unsafe {
        d.primary_ctx_release(DeviceOrdinal(1))?;
        d.primary_ctx_release(DeviceOrdinal(0))?;
    }
    ensure!(
        range
            .as_ref()
            .is_err_and(|e| e.kind() == driver_sys::ErrorKind::NotFound),
        "{outcome}"
    );
    ensure!(copy.is_ok() && free.is_ok(), "{outcome}");

    let ctx0 = t.runtime.context(0)?;
    let ctx1 = t.runtime.context(1)?;
    let mem = ctx0.to_device(&[2u8; 64])?;
    let mut back = [0u8; 64];
    let refused = ctx1.copy_to_host(&mut back, &mem);
    ensure!(
        matches!(refused, Err(emm::EmmError::WrongContext { .. })),
        "{refused:?}"
    );
    let text = refused.unwrap_err().to_string();
    ensure!(text.contains("belongs to device 0, not device 1"), "{text}");
    Ok(())
}

/// Typed arrays copied between devices (`emm_array`'s `copy_across`) by every route: peer,
/// staged through page-locked memory (forced), and the automatic choice; one array larger than
/// the 16 MiB staging chunk so that the staged route takes several. The elements arrive intact
/// both ways, under the suite's manager, with and without peer access on the simulator.
pub fn arrays_across_devices(target: Target) -> Result<(), Failed> {
    use emm_array::{DeviceArray, Order, Route};
    for peers in peer_settings(target) {
        let t = machine(target, peers)?;
        let (c0, c1) = (t.runtime.context(0)?, t.runtime.context(1)?);
        for elements in [1usize, 1000, (40 << 20) / 4 + 3] {
            let data: Vec<u32> = (0..elements as u32)
                .map(|i| i.wrapping_mul(2654435761))
                .collect();
            let shape = if elements % 4 == 0 {
                vec![elements / 4, 4]
            } else {
                vec![elements]
            };
            let a = DeviceArray::to_device(&c0, &data, &shape, Order::F)?;
            let pooled = c0.stream_ordering() == emm::contract::StreamOrdering::Driver;
            // A new array of `to` holding `src` (an array of `from`), copied by `route` and read
            // back.
            let copy = |to: &emm::Context, from: &emm::Context, src: &DeviceArray<u32>, route| {
                let dst = DeviceArray::<u32>::new(to, &shape, Order::F)?;
                dst.copy_across(to, from, src, route).map_err(|e| {
                    format!(
                        "peers {peers}, {route:?}, {} -> {}: {e}",
                        from.device().0,
                        to.device().0
                    )
                })?;
                ensure!(
                    dst.copy_to_host_vec(to)? == data,
                    "peers {peers}, {route:?}, {elements} elements: device {} got other elements",
                    to.device().0
                );
                Ok::<_, Failed>(dst)
            };
            // Mapped memory (`vmm-pool`) is granted only to the devices that can reach it as
            // peers: a peer copy from another device is refused, as the driver refuses one of
            // memory it was not granted.
            let mapped = c0.memory_manager_name() == emm::plugin::VMM_POOL_MANAGER && !peers;
            for route in [Route::Peer, Route::Staged, Route::Auto] {
                if mapped && route == Route::Peer {
                    let b = DeviceArray::<u32>::new(&c1, &shape, Order::F)?;
                    ensure!(
                        b.copy_across(&c1, &c0, &a, route).is_err(),
                        "a peer copy of mapped memory to a device it was not granted to was not refused"
                    );
                    continue;
                }
                if pooled && route == Route::Peer {
                    let b = DeviceArray::<u32>::new(&c1, &shape, Order::F)?;
                    let refused = b.copy_across(&c1, &c0, &a, route);
                    ensure!(
                        refused.is_err_and(|e| e.to_string().contains("stream-ordered pool")),
                        "a peer copy of stream-ordered pool memory was not refused clearly"
                    );
                    continue;
                }
                let b = copy(&c1, &c0, &a, route)?;
                copy(&c0, &c1, &b, route)?;
            }
            // A layout mismatch is refused, not copied.
            let c_order = DeviceArray::<u32>::new(&c1, &shape, Order::C)?;
            if shape.len() == 2 && shape[0] > 1 {
                ensure!(
                    c_order.copy_across(&c1, &c0, &a, Route::Auto).is_err(),
                    "a C-order array took an F-order array's bytes"
                );
            }
        }
    }
    Ok(())
}
