//! How a manager is built: [`ManagerContext`] (what it is built from) and [`ManagerFactory`]
//! (one manager per context), with [`FnFactory`] for plugins written as a closure.

use std::fmt;
use std::sync::Arc;

use driver_sys::{ContextHandle, DeviceOrdinal, Driver};

use crate::contract::info::{AllocationEvents, PinnedPoolConfig};
use crate::contract::manager::{INTERFACE_VERSION, MemoryManager};
use crate::error::EmmError;
use crate::memory::liveness::ContextLiveness;
use crate::memory::pending::PendingDeallocs;
use crate::memory::policy::DeallocConfig;

/// What a manager is built from: the context it serves and the means to reach the driver.
#[derive(Clone, Debug)]
pub struct ManagerContext {
    /// The driver.
    pub driver: Arc<dyn Driver>,
    /// The device.
    pub device: DeviceOrdinal,
    /// The context (the device's primary context).
    pub context: ContextHandle,
    /// The deferred-deallocation thresholds in force.
    pub dealloc_config: DeallocConfig,
    /// Whether the context may still reach the driver; a manager's driver calls on behalf of
    /// memory that outlived a device reset must check it (see [`ContextLiveness`]).
    pub liveness: Arc<ContextLiveness>,
    /// The pinned host pool the host layer is to keep, if the runtime asks for one.
    pub pinned_pool: Option<PinnedPoolConfig>,
    /// Whether `memhostalloc` takes its memory from the driver's pool in host memory
    /// (`EMM_HOST_MEMORY_POOL`) instead of `cuMemHostAlloc`.
    pub host_memory_pool: bool,
    /// The context's out-of-memory counts, shared by its manager and the context.
    pub events: Arc<AllocationEvents>,
}

impl ManagerContext {
    /// A deferred-deallocation queue for this context with the thresholds in force.
    pub fn new_pending_deallocs(&self) -> PendingDeallocs {
        PendingDeallocs::new(
            Arc::clone(&self.driver),
            self.device,
            self.context,
            Arc::clone(&self.liveness),
            self.dealloc_config,
        )
    }
}

#[cfg(all(test, not(emm_loom)))]
impl ManagerContext {
    /// The primary context of a fresh simulated GPU of 256 MiB, as a host runtime that embeds
    /// a manager without emm's runtime would make it: for the unit tests of the layers below
    /// the runtime.
    pub(crate) fn simulated(pinned_pool: Option<PinnedPoolConfig>) -> ManagerContext {
        use driver_mock::{SimConfig, SimDriver};
        let sim = Arc::new(SimDriver::new(SimConfig::single(256 << 20)));
        let device = DeviceOrdinal(0);
        sim.init().expect("cuInit on the simulator");
        let context = sim.primary_ctx_retain(device).expect("a simulated context");
        ManagerContext {
            driver: sim,
            device,
            context,
            dealloc_config: DeallocConfig::default(),
            liveness: Arc::new(ContextLiveness::new()),
            pinned_pool,
            host_memory_pool: false,
            events: Arc::default(),
        }
    }
}

/// Builds one manager per context.
pub trait ManagerFactory: Send + Sync + fmt::Debug {
    /// The manager's name, for messages and for selection by `EMM_MEMORY_MANAGER`.
    fn name(&self) -> &str;

    /// The interface version the managers this factory builds implement.
    fn interface_version(&self) -> u32;

    /// Builds the manager for one context.
    fn create(&self, cx: &ManagerContext) -> Result<Box<dyn MemoryManager>, EmmError>;
}

type CreateFn = dyn Fn(&ManagerContext) -> Result<Box<dyn MemoryManager>, EmmError> + Send + Sync;

/// A [`ManagerFactory`] from a name and a closure, for interface version 1 plugins.
pub struct FnFactory {
    name: String,
    version: u32,
    create: Box<CreateFn>,
}

impl FnFactory {
    /// A factory named `name` that builds managers with `create`.
    pub fn new(
        name: impl Into<String>,
        create: impl Fn(&ManagerContext) -> Result<Box<dyn MemoryManager>, EmmError>
        + Send
        + Sync
        + 'static,
    ) -> FnFactory {
        FnFactory {
            name: name.into(),
            version: INTERFACE_VERSION,
            create: Box::new(create),
        }
    }

    /// Declares another interface version (to test the version check).
    #[must_use]
    pub fn with_interface_version(mut self, version: u32) -> FnFactory {
        self.version = version;
        self
    }
}

impl fmt::Debug for FnFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnFactory")
            .field("name", &self.name)
            .field("version", &self.version)
            .finish()
    }
}

impl ManagerFactory for FnFactory {
    fn name(&self) -> &str {
        &self.name
    }

    fn interface_version(&self) -> u32 {
        self.version
    }

    fn create(&self, cx: &ManagerContext) -> Result<Box<dyn MemoryManager>, EmmError> {
        (self.create)(cx)
    }
}
