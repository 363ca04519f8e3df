//! [`Runtime`]: the driver, the manager choice, and one [`Context`] per device.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use driver_sys::{DeviceOrdinal, Driver};

use crate::adaptors::{AdaptedFactory, Adaptor};
use crate::contract::factory::{ManagerContext, ManagerFactory};
use crate::contract::info::PinnedPoolConfig;
use crate::contract::ipc::{DeviceIdentity, identity_of};
use crate::contract::manager::check_interface_version;
#[cfg(unix)]
use crate::contract::pool_export::PoolExport;
use crate::contract::pool_export::PoolId;
use crate::error::EmmError;
use crate::ipc::imports::PoolImports;
use crate::managers::default::{DEFAULT_MANAGER, DefaultManager};
use crate::memory::liveness::ContextLiveness;
use crate::memory::policy::DeallocConfig;
use crate::objects::ModuleRegistry;
use crate::resources::DeviceMemoryResource;
use crate::sync::{Mutex, lock};

pub mod config;
pub mod context;
mod copies;
pub mod graphs;
mod ipc;
mod sleep;

use config::{
    adaptors_from_lookup, host_memory_pool_from_lookup, manager_name_from_env,
    pinned_pool_from_lookup,
};
use context::{Context, ContextInner};

/// Configures a [`Runtime`]. Obtain one with [`Runtime::builder`].
pub struct RuntimeBuilder {
    driver: Arc<dyn Driver>,
    registry: BTreeMap<String, Arc<dyn ManagerFactory>>,
    selected: Option<Selection>,
    dealloc_config: Option<DeallocConfig>,
    pinned_pool: Option<Option<PinnedPoolConfig>>,
    host_memory_pool: Option<bool>,
    adaptors: Option<Vec<Adaptor>>,
    read_env: bool,
}

enum Selection {
    Name(String),
    Factory(Arc<dyn ManagerFactory>),
}

impl fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("driver", &self.driver.name())
            .field("registered", &self.registry.keys().collect::<Vec<_>>())
            .field("dealloc_config", &self.dealloc_config)
            .field("read_env", &self.read_env)
            .finish()
    }
}

impl RuntimeBuilder {
    /// Registers a manager under its [`name`](ManagerFactory::name), so that
    /// `EMM_MEMORY_MANAGER` or [`memory_manager_name`](Self::memory_manager_name) can pick it.
    #[must_use]
    pub fn register_manager(mut self, factory: impl ManagerFactory + 'static) -> Self {
        self.registry
            .insert(factory.name().to_owned(), Arc::new(factory));
        self
    }

    /// Uses this manager for every context (Numba's `set_memory_manager`); it takes precedence
    /// over `EMM_MEMORY_MANAGER`.
    #[must_use]
    pub fn memory_manager(mut self, factory: impl ManagerFactory + 'static) -> Self {
        self.selected = Some(Selection::Factory(Arc::new(factory)));
        self
    }

    /// Uses the registered manager `name`; it takes precedence over `EMM_MEMORY_MANAGER`.
    #[must_use]
    pub fn memory_manager_name(mut self, name: impl Into<String>) -> Self {
        self.selected = Some(Selection::Name(name.into()));
        self
    }

    /// Uses these deallocation thresholds instead of reading them from the environment.
    #[must_use]
    pub fn dealloc_config(mut self, config: DeallocConfig) -> Self {
        self.dealloc_config = Some(config);
        self
    }

    /// Makes `memhostalloc` take its memory from the driver's pool in host memory (what
    /// cuda.core's pinned memory resource allocates from; CUDA 12.6 on) instead of
    /// `cuMemHostAlloc`, under any manager; this takes precedence over
    /// `EMM_HOST_MEMORY_POOL`. Portable and write-combined requests are then refused, and it
    /// does not combine with the pinned host pool (`pinned_host_pool`).
    #[must_use]
    pub fn host_memory_pool(mut self, on: bool) -> Self {
        self.host_memory_pool = Some(on);
        self
    }

    /// Gives every context's host layer a pinned host pool (`Some`), or none (`None`); this
    /// takes precedence over `EMM_PINNED_HOST_POOL`.
    #[must_use]
    pub fn pinned_host_pool(mut self, config: Option<PinnedPoolConfig>) -> Self {
        self.pinned_pool = Some(config);
        self
    }

    /// Wraps every context's manager in `adaptors`, innermost first; this takes precedence
    /// over `EMM_MEMORY_ADAPTORS`. `[Adaptor::Limit(1 << 30), Adaptor::Stats]` gives
    /// `stats(limit(manager))`.
    #[must_use]
    pub fn adaptors(mut self, adaptors: Vec<Adaptor>) -> Self {
        self.adaptors = Some(adaptors);
        self
    }

    /// Ignores the `EMM_*` environment variables: defaults apply where nothing is set in code.
    #[must_use]
    pub fn ignore_env(mut self) -> Self {
        self.read_env = false;
        self
    }

    /// Initialises the driver, resolves the manager and checks its interface version.
    pub fn build(self) -> Result<Runtime, EmmError> {
        let dealloc_config = match self.dealloc_config {
            Some(c) => c,
            None if self.read_env => DeallocConfig::from_env()?,
            None => DeallocConfig::default(),
        };
        let selection = match self.selected {
            Some(s) => s,
            None => {
                let from_env = if self.read_env {
                    manager_name_from_env()?
                } else {
                    None
                };
                Selection::Name(from_env.unwrap_or_else(|| DEFAULT_MANAGER.to_owned()))
            }
        };
        let env = |name: &str| {
            if self.read_env {
                std::env::var(name).ok()
            } else {
                None
            }
        };
        let pinned_pool = match self.pinned_pool {
            Some(p) => p,
            None => pinned_pool_from_lookup(env)?,
        };
        let host_memory_pool = match self.host_memory_pool {
            Some(on) => on,
            None => host_memory_pool_from_lookup(env)?,
        };
        if host_memory_pool && pinned_pool.is_some() {
            return Err(EmmError::Config {
                variable: config::ENV_HOST_MEMORY_POOL,
                value: "on".into(),
                reason: "the driver's host memory pool and emm's pinned host pool \
                         (EMM_PINNED_HOST_POOL) both serve memhostalloc; choose one"
                    .into(),
            });
        }
        let adaptors = match self.adaptors {
            Some(a) => a,
            None => adaptors_from_lookup(env)?,
        };
        let mut factory = match selection {
            Selection::Factory(f) => f,
            Selection::Name(name) => resolve(&self.registry, &name)?,
        };
        if !adaptors.is_empty() {
            factory = Arc::new(AdaptedFactory::new(factory, adaptors));
        }
        check_interface_version(factory.interface_version())?;
        self.driver
            .init()
            .map_err(|e| EmmError::driver("driver initialisation", DeviceOrdinal(0), e))?;
        tracing::info!(
            driver = self.driver.name(),
            manager = factory.name(),
            ?dealloc_config,
            "emm runtime created"
        );
        Ok(Runtime {
            driver: self.driver,
            registry: self.registry,
            dealloc_config,
            pinned_pool,
            host_memory_pool,
            state: Mutex::new(State {
                factory,
                contexts: BTreeMap::new(),
            }),
            imports: Arc::new(PoolImports::default()),
            unreleased: Mutex::new(Vec::new()),
        })
    }
}

fn resolve(
    registry: &BTreeMap<String, Arc<dyn ManagerFactory>>,
    name: &str,
) -> Result<Arc<dyn ManagerFactory>, EmmError> {
    registry
        .get(name)
        .cloned()
        .ok_or_else(|| EmmError::UnknownManager {
            name: name.to_owned(),
            registered: registry.keys().cloned().collect(),
        })
}

struct State {
    factory: Arc<dyn ManagerFactory>,
    contexts: BTreeMap<DeviceOrdinal, Context>,
}

/// emm's entry point: owns the driver, the memory-manager choice and the contexts.
///
/// A value, not a process global, so several runtimes (say, one on the simulator and one on
/// the GPU) can live in one process. Dropping it resets every context it created and releases
/// their primary contexts; pointers that outlive it free nothing.
pub struct Runtime {
    driver: Arc<dyn Driver>,
    registry: BTreeMap<String, Arc<dyn ManagerFactory>>,
    dealloc_config: DeallocConfig,
    pinned_pool: Option<PinnedPoolConfig>,
    host_memory_pool: bool,
    state: Mutex<State>,
    imports: Arc<PoolImports>,
    /// Primary-context references the driver refused to release (twice): released again when
    /// the runtime ends, so that no reference is lost.
    unreleased: Mutex<Vec<DeviceOrdinal>>,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("Runtime")
            .field("driver", &self.driver.name())
            .field("manager", &state.factory.name())
            .field("devices_in_use", &state.contexts.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Runtime {
    /// A builder over `driver` with emm's managers registered: `default`, `pool`,
    /// `async-pool`, `async-pool-ipc` and `async-pool-managed`.
    pub fn builder(driver: Arc<dyn Driver>) -> RuntimeBuilder {
        RuntimeBuilder {
            driver,
            registry: BTreeMap::new(),
            selected: None,
            dealloc_config: None,
            pinned_pool: None,
            host_memory_pool: None,
            adaptors: None,
            read_env: true,
        }
        .register_manager(DefaultManager::factory())
        .register_manager(crate::managers::pool::PoolAllocator::factory())
        .register_manager(crate::managers::pool::PoolAllocator::vmm_factory())
        .register_manager(crate::managers::async_pool::AsyncPoolAllocator::factory())
        .register_manager(crate::managers::async_pool::AsyncPoolAllocator::ipc_factory())
        .register_manager(crate::managers::async_pool::AsyncPoolAllocator::managed_factory())
    }

    /// A runtime over `driver`, configured from the environment.
    pub fn new(driver: Arc<dyn Driver>) -> Result<Runtime, EmmError> {
        Runtime::builder(driver).build()
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The deallocation thresholds in force.
    pub fn dealloc_config(&self) -> DeallocConfig {
        self.dealloc_config
    }

    /// The names of the registered managers.
    pub fn registered_managers(&self) -> Vec<String> {
        self.registry.keys().cloned().collect()
    }

    /// The name of the manager new contexts get.
    pub fn memory_manager_name(&self) -> String {
        lock(&self.state).factory.name().to_owned()
    }

    /// Chooses the manager after the runtime was built but before any context exists
    /// (Numba's `set_memory_manager`); afterwards it is an error, not a silent no-op.
    pub fn set_memory_manager(
        &self,
        factory: impl ManagerFactory + 'static,
    ) -> Result<(), EmmError> {
        self.replace_factory(Arc::new(factory))
    }

    /// [`set_memory_manager`](Self::set_memory_manager) by registered name.
    pub fn select_memory_manager(&self, name: &str) -> Result<(), EmmError> {
        self.replace_factory(resolve(&self.registry, name)?)
    }

    fn replace_factory(&self, factory: Arc<dyn ManagerFactory>) -> Result<(), EmmError> {
        check_interface_version(factory.interface_version())?;
        let mut state = lock(&self.state);
        if let Some((device, ctx)) = state.contexts.iter().next() {
            return Err(EmmError::ManagerAlreadyFixed {
                device: *device,
                current: ctx.memory_manager_name().to_owned(),
            });
        }
        tracing::info!(manager = factory.name(), "memory manager selected");
        state.factory = factory;
        Ok(())
    }

    /// The number of devices.
    pub fn device_count(&self) -> Result<u32, EmmError> {
        self.driver
            .device_count()
            .map_err(|e| EmmError::driver("device count", DeviceOrdinal(0), e))
    }

    /// The context of `device`, created on first use; the manager's `initialize` runs on every
    /// call (Numba: on every context push).
    pub fn context(&self, device: impl Into<DeviceOrdinal>) -> Result<Context, EmmError> {
        let device = device.into();
        let ctx = {
            let mut state = lock(&self.state);
            match state.contexts.get(&device) {
                Some(ctx) => ctx.clone(),
                None => {
                    let ctx = self.create_context(device, &state.factory)?;
                    state.contexts.insert(device, ctx.clone());
                    ctx
                }
            }
        };
        ctx.inner.manager.initialize()?;
        Ok(ctx)
    }

    fn create_context(
        &self,
        device: DeviceOrdinal,
        factory: &Arc<dyn ManagerFactory>,
    ) -> Result<Context, EmmError> {
        let count = self.device_count()?;
        if device.0 >= count {
            return Err(EmmError::NoSuchDevice { device, count });
        }
        let handle = self
            .driver
            .primary_ctx_retain(device)
            .map_err(|e| EmmError::driver("primary context retain", device, e))?;
        let cx = ManagerContext {
            driver: Arc::clone(&self.driver),
            device,
            context: handle,
            dealloc_config: self.dealloc_config,
            liveness: Arc::new(ContextLiveness::new()),
            pinned_pool: self.pinned_pool,
            host_memory_pool: self.host_memory_pool,
            events: Arc::default(),
        };
        let manager = factory.create(&cx).and_then(|m| {
            check_interface_version(m.interface_version())?;
            Ok(m)
        });
        let manager = manager.and_then(|m| {
            let can_map = self
                .driver
                .device_attribute(device, driver_sys::DeviceAttribute::CanMapHostMemory)
                .map_err(|e| EmmError::driver("device attributes", device, e))?;
            Ok((m, can_map != 0))
        });
        let (manager, can_map_host_memory) = match manager {
            Ok(m) => m,
            Err(e) => {
                // Nothing was allocated in the context by us: the retain just above is given
                // back (or kept for the runtime's end, if the driver refuses it).
                if let Err(release) = self.release_primary(device) {
                    tracing::error!(%device, error = %release, "releasing the primary context after a failed manager creation");
                }
                return Err(e);
            }
        };
        tracing::info!(%device, context = %handle, manager = factory.name(), "context created");
        // The context's own queue: its items have no size, so only the count threshold applies.
        let own = Arc::new(cx.new_pending_deallocs());
        let events = Arc::clone(&cx.events);
        let context = Context {
            inner: Arc::new(ContextInner {
                manager,
                manager_name: factory.name().to_owned(),
                modules: Arc::new(ModuleRegistry::new(Arc::clone(&own))),
                own,
                can_map_host_memory,
                imports: Arc::clone(&self.imports),
                graph_routes: Default::default(),
                cx,
            }),
        };
        // Out-of-memory reports read the manager's figures (a weak reference: the events
        // live inside the context).
        let weak = Arc::downgrade(&context.inner);
        events.set_reporter(Box::new(move |requested, retries| {
            weak.upgrade().map_or_else(Default::default, |inner| {
                Context::out_of_memory_report(&inner, requested, retries)
            })
        }));
        Ok(context)
    }

    /// Imports a stream-ordered pool another process exported
    /// ([`Context::export_pool`](crate::Context::export_pool), received with
    /// [`PoolExport::receive`]) into the context of its device here, which gets read-write
    /// access to it. [`IpcHandle`](crate::IpcHandle)s of the pool's memory open from then on.
    /// Importing a pool again does nothing; a device reset ends the import (import it again).
    #[cfg(unix)]
    pub fn import_pool(&self, export: PoolExport) -> Result<(), EmmError> {
        let device = self.device_with_identity(&export.source())?;
        let ctx = self.context(device)?;
        self.imports.import(&ctx.inner.cx, export)
    }

    /// Imports `export` (as [`import_pool`](Self::import_pool)) and returns a resource that
    /// maps the imported pool (cuda.core's `DeviceMemoryResource.from_allocation_handle`):
    /// [`is_mapped`](DeviceMemoryResource::is_mapped), allocates nothing, and its buffers'
    /// handles open here as any. Importing a pool twice gives a resource over the same import.
    #[cfg(unix)]
    pub fn memory_resource_from_allocation_handle(
        &self,
        export: PoolExport,
    ) -> Result<DeviceMemoryResource, EmmError> {
        let id = export.id();
        self.import_pool(export)?;
        self.imported_memory_resource(id)
            .ok_or(EmmError::InvalidArgument {
                what: "memory_resource_from_allocation_handle",
                reason: format!("pool {id} was imported but its context is gone; import it again"),
            })
    }

    /// The resource over pool `id`, if this runtime imported it and its context lives (the
    /// registry by id that cuda.core keeps by UUID: `from_registry`).
    pub fn imported_memory_resource(&self, id: PoolId) -> Option<DeviceMemoryResource> {
        let (cx, pool) = self.imports.pool_of(id)?;
        Some(DeviceMemoryResource::mapped(&cx, pool, id))
    }

    /// Whether `memhostalloc` takes its memory from the driver's pool in host memory
    /// ([`RuntimeBuilder::host_memory_pool`], `EMM_HOST_MEMORY_POOL`).
    pub fn uses_host_memory_pool(&self) -> bool {
        self.host_memory_pool
    }

    /// The device whose PCI identity is `identity` (Numba's `Device.from_identity`).
    pub fn device_with_identity(
        &self,
        identity: &DeviceIdentity,
    ) -> Result<DeviceOrdinal, EmmError> {
        for d in 0..self.device_count()? {
            let dev = DeviceOrdinal(d);
            let id = identity_of(&*self.driver, dev)?;
            if id == *identity {
                return Ok(dev);
            }
        }
        Err(EmmError::NoDeviceWithIdentity {
            identity: identity.to_string(),
        })
    }

    /// The contexts that exist now, by device.
    pub fn contexts(&self) -> Vec<Context> {
        lock(&self.state).contexts.values().cloned().collect()
    }

    /// Resets a device, in Numba's order (`Device.reset`):
    ///
    /// 1. the context's manager is reset (it frees everything it allocated), and frees it
    ///    still defers (inside `defer_cleanup`) are issued: the context is going away;
    /// 2. the context is marked dead, so memory that outlives it never reaches the driver;
    /// 3. the primary context is released, and then reset **whatever happened before**.
    ///
    /// The next [`context`](Self::context) call for the device builds a new context with a new
    /// manager. The first error is returned after all steps ran. Called from inside the
    /// device context's out-of-memory callback ([`Context::on_out_of_memory`]), whose
    /// allocation is still under way, it refuses with [`EmmError::InvalidArgument`] and
    /// changes nothing.
    pub fn reset_device(&self, device: impl Into<DeviceOrdinal>) -> Result<(), EmmError> {
        let device = device.into();
        let mut state = lock(&self.state);
        if let Some(ctx) = state.contexts.get(&device) {
            ctx.refuse_inside_callback("Runtime::reset_device")?;
        }
        tracing::info!(%device, "device reset");
        let before = match state.contexts.remove(&device) {
            Some(ctx) => self.retire(&ctx),
            None => Ok(()),
        };
        // SAFETY: the context (if any) was retired: its manager freed everything and it is
        // marked dead, so nothing emm holds reaches the destroyed context afterwards. Holding
        // the state lock keeps a new context from being created meanwhile.
        let reset = unsafe { self.driver.primary_ctx_reset(device) }
            .map_err(|e| EmmError::driver("primary context reset", device, e));
        drop(state);
        before.and(reset)
    }

    /// Resets the context (Numba's order), issues what it still defers, kills the context and
    /// releases its primary context.
    fn retire(&self, ctx: &Context) -> Result<(), EmmError> {
        let inner = &ctx.inner;
        let mut reset = ctx.reset();
        // Pointers imported from other processes' pools go before the context does, once the
        // copies under way through them are done.
        reset = reset.and({
            let _uses = inner.cx.liveness.exclusive_memory();
            self.imports.release_device(inner.cx.device)
        });
        for queue in inner
            .manager
            .deallocations()
            .into_iter()
            .chain([&inner.own])
        {
            reset = reset.and(queue.flush_for_teardown().map(|_| ()));
        }
        inner.cx.liveness.kill();
        let release = self.release_primary(inner.cx.device);
        reset.and(release)
    }

    /// Gives back one reference to `device`'s primary context, which emm retained and no longer
    /// uses. A failed release changed nothing (the driver's contract), and no one else will
    /// ever release this reference: it is tried once more, and if the driver refuses again,
    /// kept for the runtime's end (and the error returned).
    fn release_primary(&self, device: DeviceOrdinal) -> Result<(), EmmError> {
        let release = || {
            // SAFETY: matches a retain emm made (a failed attempt released nothing); the context
            // is dead or was never used, so nothing emm holds uses its memory again.
            unsafe { self.driver.primary_ctx_release(device) }
        };
        release()
            .or_else(|e| {
                tracing::warn!(%device, error = %e, "releasing the primary context failed; trying once more");
                release()
            })
            .map_err(|e| {
                lock(&self.unreleased).push(device);
                EmmError::driver("primary context release", device, e)
            })
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let contexts = std::mem::take(&mut lock(&self.state).contexts);
        for ctx in contexts.values() {
            if let Err(e) = self.retire(ctx) {
                tracing::error!(device = %ctx.device(), error = %e, "tearing down a context while dropping the runtime");
            }
        }
        // References the driver refused to release earlier: a last attempt each.
        for device in std::mem::take(&mut *lock(&self.unreleased)) {
            // SAFETY: a reference emm retained and failed to give back; the context is dead.
            if let Err(e) = unsafe { self.driver.primary_ctx_release(device) } {
                tracing::error!(%device, error = %e, "the primary context reference the driver refused to release stays retained");
            }
        }
    }
}
