//! The `limit` adaptor: a cap on the device bytes in use.

use driver_sys::DeviceOrdinal;

use crate::adaptors::{Event, Observer};
use crate::contract::info::MemoryKind;
use crate::error::EmmError;
use crate::sync::{AtomicUsize, Ordering};

#[derive(Debug)]
pub(super) struct Limit {
    pub(super) limit: usize,
    pub(super) in_use: AtomicUsize,
}

impl Observer for Limit {
    fn admit(&self, device: DeviceOrdinal, kind: MemoryKind, bytes: usize) -> Result<(), EmmError> {
        if kind != MemoryKind::Device {
            return Ok(());
        }
        let before = self.in_use.fetch_add(bytes, Ordering::AcqRel);
        let would_be = before.saturating_add(bytes);
        if would_be > self.limit {
            self.in_use.fetch_sub(bytes, Ordering::AcqRel);
            tracing::warn!(%device, requested = bytes, in_use = before, limit = self.limit, "allocation refused by the limit adaptor");
            return Err(EmmError::OverLimit {
                device,
                requested: bytes,
                would_be,
                limit: self.limit,
            });
        }
        Ok(())
    }

    fn allocated(&self, e: &Event) {
        if e.addr.is_none() && e.kind == MemoryKind::Device {
            // Admitted, then refused by the manager: give the bytes back.
            self.in_use.fetch_sub(e.bytes, Ordering::AcqRel);
        }
    }

    fn freed(&self, e: &Event) {
        if e.kind == MemoryKind::Device {
            self.in_use.fetch_sub(e.bytes, Ordering::AcqRel);
        }
    }
}
