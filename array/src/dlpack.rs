//! DLPack exchange (the `dlpack` feature), through the `dlpark` crate.
//!
//! - Export: [`DeviceArray::to_dlpack`] hands the array to a DLPack consumer (device type CUDA,
//!   the array's device). The tensor holds a view of the array's memory, so the allocation
//!   lives until the consumer calls the tensor's deleter, however long the array lives.
//!   [`HostArray::into_dlpack`] exports page-locked arrays as CUDA host memory and managed
//!   arrays as CUDA managed memory.
//! - Import: [`DeviceArray::from_dlpack`] takes a tensor made elsewhere (PyTorch, CuPy, another
//!   runtime) as an array that does not own its memory: emm never frees it, and the tensor's
//!   deleter runs exactly once, when the last view of the array drops (or at once, when the
//!   import is refused).
//!
//! DLPack strides count elements and emm's count bytes; both are checked on the way, and
//! anything emm cannot express (another device, another element type, negative strides,
//! host memory where device memory is needed) is an error that says so.
//!
//! The untyped forms ([`export_memory`](crate::dlpack::export_memory), [`import_memory`](crate::dlpack::import_memory)) serve runtimes whose element type
//! is known only at run time (a Python binding, say).

use bytemuck::Pod;
use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType};
use dlpark::metadata::Dynamic;
use dlpark::{DlpackElement, Managed, ManagedTensorBase};
use emm::driver_sys::DevicePtr;
use emm::{Context, MemoryPointer};

use crate::host::Backing;
use crate::{ArrayError, DeviceArray, HostArray, Layout};

/// What a DLPack tensor exported by emm owns: a view of the device memory, or the host
/// array's memory (none without elements).
struct Exported {
    _mem: Option<MemoryPointer>,
    _host: Option<Backing>,
}

/// Exports memory with `layout` (strides in bytes, from `mem`'s first byte on) as a DLPack
/// tensor of `dtype` on `device`, holding `mem` until the consumer's deleter runs. An error
/// when a stride is not a whole number of elements, or the shape does not fit DLPack's `i64`.
///
/// ```
/// # use emm_array::{DeviceArray, HostArray, Layout, Order};
/// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
/// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
/// # let ctx = runtime.context(0)?;
/// use dlpark::ffi::{DLDataType, DLDevice, DLManagedTensor};
/// let mem = ctx.memalloc(24)?;
/// let layout = Layout::contiguous(&[2, 3], Order::C, 4)?;
/// let t = emm_array::dlpack::export_memory::<DLManagedTensor>(Some(mem), &layout, DLDataType::F32, DLDevice::cuda(0))?;
/// assert_eq!(t.validate()?.strides(), Some(&[3i64, 1][..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn export_memory<M: ManagedTensorBase>(
    mem: Option<MemoryPointer>,
    layout: &Layout,
    dtype: DLDataType,
    device: DLDevice,
) -> Result<Managed<M>, ArrayError> {
    if let Some(m) = &mem {
        crate::refuse_sleeping("DLPack export", m)?;
    }
    let data = mem.as_ref().map_or(0, |m| m.device_ptr().0);
    finish_export(
        data,
        layout,
        dtype,
        device,
        Exported {
            _mem: mem,
            _host: None,
        },
    )
}

fn finish_export<M: ManagedTensorBase>(
    data: u64,
    layout: &Layout,
    dtype: DLDataType,
    device: DLDevice,
    owner: Exported,
) -> Result<Managed<M>, ArrayError> {
    let itemsize = layout.itemsize();
    if itemsize != dtype.element_size() {
        return Err(dlpack_error(
            "to_dlpack",
            format!(
                "the layout's {itemsize}-byte elements are not the {}-byte DLPack type {dtype:?}",
                dtype.element_size()
            ),
        ));
    }
    let shape = layout
        .shape()
        .iter()
        .map(|&n| i64::try_from(n))
        .collect::<Result<Vec<i64>, _>>()
        .map_err(|_| dlpack_error("to_dlpack", "a dimension does not fit DLPack's i64"))?;
    let mut strides = Vec::with_capacity(shape.len());
    for &s in layout.strides() {
        if s % itemsize as isize != 0 {
            return Err(dlpack_error(
                "to_dlpack",
                format!(
                    "the stride of {s} bytes is not a whole number of {itemsize}-byte elements, \
                     which DLPack cannot express; copy the array into a contiguous one first"
                ),
            ));
        }
        strides.push((s / itemsize as isize) as i64);
    }
    let prepared = Dynamic::new(shape, strides)
        .prepare_as::<M>()
        .map_err(|e| dlpack_error("to_dlpack", e.to_string()))?;
    let mut init = prepared.initialize(Box::new(owner));
    init.set_data(data as usize as *mut std::ffi::c_void);
    init.set_dtype(dtype);
    init.set_device(device);
    init.set_byte_offset(0);
    // SAFETY: the descriptor is complete: explicit shape and strides (in elements) from the
    // layout, the data pointer of the view's first element (null without elements), the dtype
    // whose size is the layout's element size (checked above) and the memory's device. The
    // view the context owns keeps that memory allocated until the consumer's deleter drops
    // the context; the flags stay clear (the memory is writable and shared, not a copy).
    Ok(unsafe { init.finish() })
}

/// Takes a DLPack tensor as memory of `ctx` that emm does not own: its first element's
/// pointer (none for a tensor without elements), its layout (strides in bytes) and its dtype.
/// The tensor's deleter runs when the last view of the pointer drops, or before this returns
/// an error. Device memory (CUDA) and managed memory (CUDA managed) of `ctx`'s device are
/// accepted.
///
/// ```
/// # use emm_array::{DeviceArray, HostArray, Layout, Order};
/// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
/// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
/// # let ctx = runtime.context(0)?;
/// let a = DeviceArray::to_device(&ctx, &[1u16, 2, 3], &[3], Order::C)?;
/// let (mem, layout, dtype) = emm_array::dlpack::import_memory(&ctx, a.to_dlpack()?)?;
/// assert_eq!((layout.shape(), dtype), (&[3][..], dlpark::ffi::DLDataType::U16));
/// assert_eq!(mem.unwrap().device_ptr(), a.memory().unwrap().device_ptr());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn import_memory<M: ManagedTensorBase + 'static>(
    ctx: &Context,
    tensor: Managed<M>,
) -> Result<(Option<MemoryPointer>, Layout, DLDataType), ArrayError> {
    let checked = tensor
        .validate()
        .map_err(|e| dlpack_error("from_dlpack", format!("the tensor is malformed: {e}")))?;
    let device = checked.device();
    if device.device_type != DLDeviceType::CUDA && device.device_type != DLDeviceType::CUDAMANAGED {
        return Err(dlpack_error(
            "from_dlpack",
            format!(
                "the tensor is in memory of DLPack device type {} (2 is CUDA, 13 CUDA managed); \
                 only device and managed memory become device arrays: copy it to the device first",
                device.device_type.0
            ),
        ));
    }
    if u32::try_from(device.device_id).ok() != Some(ctx.device().0) {
        return Err(dlpack_error(
            "from_dlpack",
            format!(
                "the tensor is on device {} but the context is on device {}; import it into \
                 that device's context",
                device.device_id,
                ctx.device().0
            ),
        ));
    }
    let dtype = checked.dtype();
    let itemsize = dtype.element_size();
    if dtype.bits % 8 != 0 || itemsize == 0 {
        return Err(dlpack_error(
            "from_dlpack",
            format!("the element type {dtype:?} is not a whole number of bytes"),
        ));
    }
    let shape = checked
        .shape()
        .iter()
        .map(|&n| usize::try_from(n))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| dlpack_error("from_dlpack", "a dimension is negative"))?;
    let elements = checked
        .strides_or_compact()
        .map_err(|e| dlpack_error("from_dlpack", e.to_string()))?;
    let mut strides = Vec::with_capacity(shape.len());
    for (&n, &s) in shape.iter().zip(elements.iter()) {
        if s < 0 && n > 1 {
            return Err(dlpack_error(
                "from_dlpack",
                format!(
                    "a stride of {s} elements is negative, which emm's arrays cannot express; \
                     make the tensor contiguous first"
                ),
            ));
        }
        let bytes = (s.max(0) as isize)
            .checked_mul(itemsize as isize)
            .ok_or_else(|| dlpack_error("from_dlpack", "a stride overflows"))?;
        strides.push(bytes);
    }
    let layout = Layout::with_strides(&shape, &strides, itemsize).map_err(|e| match e {
        ArrayError::Invalid { reason, .. } => dlpack_error("from_dlpack", reason),
        other => other,
    })?;
    let (_, extent) = layout.extent();
    let base = (checked.data_ptr() as u64)
        .checked_add(checked.byte_offset())
        .ok_or_else(|| dlpack_error("from_dlpack", "the data pointer overflows"))?;
    if layout.size() == 0 {
        drop(tensor);
        return Ok((None, layout, dtype));
    }
    if base == 0 {
        return Err(dlpack_error(
            "from_dlpack",
            "the tensor has elements but a null data pointer",
        ));
    }
    // SAFETY: a `Managed` tensor exists only through its producer's vouching (dlpark builds one
    // from a capsule with an unsafe constructor) that its data pointer names the memory its layout
    // describes; the device, type and extent were checked above, and the closure keeps the tensor,
    // and so the memory, alive until the last pointer drops.
    let mem = unsafe {
        MemoryPointer::with_release(
            ctx.device(),
            ctx.handle(),
            DevicePtr(base),
            extent as usize,
            // The deleter runs once: the closure owns the tensor and runs at most once.
            move |_, _| drop(tensor),
        )
    };
    Ok((Some(mem), layout, dtype))
}

impl<T: Pod + DlpackElement> DeviceArray<T> {
    /// The array as a DLPack tensor (the versioned ABI, DLPack 1.x) of its device, sharing its
    /// memory: the tensor keeps the allocation until its deleter runs. Strides are exported
    /// as DLPack counts them, in elements.
    ///
    /// ```
    /// use emm_array::{DeviceArray, Order};
    ///
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], Order::F)?;
    /// let tensor = a.to_dlpack()?;
    /// let t = tensor.validate()?;
    /// assert_eq!((t.shape(), t.strides()), (&[2i64, 3][..], Some(&[1i64, 2][..])));
    /// // Back again: an array that does not own its memory, reading the same elements.
    /// let b = DeviceArray::<f32>::from_dlpack(&ctx, tensor)?;
    /// assert_eq!(b.copy_to_host_vec(&ctx)?, a.copy_to_host_vec(&ctx)?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_dlpack(&self) -> Result<dlpark::versioned::Dlpack, ArrayError> {
        self.to_dlpack_as()
    }

    /// As [`to_dlpack`](Self::to_dlpack), in the ABI `M` (`dlpark::ffi::DLManagedTensor` for
    /// consumers of the legacy, unversioned one).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[1i8, 2], &[2], Order::C)?;
    /// let legacy = a.to_dlpack_as::<dlpark::ffi::DLManagedTensor>()?;
    /// assert_eq!(legacy.validate()?.dtype(), dlpark::ffi::DLDataType::I8);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_dlpack_as<M: ManagedTensorBase>(&self) -> Result<Managed<M>, ArrayError> {
        let device = match self.memory() {
            Some(m) => m.device().0,
            None => 0,
        };
        export_memory(
            self.memory().cloned(),
            self.layout(),
            T::DTYPE,
            DLDevice::cuda(device as i32),
        )
    }

    /// Takes a DLPack tensor (versioned or legacy) of `ctx`'s device as an array that does not
    /// own its memory; the tensor's deleter runs exactly once, when the last view of the array
    /// drops (at once if the import is refused). Refused: memory of another device or in host
    /// memory, an element type other than `T`, negative strides.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[1u32, 2, 3, 4], &[2, 2], Order::C)?;
    /// let b = DeviceArray::<u32>::from_dlpack(&ctx, a.to_dlpack()?)?;
    /// assert_eq!(b.copy_to_host_vec(&ctx)?, [1, 2, 3, 4]);
    /// let wrong = DeviceArray::<f32>::from_dlpack(&ctx, a.to_dlpack()?);
    /// assert!(wrong.unwrap_err().to_string().contains("import it as an array of its own element type"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_dlpack<M: ManagedTensorBase + 'static>(
        ctx: &Context,
        tensor: Managed<M>,
    ) -> Result<DeviceArray<T>, ArrayError> {
        let (mem, layout, dtype) = import_memory(ctx, tensor)?;
        if dtype != T::DTYPE {
            // Dropping `mem` runs the tensor's deleter, as for every refused import.
            drop(mem);
            return Err(dlpack_error(
                "from_dlpack",
                format!(
                    "the tensor's elements are {dtype:?}, not {:?} ({}); import it as an array \
                     of its own element type",
                    T::DTYPE,
                    std::any::type_name::<T>()
                ),
            ));
        }
        Ok(DeviceArray::from_parts(mem, layout))
    }
}

impl<T: Pod + DlpackElement> HostArray<T> {
    /// The array as a DLPack tensor (versioned ABI) that takes over its memory, freed when the
    /// consumer's deleter runs: page-locked memory as CUDA host memory, managed memory as CUDA
    /// managed memory of its device.
    ///
    /// ```
    /// use emm_array::{HostArray, Order};
    ///
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let h = HostArray::<i32>::pinned(&ctx, &[3, 2], Order::C)?;
    /// h.write(&[1, 2, 3, 4, 5, 6])?;
    /// let tensor = h.into_dlpack()?;
    /// let t = tensor.validate()?;
    /// assert_eq!(t.device().device_type, dlpark::ffi::DLDeviceType::CUDAHOST);
    /// assert_eq!((t.shape(), t.strides()), (&[3i64, 2][..], Some(&[2i64, 1][..])));
    /// drop(tensor); // the consumer's deleter: the page-locked memory is freed
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn into_dlpack(self) -> Result<dlpark::versioned::Dlpack, ArrayError> {
        let (data, device) = match &self.backing {
            Backing::Host(h) => (
                h.host_ptr().0 as u64,
                DLDevice {
                    device_type: DLDeviceType::CUDAHOST,
                    device_id: 0,
                },
            ),
            Backing::Managed(m) => (
                m.device().device_ptr().0,
                DLDevice {
                    device_type: DLDeviceType::CUDAMANAGED,
                    device_id: m.device().device().0 as i32,
                },
            ),
            Backing::Empty => (0, DLDevice::CPU),
        };
        let layout = self.layout.clone();
        finish_export(
            data,
            &layout,
            T::DTYPE,
            device,
            Exported {
                _mem: None,
                _host: Some(self.backing),
            },
        )
    }
}

fn dlpack_error(what: &'static str, reason: impl Into<String>) -> ArrayError {
    ArrayError::Invalid {
        what,
        reason: reason.into(),
    }
}
