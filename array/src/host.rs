//! Arrays in host memory the device can reach: page-locked (Numba's `pinned_array`), mapped
//! (`mapped_array`, with a device view of the same memory) and managed (`managed_array`).

use std::marker::PhantomData;

use bytemuck::Pod;
use emm::{Context, HostMemory, ManagedMemory};

use crate::{ArrayError, DeviceArray, Layout, Order, invalid};

/// Where a host array's elements live.
#[derive(Debug)]
pub(crate) enum Backing {
    /// Page-locked (mapped or not), from the context's manager (`memhostalloc`).
    Host(HostMemory),
    /// Managed memory (`memallocmanaged`, attached globally).
    Managed(ManagedMemory),
    /// No elements: no allocation.
    Empty,
}

/// A contiguous n-d array of `T` in host memory that the device reaches: page-locked, mapped
/// or managed. Its elements are read and written by copy ([`read`](Self::read),
/// [`write`](Self::write)), so no Rust reference aliases memory the device may write; mapped
/// and managed arrays also give a [`DeviceArray`] view of the same memory.
#[derive(Debug)]
pub struct HostArray<T: Pod> {
    pub(crate) backing: Backing,
    pub(crate) layout: Layout,
    _elements: PhantomData<T>,
}

impl<T: Pod> HostArray<T> {
    fn make(
        shape: &[usize],
        order: Order,
        alloc: impl FnOnce(usize) -> Result<Backing, emm::EmmError>,
    ) -> Result<HostArray<T>, ArrayError> {
        let layout = Layout::contiguous(shape, order, std::mem::size_of::<T>())?;
        let backing = match layout.nbytes() {
            0 => Backing::Empty,
            n => alloc(n)?,
        };
        Ok(HostArray {
            backing,
            layout,
            _elements: PhantomData,
        })
    }

    /// A page-locked array (Numba's `pinned_array`): fast, asynchronous copies; not reached by
    /// kernels.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<f64>::pinned(&ctx, &[2, 2], Order::C)?;
    /// assert!(h.host_memory().is_some_and(|m| m.mapped().is_none()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn pinned(
        ctx: &Context,
        shape: &[usize],
        order: Order,
    ) -> Result<HostArray<T>, ArrayError> {
        Self::make(shape, order, |n| {
            Ok(Backing::Host(ctx.memhostalloc(n, false, false, false)?))
        })
    }

    /// A page-locked array mapped into the device (Numba's `mapped_array`): kernels reach it
    /// through [`device_view`](Self::device_view).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<u32>::mapped(&ctx, &[4], Order::C)?;
    /// h.write(&[1, 2, 3, 4])?;
    /// assert_eq!(h.device_view()?.copy_to_host_vec(&ctx)?, [1, 2, 3, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn mapped(
        ctx: &Context,
        shape: &[usize],
        order: Order,
    ) -> Result<HostArray<T>, ArrayError> {
        Self::make(shape, order, |n| {
            Ok(Backing::Host(ctx.memhostalloc(n, true, false, false)?))
        })
    }

    /// A managed array (Numba's `managed_array`), attached globally: one address for the host
    /// and the devices.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<u32>::managed(&ctx, &[4], Order::C)?;
    /// h.write(&[4, 3, 2, 1])?;
    /// assert_eq!(h.read()?, [4, 3, 2, 1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn managed(
        ctx: &Context,
        shape: &[usize],
        order: Order,
    ) -> Result<HostArray<T>, ArrayError> {
        Self::make(shape, order, |n| {
            Ok(Backing::Managed(ctx.memallocmanaged(n, true)?))
        })
    }

    /// The shape.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<u8>::pinned(&ctx, &[2, 5], Order::F)?;
    /// assert_eq!(h.shape(), &[2, 5]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// The layout.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<u8>::pinned(&ctx, &[2, 5], Order::F)?;
    /// assert_eq!(h.layout().strides(), &[1, 2]);
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
    /// let h = HostArray::<u8>::pinned(&ctx, &[2, 5], Order::F)?;
    /// assert_eq!(h.size(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn size(&self) -> usize {
        self.layout.size()
    }

    /// The page-locked memory (`None` for a managed array or one without elements).
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<u8>::managed(&ctx, &[8], Order::C)?;
    /// assert!(h.host_memory().is_none()); // managed, not page-locked
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn host_memory(&self) -> Option<&HostMemory> {
        match &self.backing {
            Backing::Host(h) => Some(h),
            _ => None,
        }
    }

    /// Copies `data` (exactly the array's size, in its order) into the array. Work on the
    /// device that uses the memory must be done first.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<i16>::pinned(&ctx, &[3], Order::C)?;
    /// h.write(&[-1, 0, 1])?;
    /// assert!(h.write(&[1]).is_err()); // the wrong length
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn write(&self, data: &[T]) -> Result<(), ArrayError> {
        if data.len() != self.size() {
            return Err(ArrayError::HostLength {
                got: data.len(),
                expected: self.size(),
            });
        }
        let bytes: &[u8] = bytemuck::cast_slice(data);
        match &self.backing {
            Backing::Host(h) => h.write(0, bytes)?,
            Backing::Managed(m) => m.write(0, bytes)?,
            Backing::Empty => {}
        }
        Ok(())
    }

    /// The array's elements, copied out (in its order). Work on the device that writes the
    /// memory must be done first.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let h = HostArray::<i16>::pinned(&ctx, &[3], Order::C)?;
    /// h.write(&[-1, 0, 1])?;
    /// assert_eq!(h.read()?, [-1, 0, 1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read(&self) -> Result<Vec<T>, ArrayError> {
        let mut out = vec![T::zeroed(); self.size()];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        match &self.backing {
            Backing::Host(h) => h.read(0, bytes)?,
            Backing::Managed(m) => m.read(0, bytes)?,
            Backing::Empty => {}
        }
        Ok(out)
    }

    /// The same memory as a device array (mapped and managed arrays; an array without
    /// elements gives an empty one). A pinned array that is not mapped has no device view.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let m = HostArray::<u8>::mapped(&ctx, &[2], Order::C)?;
    /// m.write(&[7, 9])?;
    /// assert_eq!(m.device_view()?.copy_to_host_vec(&ctx)?, [7, 9]);
    /// let p = HostArray::<u8>::pinned(&ctx, &[2], Order::C)?;
    /// assert!(p.device_view().is_err()); // not mapped: no device address
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn device_view(&self) -> Result<DeviceArray<T>, ArrayError> {
        let mem = match &self.backing {
            Backing::Host(h) => Some(
                h.mapped()
                    .ok_or_else(|| {
                        invalid(
                            "device_view",
                            "a pinned array that is not mapped has no device address; make it \
                             with HostArray::mapped",
                        )
                    })?
                    .device()
                    .clone(),
            ),
            Backing::Managed(m) => Some(m.device().clone()),
            Backing::Empty => None,
        };
        Ok(DeviceArray::from_parts(mem, self.layout.clone()))
    }
}

/// A host slice page-locked for a scope (Numba's `cuda.pinned`): see [`with_pinned`]. The
/// slice stays exclusively borrowed, so only this value reaches it while it is pinned, and
/// every copy through it is synchronous.
#[derive(Debug)]
pub struct PinnedSlice<'a, T: Pod> {
    host: &'a mut [T],
    /// The pin, released when the scope ends (unpins are not deferred).
    _pin: HostMemory,
}

impl<T: Pod> PinnedSlice<'_, T> {
    /// The elements.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let mut host = vec![3u8; 16];
    /// emm_array::with_pinned(&ctx, &mut host, |p| assert_eq!(p.as_slice()[0], 3))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn as_slice(&self) -> &[T] {
        self.host
    }

    /// The elements, to change between copies.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let mut host = vec![0u8; 16];
    /// emm_array::with_pinned(&ctx, &mut host, |p| p.as_mut_slice().fill(1))?;
    /// assert_eq!(host, [1; 16]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.host
    }

    /// Copies the slice into `dst` (exactly its size, contiguous) from page-locked memory.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let d = DeviceArray::<u8>::new(&ctx, &[4], Order::C)?;
    /// let mut host = vec![1u8, 2, 3, 4];
    /// emm_array::with_pinned(&ctx, &mut host, |p| p.copy_to_device(&ctx, &d))??;
    /// assert_eq!(d.copy_to_host_vec(&ctx)?, [1, 2, 3, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to_device(&self, ctx: &Context, dst: &DeviceArray<T>) -> Result<(), ArrayError> {
        dst.copy_from_host(ctx, self.host)
    }

    /// Copies `src` (exactly the slice's size, contiguous) into the slice, to page-locked
    /// memory.
    ///
    /// ```
    /// # use emm_array::{DeviceArray, HostArray, Layout, Order};
    /// # let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// # let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// # let ctx = runtime.context(0)?;
    /// let d = DeviceArray::to_device(&ctx, &[5u8, 6], &[2], Order::C)?;
    /// let mut host = vec![0u8; 2];
    /// emm_array::with_pinned(&ctx, &mut host, |p| p.copy_from_device(&ctx, &d))??;
    /// assert_eq!(host, [5, 6]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_from_device(
        &mut self,
        ctx: &Context,
        src: &DeviceArray<T>,
    ) -> Result<(), ArrayError> {
        src.copy_to_host(ctx, self.host)
    }
}

/// Page-locks `host` while `f` runs (Numba's `with cuda.pinned(arr):`), so that copies
/// between it and device arrays run at page-locked speed; the pin is released when `f`
/// returns or unwinds. An empty slice is not pinned (there is nothing to pin).
///
/// ```
/// use emm_array::{DeviceArray, Order, with_pinned};
///
/// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
/// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
/// let ctx = runtime.context(0)?;
/// let dev = DeviceArray::<u32>::new(&ctx, &[256], Order::C)?;
/// let mut host: Vec<u32> = (0..256).collect();
/// with_pinned(&ctx, &mut host, |pinned| -> Result<(), emm_array::ArrayError> {
///     pinned.copy_to_device(&ctx, &dev)?;
///     pinned.as_mut_slice().fill(0);
///     pinned.copy_from_device(&ctx, &dev)
/// })??;
/// assert_eq!(host[255], 255);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn with_pinned<T: Pod, R>(
    ctx: &Context,
    host: &mut [T],
    f: impl FnOnce(&mut PinnedSlice<'_, T>) -> R,
) -> Result<R, ArrayError> {
    let bytes = std::mem::size_of_val(host);
    if bytes == 0 {
        return Err(invalid(
            "with_pinned",
            "the slice is empty: there is nothing to pin",
        ));
    }
    let at = emm::driver_sys::HostPtr(host.as_mut_ptr() as usize);
    let owner: emm::plugin::HostOwner = std::sync::Arc::new(());
    // SAFETY: the range is `host`, exclusively borrowed for this whole function, so it stays
    // alive and unmoved until the pin (inside the `PinnedSlice`) is dropped below, before the
    // borrow ends; the owner is a placeholder because the borrow, not an owner, keeps it alive.
    // While pinned, the slice is reached only through the `PinnedSlice`, whose copies are
    // synchronous, so no reference is used while a driver copy writes the memory.
    let pin = unsafe { ctx.mempin(owner, at, bytes, false) }?;
    let mut pinned = PinnedSlice { host, _pin: pin };
    let out = f(&mut pinned);
    drop(pinned);
    Ok(out)
}
