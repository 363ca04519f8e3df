//! DLPack tensors as another framework might describe them: any rank, shape, strides (or
//! none), element type, device and byte offset, over a live allocation. The import never
//! panics; a refusal is typed; an accepted tensor's pointer spans exactly the layout's extent
//! from the data pointer plus the offset; the producer's deleter runs exactly once, when the
//! last pointer drops or at once on a refusal.
#![no_main]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType};
use dlpark::metadata::Dynamic;
use driver_mock::{SimConfig, SimDriver};
use emm::Runtime;
use emm_array::ArrayError;
use emm_array::dlpack::import_memory;
use libfuzzer_sys::fuzz_target;

/// Reads the input from the front, padding with zeros past its end.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }

    fn word(&mut self) -> u64 {
        u64::from_le_bytes(std::array::from_fn(|_| self.byte()))
    }

    /// Small values mostly, the edges of i64 sometimes.
    fn dimension(&mut self) -> i64 {
        let w = self.word();
        match w % 8 {
            0 => 0,
            1 => 1,
            2 => -1,
            3 => i64::MAX,
            4 => i64::MIN,
            5 => (w >> 3) as i64,
            _ => ((w >> 3) % 64) as i64,
        }
    }
}

/// The producer's context: counts the deleter's runs.
struct Producer(Arc<AtomicUsize>);

impl Drop for Producer {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let sim = Arc::new(SimDriver::new(SimConfig::single(64 << 20)));
    let rt = Runtime::builder(sim.clone()).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let backing = ctx.memalloc(4096).unwrap();
    let ndim = usize::from(input.byte() % 7);
    let shape: Vec<i64> = (0..ndim).map(|_| input.dimension()).collect();
    let strides: Vec<i64> = (0..ndim).map(|_| input.dimension()).collect();
    let compact = input.byte() % 4 == 0;
    let Ok(prepared) = Dynamic::new(shape, strides).prepare() else {
        return; // dlpark refused the metadata (a negative dimension, say)
    };
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut init = prepared.initialize(Box::new(Producer(Arc::clone(&deleted))));
    if compact {
        // DLPack's "compact row-major": no strides at all.
        init.tensor_mut().strides = std::ptr::null_mut();
    }
    let data_ptr = match input.byte() % 4 {
        0 => 0,
        1 => input.word(),
        _ => backing.device_ptr().0,
    };
    init.set_data(data_ptr as usize as *mut std::ffi::c_void);
    let code = DLDataTypeCode(input.byte() % 20);
    let bits = [0u8, 1, 4, 8, 16, 32, 64, 128, 255][usize::from(input.byte() % 9)];
    let lanes = [0u16, 1, 2, 4, u16::MAX][usize::from(input.byte() % 5)];
    init.set_dtype(DLDataType { code, bits, lanes });
    let device_type = [
        DLDeviceType::CUDA,
        DLDeviceType::CUDAMANAGED,
        DLDeviceType::CUDAHOST,
        DLDeviceType::CPU,
        DLDeviceType(99),
    ][usize::from(input.byte() % 5)];
    let device_id = [0i32, 1, -1, i32::MAX][usize::from(input.byte() % 4)];
    init.set_device(DLDevice {
        device_type,
        device_id,
    });
    let offset = match input.byte() % 4 {
        0 => u64::MAX,
        1 => input.word(),
        _ => u64::from(input.byte()),
    };
    init.set_byte_offset(offset);
    // SAFETY: the descriptor is complete (shape and strides of `ndim` entries from dlpark, or
    // no strides) and nothing reads through its data pointer: an import only records it.
    let tensor = unsafe { init.finish() };
    match import_memory(&ctx, tensor) {
        Ok((Some(mem), layout, _)) => {
            assert_eq!(deleted.load(Ordering::SeqCst), 0, "deleted while imported");
            assert!(layout.size() > 0);
            assert_eq!(mem.size() as u64, layout.extent().1 as u64);
            assert_eq!(mem.device_ptr().0, data_ptr.wrapping_add(offset));
            drop(mem);
            assert_eq!(deleted.load(Ordering::SeqCst), 1, "deleter not run once");
        }
        Ok((None, layout, _)) => {
            assert_eq!(layout.size(), 0);
            assert_eq!(deleted.load(Ordering::SeqCst), 1, "deleter not run once");
        }
        Err(e) => {
            assert!(
                matches!(e, ArrayError::Invalid { .. } | ArrayError::ShapeOverflow { .. }),
                "{e:?}"
            );
            assert_eq!(deleted.load(Ordering::SeqCst), 1, "deleter not run once");
        }
    }
    drop((backing, ctx, rt));
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
});
