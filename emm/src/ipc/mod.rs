//! Layer 5, IPC at work: opening handles directly or staged (`open`), the runtime's table of
//! imported stream-ordered pools (`imports`), mapping a `vmm-pool` allocation's exported
//! physical memory (`mapped`), and a [`PoolExport`](crate::contract::PoolExport)'s or
//! [`MappedExport`](crate::contract::MappedExport)'s trip over a Unix socket to the processes
//! the exporter allows (`transfer`: [`PeerPolicy`], [`bind_owner_only`]). What the contract returns ([`IpcHandle`](crate::IpcHandle),
//! [`PoolExport`](crate::contract::PoolExport)) is data in `crate::contract`; this layer does the work.

pub(crate) mod imports;
#[cfg(unix)]
pub(crate) mod mapped;
pub(crate) mod open;
#[cfg(unix)]
mod transfer;

#[cfg(unix)]
pub use transfer::{PeerPolicy, bind_owner_only};
