//! DLPack on the simulator: export and import round trips (versioned and legacy ABIs) with
//! random shapes, orders and first-axis slices; a foreign tensor's deleter runs exactly once,
//! after the last view drops, or at once when the import is refused; the refusals say why; the
//! simulator reports no leak.
//!
//! 256 cases per property; `PROPTEST_CASES=N` for more.
#![cfg(feature = "dlpack")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensor};
use dlpark::metadata::Dynamic;
use driver_mock::{SimConfig, SimDeviceConfig, SimDriver};
use emm_array::dlpack::{export_memory, import_memory};
use emm_array::{ArrayError, DeviceArray, HostArray, Layout, Order};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn runtime(devices: usize) -> (Arc<SimDriver>, emm::Runtime) {
    let sim = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(64 << 20);
        devices
    ])));
    let rt = emm::Runtime::builder(sim.clone())
        .ignore_env()
        .build()
        .unwrap();
    (sim, rt)
}

/// A "foreign" producer's tensor context: it owns the memory (emm memory the test allocated,
/// standing in for another framework's) and counts the deleter's runs.
struct Foreign {
    _mem: emm::MemoryPointer,
    deleted: Arc<AtomicUsize>,
}

impl Drop for Foreign {
    fn drop(&mut self) {
        self.deleted.fetch_add(1, Ordering::SeqCst);
    }
}

/// A legacy-ABI tensor over `mem` with `shape` and element `strides` (`None`: compact), as
/// another framework would make it.
fn foreign_tensor(
    mem: emm::MemoryPointer,
    shape: &[i64],
    strides: &[i64],
    dtype: DLDataType,
    device: DLDevice,
    deleted: &Arc<AtomicUsize>,
) -> dlpark::legacy::Dlpack {
    let data = mem.device_ptr().0 as usize as *mut std::ffi::c_void;
    let prepared = Dynamic::new(shape.to_vec(), strides.to_vec())
        .prepare_as::<DLManagedTensor>()
        .unwrap();
    let mut init = prepared.initialize(Box::new(Foreign {
        _mem: mem,
        deleted: Arc::clone(deleted),
    }));
    init.set_data(data);
    init.set_dtype(dtype);
    init.set_device(device);
    // SAFETY: complete descriptor over memory the context owns; the tests keep every element
    // the shape and strides reach inside it.
    unsafe { init.finish() }
}

fn c_strides(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// An array (or a first-axis slice of it) exported and imported again, through either ABI,
    /// reads the same elements, shares the memory, and carries DLPack's element strides; once
    /// every view and tensor is gone, nothing leaks.
    #[test]
    fn export_import_round_trips(
        shape in prop::collection::vec(0usize..5, 0..4),
        f_order in any::<bool>(),
        legacy in any::<bool>(),
        cut in any::<(u8, u8)>(),
    ) {
        let (sim, rt) = runtime(1);
        let ctx = rt.context(0).unwrap();
        let order = if f_order { Order::F } else { Order::C };
        let n: usize = shape.iter().product();
        let host: Vec<f64> = (0..n).map(|i| i as f64 * 1.5 - 7.0).collect();
        let whole = DeviceArray::to_device(&ctx, &host, &shape, order).unwrap();
        let a = match shape.first() {
            Some(&rows) if rows > 0 => {
                let start = cut.0 as usize % rows;
                let stop = start + cut.1 as usize % (rows - start + 1);
                whole.slice(start, stop).unwrap()
            }
            _ => whole.clone(),
        };
        let strides: Vec<i64> = a.strides().iter().map(|s| (*s / 8) as i64).collect();
        let b = if legacy {
            let t = a.to_dlpack_as::<DLManagedTensor>().unwrap();
            let v = t.validate().unwrap();
            prop_assert_eq!(v.strides(), if a.shape().is_empty() { None } else { Some(&strides[..]) });
            prop_assert_eq!(v.device().device_type, DLDeviceType::CUDA);
            DeviceArray::<f64>::from_dlpack(&ctx, t).unwrap()
        } else {
            let t = a.to_dlpack().unwrap();
            let v = t.validate().unwrap();
            let shape_i64: Vec<i64> = a.shape().iter().map(|&x| x as i64).collect();
            prop_assert_eq!(v.shape(), &shape_i64[..]);
            DeviceArray::<f64>::from_dlpack(&ctx, t).unwrap()
        };
        prop_assert_eq!(b.shape(), a.shape());
        prop_assert_eq!(b.strides(), a.strides());
        prop_assert_eq!(b.memory().map(|m| m.device_ptr()), a.memory().map(|m| m.device_ptr()));
        if a.is_c_contiguous() || a.is_f_contiguous() {
            prop_assert_eq!(b.copy_to_host_vec(&ctx).unwrap(), a.copy_to_host_vec(&ctx).unwrap());
        }
        // The imported array outlives the exporter's arrays: the tensor keeps the memory.
        drop((whole, a));
        ctx.flush_deallocations().unwrap();
        if let Some(m) = b.memory() {
            let mut back = vec![0u8; 8];
            ctx.copy_to_host(&mut back, &m.view(0, Some(8)).unwrap()).unwrap();
        }
        drop(b);
        ctx.flush_deallocations().unwrap();
        drop(ctx);
        drop(rt);
        prop_assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
    }

    /// A foreign tensor's deleter runs exactly once, only after the imported array and every
    /// view of it (clones, reshapes, slices) are gone, in any order.
    #[test]
    fn the_deleter_runs_once_after_the_last_view(rows in 1usize..6, cols in 1usize..6, drop_order in any::<u64>()) {
        let (sim, rt) = runtime(1);
        let ctx = rt.context(0).unwrap();
        let deleted = Arc::new(AtomicUsize::new(0));
        let n = rows * cols;
        let host: Vec<i32> = (0..n as i32).collect();
        let mem = ctx.to_device(bytemuck::cast_slice(&host)).unwrap();
        let shape = [rows as i64, cols as i64];
        let t = foreign_tensor(mem, &shape, &c_strides(&shape), DLDataType::I32, DLDevice::cuda(0), &deleted);
        let a = DeviceArray::<i32>::from_dlpack(&ctx, t).unwrap();
        prop_assert_eq!(a.copy_to_host_vec(&ctx).unwrap(), host.clone());
        let mut views = vec![a.clone(), a.reshape(&[n]).unwrap(), a.slice(0, 1).unwrap(), a.ravel().unwrap(), a];
        let mut pick = drop_order;
        while !views.is_empty() {
            prop_assert_eq!(deleted.load(Ordering::SeqCst), 0, "deleted while a view lives");
            let i = (pick % views.len() as u64) as usize;
            pick /= 7;
            views.swap_remove(i);
        }
        prop_assert_eq!(deleted.load(Ordering::SeqCst), 1);
        ctx.flush_deallocations().unwrap();
        drop(ctx);
        drop(rt);
        prop_assert_eq!(deleted.load(Ordering::SeqCst), 1);
        prop_assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
    }
}

/// Each refused import says what is wrong and runs the deleter at once (the tensor is not
/// leaked).
#[test]
fn refused_imports_say_why_and_delete_once() {
    let (sim, rt) = runtime(2);
    let ctx = rt.context(0).unwrap();
    let cases: Vec<(&str, DLDataType, DLDevice, Vec<i64>, &str)> = vec![
        (
            "element type",
            DLDataType::F32,
            DLDevice::cuda(0),
            vec![4, 1],
            "not",
        ),
        (
            "another device",
            DLDataType::I32,
            DLDevice::cuda(1),
            vec![4, 1],
            "on device 1 but the context is on device 0",
        ),
        (
            "host memory",
            DLDataType::I32,
            DLDevice {
                device_type: DLDeviceType::CUDAHOST,
                device_id: 0,
            },
            vec![4, 1],
            "device type 3",
        ),
        (
            "CPU memory",
            DLDataType::I32,
            DLDevice::CPU,
            vec![4, 1],
            "device type 1",
        ),
        (
            // Found by the `dlpack_import` fuzz target: the extent overflowed.
            "strides reaching past isize::MAX",
            DLDataType::I32,
            DLDevice::cuda(0),
            vec![i64::MAX / 8, i64::MAX / 8],
            "reach more than isize::MAX bytes",
        ),
        (
            "negative stride",
            DLDataType::I32,
            DLDevice::cuda(0),
            vec![-4, 1],
            "negative",
        ),
    ];
    for (what, dtype, device, strides, says) in cases {
        let deleted = Arc::new(AtomicUsize::new(0));
        let mem = ctx.memalloc(64).unwrap();
        let t = foreign_tensor(mem, &[2, 4], &strides, dtype, device, &deleted);
        let err = DeviceArray::<i32>::from_dlpack(&ctx, t).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                ArrayError::Invalid {
                    what: "from_dlpack",
                    ..
                }
            ) && text.contains(says),
            "{what}: {text}"
        );
        assert_eq!(
            deleted.load(Ordering::SeqCst),
            1,
            "{what}: deleter runs once"
        );
    }
    // A stride that is not a whole number of elements cannot be exported.
    let mem = ctx.memalloc(64).unwrap();
    let odd = Layout::with_strides(&[3], &[6], 4).unwrap();
    let Err(err) =
        export_memory::<DLManagedTensor>(Some(mem), &odd, DLDataType::I32, DLDevice::cuda(0))
    else {
        panic!("a stride of 6 bytes for 4-byte elements was exported");
    };
    assert!(err.to_string().contains("not a whole number"), "{err}");
    ctx.flush_deallocations().unwrap();
    drop(ctx);
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}

/// Untyped import (a runtime that learns the element type at run time) reports the tensor's
/// dtype and layout; an empty tensor takes no memory and is deleted at once.
#[test]
fn untyped_import_and_empty_tensors() {
    let (sim, rt) = runtime(1);
    let ctx = rt.context(0).unwrap();
    let deleted = Arc::new(AtomicUsize::new(0));
    let mem = ctx.memalloc(96).unwrap();
    let t = foreign_tensor(
        mem.clone(),
        &[3, 4],
        &[1, 3],
        DLDataType::U16,
        DLDevice::cuda(0),
        &deleted,
    );
    let (got, layout, dtype) = import_memory(&ctx, t).unwrap();
    assert_eq!(dtype, DLDataType::U16);
    assert_eq!(
        (layout.shape(), layout.strides()),
        (&[3, 4][..], &[2, 6][..])
    );
    assert_eq!(got.unwrap().device_ptr(), mem.device_ptr());
    assert_eq!(deleted.load(Ordering::SeqCst), 1);

    let empty = foreign_tensor(
        mem.clone(),
        &[0, 4],
        &[4, 1],
        DLDataType::U16,
        DLDevice::cuda(0),
        &deleted,
    );
    let a = DeviceArray::<u16>::from_dlpack(&ctx, empty).unwrap();
    assert!(a.memory().is_none());
    assert_eq!(deleted.load(Ordering::SeqCst), 2);

    // Host arrays export as CUDA host and CUDA managed memory, which the tensor keeps.
    let pinned = HostArray::<u16>::pinned(&ctx, &[2, 2], Order::C).unwrap();
    pinned.write(&[1, 2, 3, 4]).unwrap();
    let t = pinned.into_dlpack().unwrap();
    assert_eq!(
        t.validate().unwrap().device().device_type,
        DLDeviceType::CUDAHOST
    );
    let managed = HostArray::<u16>::managed(&ctx, &[5], Order::C).unwrap();
    let m = managed.into_dlpack().unwrap();
    let v = m.validate().unwrap();
    assert_eq!(
        (v.device().device_type, v.device().device_id),
        (DLDeviceType::CUDAMANAGED, 0)
    );
    drop((t, m, mem));
    ctx.flush_deallocations().unwrap();
    drop(ctx);
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}

/// An array whose memory is asleep (`Context::sleep` under `vmm-pool`) is not exported: a
/// consumer's kernels would fault on it. After the wake it is, with its contents back.
#[test]
fn sleeping_arrays_are_not_exported() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(256 << 20)));
    let rt = emm::Runtime::builder(sim)
        .ignore_env()
        .memory_manager_name("vmm-pool")
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    let a = DeviceArray::to_device(&ctx, &[7u32; 64], &[64], Order::C).unwrap();
    assert!(!a.memory().unwrap().is_asleep());
    ctx.sleep(&emm::SleepOptions::new(emm::SleepChoice::Offload))
        .unwrap();
    assert!(a.memory().unwrap().is_asleep());
    match a.to_dlpack() {
        Err(ArrayError::Emm(emm::EmmError::Sleep { what, .. })) => {
            assert_eq!(what, "DLPack export")
        }
        other => panic!("a sleeping array was exported: {:?}", other.err()),
    }
    ctx.wake().unwrap();
    assert!(!a.memory().unwrap().is_asleep());
    let b = DeviceArray::<u32>::from_dlpack(&ctx, a.to_dlpack().unwrap()).unwrap();
    assert_eq!(b.copy_to_host_vec(&ctx).unwrap(), [7u32; 64]);
}
