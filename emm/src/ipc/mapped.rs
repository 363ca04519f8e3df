//! Opening a [`MappedExport`] in a context: addresses reserved for its pieces, each piece's
//! physical memory imported from its file descriptor and mapped in order, made accessible to
//! the context's device; all of it undone when the last pointer drops (or an open fails).

use std::os::fd::AsFd;

use driver_sys::{DevicePtr, DriverError};

use crate::contract::factory::ManagerContext;
use crate::contract::mapped_export::MappedExport;
use crate::error::EmmError;
use crate::memory::pointer::{MemoryPointer, Release};

const WHAT: &str = "open_mapped";

/// A reservation of `span` bytes at `base` and the pieces mapped in it from its start, in
/// order: unmapped and the reservation freed when dropped (nothing to do once the context is
/// gone; its mappings went with it).
struct Mapped {
    cx: ManagerContext,
    base: u64,
    span: usize,
    pieces: Vec<usize>,
}

impl Drop for Mapped {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        let cx = &self.cx;
        let Some(_live) = cx.liveness.enter() else {
            return;
        };
        let failed = |what: &'static str, e: DriverError| {
            tracing::error!(device = %cx.device, error = %e, ptr = self.base, "{what} of an opened mapped export failed; the context's destruction takes it");
        };
        let mut at = self.base;
        let mut all_unmapped = true;
        for &piece in &self.pieces {
            // SAFETY: a mapping this open made at `at`, unmapped once, here; the pointers into
            // it are gone (this runs as the last one's release, or before any was made).
            if let Err(e) = unsafe { cx.driver.mem_unmap(cx.context, DevicePtr(at), piece) } {
                failed("cuMemUnmap", e);
                all_unmapped = false;
            }
            at += piece as u64;
        }
        if !all_unmapped {
            return;
        }
        // SAFETY: this open's reservation, with nothing mapped in it any more, freed once.
        if let Err(e) = unsafe {
            cx.driver
                .mem_address_free(cx.context, DevicePtr(self.base), self.span)
        } {
            failed("cuMemAddressFree", e);
        }
        tracing::debug!(device = %cx.device, ptr = self.base, span = self.span, "mapped export closed");
    }
}

/// Maps `export`'s memory into `cx` (a context of the exporting device) and returns a pointer
/// to the exported allocation; the mapping goes when the pointer's last clone drops.
#[allow(unsafe_code)]
pub(crate) fn open_mapped(
    cx: &ManagerContext,
    export: MappedExport,
) -> Result<MemoryPointer, EmmError> {
    let here = cx.device_identity()?;
    if export.source() != here {
        return Err(EmmError::InvalidArgument {
            what: "context to open a mapped export in",
            reason: format!(
                "the memory is on device {} and this context's device is {here}; open it in a \
                 context of the exporting device (Runtime::device_with_identity) and copy from \
                 there",
                export.source()
            ),
        });
    }
    let driver_error = |e| cx.driver_error(WHAT, e);
    let granularity = cx
        .driver
        .mem_vmm_granularity(cx.device)
        .map_err(driver_error)?;
    if let Some(&odd) = export.pieces().iter().find(|&&p| p % granularity != 0) {
        return Err(EmmError::InvalidArgument {
            what: "mapped export",
            reason: format!(
                "a piece of {odd} bytes is not a multiple of the device's granularity \
                 ({granularity} bytes); the export was not made by emm's vmm-pool on this device"
            ),
        });
    }
    let (offset, size) = (export.offset(), export.size());
    let span: usize = export.pieces().iter().sum();
    let _live = cx.enter(WHAT)?;
    let base = cx
        .driver
        .mem_address_reserve(cx.context, span)
        .map_err(driver_error)?;
    // From here on, dropping `mapped` undoes what was done.
    let mut mapped = Mapped {
        cx: cx.clone(),
        base: base.0,
        span,
        pieces: Vec::new(),
    };
    let mut at = base.0;
    for (piece, fd) in export.into_pieces() {
        let handle = cx
            .driver
            .mem_import_fd(cx.context, fd.as_fd())
            .map_err(driver_error)?;
        // SAFETY: `at .. at + piece` lies in the reservation made above, past every piece
        // mapped so far, with nothing mapped there.
        let map = unsafe { cx.driver.mem_map(cx.context, DevicePtr(at), piece, handle) };
        // SAFETY: imported above and released once; a mapping keeps the memory.
        let released = unsafe { cx.driver.mem_release(cx.context, handle) };
        map.map_err(driver_error)?;
        mapped.pieces.push(piece);
        released.map_err(driver_error)?;
        cx.driver
            .mem_set_access(cx.context, DevicePtr(at), piece, cx.device)
            .map_err(driver_error)?;
        at += piece as u64;
    }
    let whole = MemoryPointer::from_release(
        cx.device,
        cx.context,
        base,
        span,
        Release::custom(move |_, _| drop(mapped)),
        None,
    );
    tracing::debug!(device = %cx.device, %base, span, offset, size, "mapped export opened");
    whole.view(offset, Some(offset + size))
}
