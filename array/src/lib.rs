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

mod host;
mod layout;

pub use host::{HostArray, PinnedSlice, with_pinned};
pub use layout::{Layout, Order};

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
    layout: Layout,
    _elements: PhantomData<T>,
}

impl<T: Pod> Clone for DeviceArray<T> {
    fn clone(&self) -> Self {
        DeviceArray {
            mem: self.mem.clone(),
            layout: self.layout.clone(),
            _elements: PhantomData,
        }
    }
}

impl<T: Pod> fmt::Debug for DeviceArray<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceArray")
            .field("dtype", &std::any::type_name::<T>())
            .field("shape", &self.layout.shape())
            .field("strides", &self.layout.strides())
            .field("ptr", &self.mem.as_ref().map(|m| m.device_ptr()))
            .finish()
    }
}

impl<T: Pod> DeviceArray<T> {
    /// An array over `mem` (from its first element on) with `layout`.
    pub(crate) fn from_parts(mem: Option<MemoryPointer>, layout: Layout) -> DeviceArray<T> {
        DeviceArray {
            mem,
            layout,
            _elements: PhantomData,
        }
    }

    /// A new array of `shape` in `order` (Numba's `device_array`), uninitialised as the
    /// driver's memory is. An array without elements makes no driver call.
    pub fn new(ctx: &Context, shape: &[usize], order: Order) -> Result<DeviceArray<T>, ArrayError> {
        let layout = Layout::contiguous(shape, order, std::mem::size_of::<T>())?;
        let mem = match layout.nbytes() {
            0 => None,
            n => Some(ctx.memalloc(n)?),
        };
        Ok(DeviceArray {
            mem,
            layout,
            _elements: PhantomData,
        })
    }

    /// A new array with `other`'s shape, in `other`'s order where it is contiguous in one
    /// (C otherwise) (Numba's `device_array_like`).
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
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// The strides, in bytes.
    pub fn strides(&self) -> &[isize] {
        self.layout.strides()
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        self.layout.size()
    }

    /// Bytes the elements take.
    pub fn nbytes(&self) -> usize {
        self.layout.nbytes()
    }

    /// The memory from the first element on (`None` for an array without elements).
    pub fn memory(&self) -> Option<&MemoryPointer> {
        self.mem.as_ref()
    }

    /// Whether the elements are contiguous in C order.
    pub fn is_c_contiguous(&self) -> bool {
        self.layout.is_contiguous(Order::C)
    }

    /// Whether the elements are contiguous in Fortran order.
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
        Ok(DeviceArray {
            mem,
            layout,
            _elements: PhantomData,
        })
    }

    /// The same elements in `shape`, as a view (C order); a clear error where that would
    /// need a copy (Numba raises the same), or where the element counts differ.
    pub fn reshape(&self, shape: &[usize]) -> Result<DeviceArray<T>, ArrayError> {
        self.reshape_in(shape, Order::C)
    }

    /// As [`reshape`](Self::reshape), taking the elements in `order`.
    pub fn reshape_in(&self, shape: &[usize], order: Order) -> Result<DeviceArray<T>, ArrayError> {
        let layout = self.layout.reshape(shape, order)?;
        self.view(0, layout)
    }

    /// The elements as one dimension in C order, as a view of a contiguous array.
    pub fn ravel(&self) -> Result<DeviceArray<T>, ArrayError> {
        let layout = self.layout.ravel(Order::C)?;
        self.view(0, layout)
    }

    /// Rows `start..stop` along the first axis, as a view.
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
    pub fn copy_from_host(&self, ctx: &Context, host: &[T]) -> Result<(), ArrayError> {
        self.check_host(host.len())?;
        if let Some(m) = &self.mem {
            let bytes: &[u8] = bytemuck::cast_slice(host);
            ctx.copy_to_device(&m.view(0, Some(bytes.len()))?, bytes)?;
        }
        Ok(())
    }

    /// Copies the array into `host` (elements in the array's contiguous order).
    pub fn copy_to_host(&self, ctx: &Context, host: &mut [T]) -> Result<(), ArrayError> {
        self.check_host(host.len())?;
        if let Some(m) = &self.mem {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(host);
            ctx.copy_to_host(bytes, m)?;
        }
        Ok(())
    }

    /// The array's elements in a new `Vec` (in its contiguous order).
    pub fn copy_to_host_vec(&self, ctx: &Context) -> Result<Vec<T>, ArrayError> {
        let mut out = vec![T::zeroed(); self.size()];
        self.copy_to_host(ctx, &mut out)?;
        Ok(out)
    }

    /// As [`copy_from_host`](Self::copy_from_host), in `stream`'s order: the copy runs after
    /// the work queued on `stream` before it, and this returns once it is done (the host
    /// slice is pageable memory, which the driver copies synchronously anyway).
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

    /// Copies page-locked host memory into the array asynchronously on `stream`: `src` (at
    /// least the array's bytes, its elements in the array's contiguous order) travels with
    /// the copy and comes back from the returned [`InFlight`]'s `wait`. Pageable memory is
    /// not accepted here ([`copy_from_host_on`](Self::copy_from_host_on) takes it).
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
    /// device-to-device copy.
    pub fn copy_to_device(&self, ctx: &Context, src: &DeviceArray<T>) -> Result<(), ArrayError> {
        let alike = (self.is_c_contiguous() && src.is_c_contiguous())
            || (self.is_f_contiguous() && src.is_f_contiguous());
        if src.shape() != self.shape() || !alike {
            return Err(invalid(
                "copy_to_device",
                "the arrays differ in shape or strides; copy between arrays of one layout",
            ));
        }
        self.check_host(src.size())?;
        if let (Some(d), Some(s)) = (&self.mem, &src.mem) {
            ctx.copy_device(d, s, self.nbytes())?;
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
