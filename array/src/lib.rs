//! Typed n-d device arrays over emm's memory, for host runtimes that hand their users arrays
//! rather than byte pointers (Numba's `device_array`, `to_device`, `copy_to_host`, `reshape`,
//! `ravel`, contiguity checks, slicing along the first axis).
//!
//! A [`DeviceArray<T>`] is a [`MemoryPointer`] (the memory, owned by the context's manager)
//! and a [`Layout`] (shape, strides in bytes, element size). Element types are those for
//! which any bit pattern is a value ([`bytemuck::Pod`]), so bytes copied back from the device
//! are always valid values. Views (`reshape`, `ravel`, slices) share the allocation, which
//! lives as long as any of them.
//!
//! ```
//! use emm_array::{DeviceArray, Order};
//!
//! let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
//! let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
//! let ctx = runtime.context(0)?;
//! let host: Vec<f32> = (0..12).map(|i| i as f32).collect();
//! let a = DeviceArray::to_device(&ctx, &host, &[3, 4], Order::C)?;
//! assert!(a.is_c_contiguous() && !a.is_f_contiguous());
//! let b = a.reshape(&[4, 3])?;                  // a view: same memory
//! assert_eq!(b.copy_to_host_vec(&ctx)?, host);
//! let rows = a.slice(1, 3)?;                    // rows 1 and 2
//! assert_eq!(rows.copy_to_host_vec(&ctx)?, host[4..].to_vec());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::marker::PhantomData;

use bytemuck::Pod;
use emm::{Context, EmmError, HostMemory, InFlight, MemoryPointer, Stream};

#[cfg(feature = "cudarc")]
mod cudarc_interop;
/// DLPack export and import (the `dlpack` feature).
#[cfg(feature = "dlpack")]
pub mod dlpack;
mod host;
mod layout;

/// The seam with kernels launched through cudarc (the `cudarc` feature).
#[cfg(feature = "cudarc")]
pub mod cudarc {
    pub use crate::cudarc_interop::{CudarcView, cudarc_stream, emm_stream};
}

pub use host::{HostArray, PinnedSlice, with_pinned};
pub use layout::{Layout, Order};

/// Bytes a staged copy between devices moves at a time (the page-locked bounce buffer's size).
const STAGING_CHUNK: usize = 16 << 20;

/// How [`DeviceArray::copy_across`] moves elements between two devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Peer copy where the devices reach each other's memory, staged otherwise.
    Auto,
    /// One device-to-device copy through unified addressing (`cuMemcpyDtoD`).
    Peer,
    /// Through a page-locked host buffer, each device copying only its own memory.
    Staged,
}

/// What went wrong with an array operation.
#[derive(Debug)]
pub enum ArrayError {
    /// The shape's element count or byte size does not fit the address space.
    ShapeOverflow {
        /// The shape asked for.
        shape: Vec<usize>,
        /// Bytes per element.
        itemsize: usize,
    },
    /// The operation would need a copy of the elements (the array is not contiguous in the
    /// order asked for); device arrays do not copy behind the caller's back.
    NeedsCopy {
        /// The operation.
        what: &'static str,
        /// The order asked for.
        order: Order,
    },
    /// A host slice of the wrong length for the array.
    HostLength {
        /// The slice's length, in elements.
        got: usize,
        /// The array's, in elements.
        expected: usize,
    },
    /// An argument emm cannot use, and why.
    Invalid {
        /// What was wrong.
        what: &'static str,
        /// Why, and what to do.
        reason: String,
    },
    /// emm failed (the allocation or the copy).
    Emm(EmmError),
}

impl fmt::Display for ArrayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArrayError::ShapeOverflow { shape, itemsize } => write!(
                f,
                "an array of shape {shape:?} with {itemsize}-byte elements does not fit the \
                 address space; use a smaller shape"
            ),
            ArrayError::NeedsCopy { what, order } => write!(
                f,
                "{what} needs a copy: the array is not contiguous in {order:?} order; copy it \
                 into a contiguous array first (device_array_like + copy_to_device)"
            ),
            ArrayError::HostLength { got, expected } => write!(
                f,
                "the host slice has {got} elements but the array has {expected}; give a slice \
                 of exactly the array's size"
            ),
            ArrayError::Invalid { what, reason } => write!(f, "{what}: {reason}"),
            ArrayError::Emm(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ArrayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ArrayError::Emm(e) => Some(e),
            _ => None,
        }
    }
}

impl From<EmmError> for ArrayError {
    fn from(e: EmmError) -> ArrayError {
        ArrayError::Emm(e)
    }
}

/// An n-d array of `T` in device memory: a view of an allocation of the context's manager
/// with a [`Layout`]. Cloning makes another view of the same memory.
pub struct DeviceArray<T: Pod> {
    /// The memory from the first element on (`None` for an array without elements, which
    /// takes no allocation, as Numba allows).
    mem: Option<MemoryPointer>,
    /// The first element's device address (0 without elements), kept so that a kernel
    /// argument can borrow it for as long as the array is borrowed.
    addr: u64,
    layout: Layout,
    _elements: PhantomData<T>,
}

impl<T: Pod> Clone for DeviceArray<T> {
    fn clone(&self) -> Self {
        DeviceArray::from_parts(self.mem.clone(), self.layout.clone())
    }
}

impl<T: Pod> fmt::Debug for DeviceArray<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceArray")
            .field("dtype", &std::any::type_name::<T>())
            .field("shape", &self.layout.shape())
            .field("strides", &self.layout.strides())
            .field("ptr", &format_args!("{:#x}", self.addr))
            .finish()
    }
}

impl<T: Pod> DeviceArray<T> {
    /// An array over `mem` (from its first element on) with `layout`.
    pub(crate) fn from_parts(mem: Option<MemoryPointer>, layout: Layout) -> DeviceArray<T> {
        DeviceArray {
            addr: mem.as_ref().map_or(0, |m| m.device_ptr().0),
            mem,
            layout,
            _elements: PhantomData,
        }
    }

    /// A new array of `shape` in `order` (Numba's `device_array`), uninitialised as the
    /// driver's memory is. An array without elements makes no driver call.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::<f32>::new(&ctx, &[2, 3], Order::F)?;
    /// assert_eq!((a.shape(), a.strides()), (&[2, 3][..], &[4isize, 8][..]));
    /// let empty = DeviceArray::<f32>::new(&ctx, &[0, 3], Order::C)?;
    /// assert!(empty.memory().is_none()); // no driver call
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(ctx: &Context, shape: &[usize], order: Order) -> Result<DeviceArray<T>, ArrayError> {
        let layout = Layout::contiguous(shape, order, std::mem::size_of::<T>())?;
        let mem = match layout.nbytes() {
            0 => None,
            n => Some(ctx.memalloc(n)?),
        };
        Ok(DeviceArray::from_parts(mem, layout))
    }

    /// As [`new`](Self::new), allocated in `stream`'s order (the manager's `memalloc_on`):
    /// a stream-ordered manager hands out memory that is ready for work queued on `stream`,
    /// and the array's memory keeps `stream` alive until it is freed there.
    ///
    /// ```
    /// use emm_array::{DeviceArray, Order};
    ///
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let a = DeviceArray::<f64>::new_on(&ctx, &[4, 8], Order::F, &s)?;
    /// assert_eq!((a.nbytes(), a.strides()), (256, &[8isize, 32][..]));
    /// assert_eq!(a.memory().unwrap().stream(), Some(s.handle()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new_on(
        ctx: &Context,
        shape: &[usize],
        order: Order,
        stream: &Stream,
    ) -> Result<DeviceArray<T>, ArrayError> {
        let layout = Layout::contiguous(shape, order, std::mem::size_of::<T>())?;
        let mem = match layout.nbytes() {
            0 => None,
            n => Some(ctx.memalloc_on(n, stream)?),
        };
        Ok(DeviceArray::from_parts(mem, layout))
    }

    /// As [`to_device`](Self::to_device), in `stream`'s order: the array is allocated on
    /// `stream` and `host` copied into it after the work queued there; this returns once the
    /// copy is done, because `host` is pageable memory. For a copy that overlaps the host's
    /// work, copy from page-locked memory with
    /// [`copy_from_pinned_async`](Self::copy_from_pinned_async).
    ///
    /// ```
    /// use emm_array::{DeviceArray, Order};
    ///
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let a = DeviceArray::to_device_on(&ctx, &[1u16, 2, 3, 4], &[2, 2], Order::C, &s)?;
    /// assert_eq!(a.copy_to_host_vec(&ctx)?, [1, 2, 3, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_device_on(
        ctx: &Context,
        host: &[T],
        shape: &[usize],
        order: Order,
        stream: &Stream,
    ) -> Result<DeviceArray<T>, ArrayError> {
        let a = DeviceArray::new_on(ctx, shape, order, stream)?;
        a.copy_from_host_on(ctx, host, stream)?;
        Ok(a)
    }

    /// A new array with `other`'s shape, in `other`'s order where it is contiguous in one
    /// (C otherwise) (Numba's `device_array_like`).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::<u8>::new(&ctx, &[4, 2], Order::F)?;
    /// let b = DeviceArray::like(&ctx, &a)?;
    /// assert_eq!((b.shape(), b.is_f_contiguous()), (a.shape(), true));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn like(ctx: &Context, other: &DeviceArray<T>) -> Result<DeviceArray<T>, ArrayError> {
        let order = if !other.is_c_contiguous() && other.is_f_contiguous() {
            Order::F
        } else {
            Order::C
        };
        DeviceArray::new(ctx, other.shape(), order)
    }

    /// A new array of `shape` in `order` holding `host` (Numba's `to_device`), whose elements
    /// are taken in that order; `host` must have exactly the array's element count.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.copy_to_host_vec(&ctx)?[5], 5);
    /// assert!(DeviceArray::to_device(&ctx, &[1u8, 2], &[3], Order::C).is_err()); // wrong length
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn to_device(
        ctx: &Context,
        host: &[T],
        shape: &[usize],
        order: Order,
    ) -> Result<DeviceArray<T>, ArrayError> {
        let a = DeviceArray::new(ctx, shape, order)?;
        a.copy_from_host(ctx, host)?;
        Ok(a)
    }

    /// The shape.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.shape(), &[3, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// The strides, in bytes.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.strides(), &[16, 4]); // bytes
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn strides(&self) -> &[isize] {
        self.layout.strides()
    }

    /// The layout.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!((a.layout().ndim(), a.layout().itemsize()), (2, 4));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Number of elements.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.size(), 12);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn size(&self) -> usize {
        self.layout.size()
    }

    /// Bytes the elements take.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.nbytes(), 48);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn nbytes(&self) -> usize {
        self.layout.nbytes()
    }

    /// The memory from the first element on (`None` for an array without elements).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.memory().map(|m| m.size()), Some(48));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn memory(&self) -> Option<&MemoryPointer> {
        self.mem.as_ref()
    }

    /// Whether the elements are contiguous in C order.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert!(a.is_c_contiguous() && !a.is_f_contiguous());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_c_contiguous(&self) -> bool {
        self.layout.is_contiguous(Order::C)
    }

    /// Whether the elements are contiguous in Fortran order.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::<u16>::new(&ctx, &[3, 4], Order::F)?;
    /// assert!(a.is_f_contiguous() && !a.is_c_contiguous());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_f_contiguous(&self) -> bool {
        self.layout.is_contiguous(Order::F)
    }

    fn view(&self, offset: isize, layout: Layout) -> Result<DeviceArray<T>, ArrayError> {
        let mem = match (&self.mem, layout.size()) {
            (_, 0) | (None, _) => None,
            (Some(m), _) => {
                let (lo, hi) = layout.extent();
                let start = offset + lo;
                let (start, stop) = (
                    usize::try_from(start)
                        .map_err(|_| invalid("view", "reaches before the memory"))?,
                    usize::try_from(offset + hi).map_err(|_| invalid("view", "overflows"))?,
                );
                // The view starts at the first element; a layout reaching below it (negative
                // strides) is not made by these operations.
                debug_assert_eq!(lo, 0);
                Some(m.view(start, Some(stop))?)
            }
        };
        Ok(DeviceArray::from_parts(mem, layout))
    }

    /// The same elements in `shape`, as a view (C order); a clear error where that would
    /// need a copy (Numba raises the same), or where the element counts differ.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// let b = a.reshape(&[2, 6])?;
    /// assert_eq!(b.copy_to_host_vec(&ctx)?, a.copy_to_host_vec(&ctx)?);
    /// let f = DeviceArray::<u32>::new(&ctx, &[3, 4], Order::F)?;
    /// assert!(matches!(f.reshape(&[12]), Err(emm_array::ArrayError::NeedsCopy { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reshape(&self, shape: &[usize]) -> Result<DeviceArray<T>, ArrayError> {
        self.reshape_in(shape, Order::C)
    }

    /// As [`reshape`](Self::reshape), taking the elements in `order`.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let f = DeviceArray::<u32>::new(&ctx, &[3, 4], Order::F)?;
    /// let flat = f.reshape_in(&[12], Order::F)?; // a view: F order takes F-contiguous memory as it is
    /// assert_eq!(flat.memory().unwrap().device_ptr(), f.memory().unwrap().device_ptr());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reshape_in(&self, shape: &[usize], order: Order) -> Result<DeviceArray<T>, ArrayError> {
        let layout = self.layout.reshape(shape, order)?;
        self.view(0, layout)
    }

    /// The elements as one dimension in C order, as a view of a contiguous array.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.ravel()?.shape(), &[12]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn ravel(&self) -> Result<DeviceArray<T>, ArrayError> {
        let layout = self.layout.ravel(Order::C)?;
        self.view(0, layout)
    }

    /// Rows `start..stop` along the first axis, as a view.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// let rows = a.slice(1, 3)?;
    /// assert_eq!(rows.copy_to_host_vec(&ctx)?, (4u32..12).collect::<Vec<_>>());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn slice(&self, start: usize, stop: usize) -> Result<DeviceArray<T>, ArrayError> {
        let (offset, layout) = self.layout.slice_first(start, stop)?;
        if offset < 0 {
            return Err(invalid(
                "slice",
                "negative first-axis strides are not supported",
            ));
        }
        self.view(offset, layout)
    }

    /// Copies `host` into the array (elements taken in the array's contiguous order). The
    /// array must be contiguous, and `host` exactly its size.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::<i64>::new(&ctx, &[2, 2], Order::C)?;
    /// a.copy_from_host(&ctx, &[1, 2, 3, 4])?;
    /// assert_eq!(a.copy_to_host_vec(&ctx)?, [1, 2, 3, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_from_host(&self, ctx: &Context, host: &[T]) -> Result<(), ArrayError> {
        self.check_host(host.len())?;
        if let Some(m) = &self.mem {
            let bytes: &[u8] = bytemuck::cast_slice(host);
            ctx.copy_to_device(&m.view(0, Some(bytes.len()))?, bytes)?;
        }
        Ok(())
    }

    /// Copies the array into `host` (elements in the array's contiguous order).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// let mut out = [0u32; 12];
    /// a.copy_to_host(&ctx, &mut out)?;
    /// assert_eq!(out[11], 11);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to_host(&self, ctx: &Context, host: &mut [T]) -> Result<(), ArrayError> {
        self.check_host(host.len())?;
        if let Some(m) = &self.mem {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(host);
            ctx.copy_to_host(bytes, m)?;
        }
        Ok(())
    }

    /// The array's elements in a new `Vec` (in its contiguous order).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.copy_to_host_vec(&ctx)?.len(), 12);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to_host_vec(&self, ctx: &Context) -> Result<Vec<T>, ArrayError> {
        let mut out = vec![T::zeroed(); self.size()];
        self.copy_to_host(ctx, &mut out)?;
        Ok(out)
    }

    /// As [`copy_from_host`](Self::copy_from_host), in `stream`'s order: the copy runs after
    /// the work queued on `stream` before it, and this returns once it is done (the host
    /// slice is pageable memory, which the driver copies synchronously anyway).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let a = DeviceArray::<f32>::new_on(&ctx, &[3], Order::C, &s)?;
    /// a.copy_from_host_on(&ctx, &[1.0, 2.0, 3.0], &s)?;
    /// assert_eq!(a.copy_to_host_vec_on(&ctx, &s)?, [1.0, 2.0, 3.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_from_host_on(
        &self,
        ctx: &Context,
        host: &[T],
        stream: &Stream,
    ) -> Result<(), ArrayError> {
        self.check_host(host.len())?;
        if let Some(m) = &self.mem {
            let bytes: &[u8] = bytemuck::cast_slice(host);
            ctx.copy_to_device_on(&m.view(0, Some(bytes.len()))?, bytes, stream)?;
        }
        Ok(())
    }

    /// As [`copy_to_host`](Self::copy_to_host), in `stream`'s order; returns once it is done.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// let mut out = [0u32; 12];
    /// a.copy_to_host_on(&ctx, &mut out, &s)?;
    /// assert_eq!(out[3], 3);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to_host_on(
        &self,
        ctx: &Context,
        host: &mut [T],
        stream: &Stream,
    ) -> Result<(), ArrayError> {
        self.check_host(host.len())?;
        if let Some(m) = &self.mem {
            ctx.copy_to_host_on(bytemuck::cast_slice_mut(host), m, stream)?;
        }
        Ok(())
    }

    /// The array's memory for an asynchronous copy; an array with no elements has none, and
    /// `what` is refused with an error that says so.
    fn memory_to_copy(&self, what: &'static str) -> Result<&MemoryPointer, ArrayError> {
        self.mem
            .as_ref()
            .ok_or_else(|| invalid(what, "the array has no elements; there is nothing to copy"))
    }

    /// The array's elements in a new `Vec`, copied in `stream`'s order (after the work queued
    /// there, a kernel's say); returns once the copy is done.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// assert_eq!(a.copy_to_host_vec_on(&ctx, &s)?[7], 7);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to_host_vec_on(
        &self,
        ctx: &Context,
        stream: &Stream,
    ) -> Result<Vec<T>, ArrayError> {
        let mut out = vec![T::zeroed(); self.size()];
        self.copy_to_host_on(ctx, &mut out, stream)?;
        Ok(out)
    }

    /// Copies page-locked host memory into the array asynchronously on `stream`: `src` (at
    /// least the array's bytes, its elements in the array's contiguous order) travels with
    /// the copy and comes back from the returned [`InFlight`]'s `wait`. Pageable memory is
    /// not accepted here ([`copy_from_host_on`](Self::copy_from_host_on) takes it).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let a = DeviceArray::<u8>::new(&ctx, &[4], Order::C)?;
    /// let src = ctx.memhostalloc(4, false, false, false)?;
    /// src.write(0, &[9, 8, 7, 6])?;
    /// let src = a.copy_from_pinned_async(&ctx, src, &s)?.wait()?; // the host memory comes back
    /// assert_eq!(a.copy_to_host_vec(&ctx)?, [9, 8, 7, 6]);
    /// drop(src);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_from_pinned_async(
        &self,
        ctx: &Context,
        src: HostMemory,
        stream: &Stream,
    ) -> Result<InFlight<HostMemory>, ArrayError> {
        self.check_host(self.size())?;
        let mem = self.memory_to_copy("copy_from_pinned_async")?;
        Ok(ctx.copy_to_device_async(mem, src, stream)?)
    }

    /// Copies the array into page-locked host memory asynchronously on `stream`; `dst` comes
    /// back, filled, from the returned [`InFlight`]'s `wait`.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let a = DeviceArray::to_device(&ctx, &[5u8, 6, 7, 8], &[4], Order::C)?;
    /// let dst = a.copy_to_pinned_async(&ctx, ctx.memhostalloc(4, false, false, false)?, &s)?.wait()?;
    /// let mut out = [0u8; 4];
    /// dst.read(0, &mut out)?;
    /// assert_eq!(out, [5, 6, 7, 8]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to_pinned_async(
        &self,
        ctx: &Context,
        dst: HostMemory,
        stream: &Stream,
    ) -> Result<InFlight<HostMemory>, ArrayError> {
        self.check_host(self.size())?;
        let mem = self.memory_to_copy("copy_to_pinned_async")?;
        Ok(ctx.copy_to_host_async(dst, mem, stream)?)
    }

    /// Copies `src`'s elements into this array on the device (the same shape, both
    /// contiguous in one order, so the bytes are arranged alike), through emm's
    /// device-to-device copy. Both arrays are memory of `ctx`; [`copy_across`](Self::copy_across)
    /// copies from another device's array.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let a = DeviceArray::to_device(&ctx, &[0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[3, 4], Order::C)?;
    /// let b = DeviceArray::like(&ctx, &a)?;
    /// b.copy_to_device(&ctx, &a)?;
    /// assert_eq!(b.copy_to_host_vec(&ctx)?, a.copy_to_host_vec(&ctx)?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to_device(&self, ctx: &Context, src: &DeviceArray<T>) -> Result<(), ArrayError> {
        self.check_alike("copy_to_device", src)?;
        if let (Some(d), Some(s)) = (&self.mem, &src.mem) {
            ctx.copy_device(d, s, self.nbytes())?;
        }
        Ok(())
    }

    /// Copies `src`, an array of `src_ctx` (another device's, or `ctx` itself), into this
    /// array of `ctx`, by `route`: [`Route::Peer`] is one device-to-device copy through unified
    /// addressing; [`Route::Staged`] goes through a page-locked bounce buffer, 16 MiB at a
    /// time, each device copying only its own memory (emm's staged path, which needs no peer
    /// access and reaches stream-ordered pool memory of either side); [`Route::Auto`] is the
    /// peer copy between devices that can access each other's memory and the staged one
    /// otherwise, and whenever either context's manager hands out memory of the driver's
    /// stream-ordered pool (which a peer copy cannot reach: [`Route::Peer`] is refused there).
    /// Arrays of one context take the plain device-to-device copy whatever the route. The same shape and contiguous order are needed, as for
    /// [`copy_to_device`](Self::copy_to_device).
    ///
    /// ```
    /// use emm_array::{DeviceArray, Order, Route};
    /// use driver_mock::{SimConfig, SimDeviceConfig, SimDriver};
    ///
    /// let two = SimConfig::with_devices(vec![SimDeviceConfig::new(64 << 20); 2]);
    /// let runtime = emm::Runtime::builder(std::sync::Arc::new(SimDriver::new(two)))
    ///     .ignore_env()
    ///     .build()?;
    /// let (c0, c1) = (runtime.context(0)?, runtime.context(1)?);
    /// let a = DeviceArray::to_device(&c0, &[1u8, 2, 3, 4, 5, 6], &[2, 3], Order::C)?;
    /// let b = DeviceArray::<u8>::new(&c1, &[2, 3], Order::C)?;
    /// b.copy_across(&c1, &c0, &a, Route::Staged)?;
    /// assert_eq!(b.copy_to_host_vec(&c1)?, [1, 2, 3, 4, 5, 6]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_across(
        &self,
        ctx: &Context,
        src_ctx: &Context,
        src: &DeviceArray<T>,
        route: Route,
    ) -> Result<(), ArrayError> {
        self.check_alike("copy_across", src)?;
        let (Some(d), Some(s)) = (&self.mem, &src.mem) else {
            return Ok(());
        };
        if ctx.handle() == src_ctx.handle() {
            ctx.copy_device(d, s, self.nbytes())?;
            return Ok(());
        }
        // Memory of the driver's stream-ordered pools is reached only from devices its pool
        // grants access, which emm's stream-ordered managers do not grant (measured on two
        // H200s: the peer copy fails with CUDA_ERROR_INVALID_VALUE).
        let pooled = [ctx, src_ctx]
            .iter()
            .any(|c| c.stream_ordering() == emm::contract::StreamOrdering::Driver);
        let route = match route {
            Route::Auto if !pooled && ctx.can_access_peer(src_ctx.device())? => Route::Peer,
            Route::Auto => Route::Staged,
            Route::Peer if pooled => {
                return Err(invalid(
                    "copy_across",
                    "a peer copy cannot reach memory of the driver's stream-ordered pool from \
                     another device (the pool grants no access to it); use Route::Staged or \
                     Route::Auto",
                ));
            }
            r => r,
        };
        let bytes = self.nbytes();
        match route {
            Route::Peer => ctx.copy_peer(d, src_ctx, s, bytes)?,
            _ => {
                let chunk = bytes.min(STAGING_CHUNK);
                // Portable: page-locked for both contexts.
                let bounce = src_ctx.memhostalloc(chunk, false, true, false)?;
                for start in (0..bytes).step_by(STAGING_CHUNK) {
                    let n = (bytes - start).min(STAGING_CHUNK);
                    src_ctx.copy_device_to_pinned(&bounce, &s.view(start, Some(start + n))?, n)?;
                    ctx.copy_pinned_to_device(&d.view(start, Some(start + n))?, &bounce, n)?;
                }
            }
        }
        Ok(())
    }

    /// Refuses a copy between arrays whose bytes are not arranged alike.
    fn check_alike(&self, what: &'static str, src: &DeviceArray<T>) -> Result<(), ArrayError> {
        let alike = (self.is_c_contiguous() && src.is_c_contiguous())
            || (self.is_f_contiguous() && src.is_f_contiguous());
        if src.shape() != self.shape() || !alike {
            return Err(invalid(
                what,
                "the arrays differ in shape or strides; copy between arrays of one layout",
            ));
        }
        Ok(())
    }

    fn check_host(&self, len: usize) -> Result<(), ArrayError> {
        if !self.is_c_contiguous() && !self.is_f_contiguous() {
            return Err(ArrayError::NeedsCopy {
                what: "a copy between the host and a non-contiguous array",
                order: Order::C,
            });
        }
        if len != self.size() {
            return Err(ArrayError::HostLength {
                got: len,
                expected: self.size(),
            });
        }
        Ok(())
    }
}

fn invalid(what: &'static str, reason: &str) -> ArrayError {
    ArrayError::Invalid {
        what,
        reason: reason.to_owned(),
    }
}

/// Refuses memory that is asleep for `what` ([`emm::EmmError::Sleep`]): work that another
/// library queues on it would fault on the device.
pub(crate) fn refuse_sleeping(
    what: &'static str,
    memory: &emm::MemoryPointer,
) -> Result<(), ArrayError> {
    if !memory.is_asleep() {
        return Ok(());
    }
    Err(ArrayError::Emm(emm::EmmError::Sleep {
        what,
        device: memory.device(),
        reason: "the memory is asleep (Context::sleep released it); call Context::wake first",
    }))
}

/// docs/rust.md's Rust examples that claim to run (blocks marked `ignore` are fragments),
/// compiled by `cargo test` so that the guide cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../docs/rust.md")]
pub struct RustGuideExamples;
