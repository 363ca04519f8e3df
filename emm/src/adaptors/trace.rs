//! The `trace` adaptor: `tracing` spans around every call, events for frees.

use driver_sys::DeviceOrdinal;

use crate::adaptors::{Event, Observer};

#[derive(Debug)]
pub(super) struct Trace;

impl Observer for Trace {
    fn span(
        &self,
        op: &'static str,
        device: DeviceOrdinal,
        bytes: usize,
    ) -> Option<tracing::span::EnteredSpan> {
        Some(tracing::debug_span!("emm.call", op, %device, bytes).entered())
    }

    fn allocated(&self, e: &Event) {
        match e.addr {
            Some(addr) => {
                tracing::debug!(device = %e.device, kind = e.kind.name(), bytes = e.bytes, addr = format_args!("{addr:#x}"), "allocated")
            }
            None => {
                tracing::debug!(device = %e.device, kind = e.kind.name(), bytes = e.bytes, "allocation failed")
            }
        }
    }

    fn freed(&self, e: &Event) {
        tracing::debug!(device = %e.device, kind = e.kind.name(), bytes = e.bytes, addr = format_args!("{:#x}", e.addr.unwrap_or(0)), "freed");
    }
}
