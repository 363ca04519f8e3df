//! Numba's `test_emm_plugins.py`: a device-only plugin (a host runtime's own allocator) under
//! the host-only layer.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use driver_mock::Op;
use emm::contract::FnFactory;
use emm::driver_sys::{DevicePtr, IpcMemHandle};
use emm::plugin::{DeviceAllocator, HostLayer, HostOnly};
use emm::{EmmError, IpcHandle, MemoryInfo, MemoryPointer};
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

/// What the plugin records (Numba's fixture keeps the same fields).
#[derive(Debug, Default)]
pub struct PluginState {
    pub initialized: bool,
    pub count: u64,
    pub allocations: BTreeMap<u64, usize>,
    pub reset_called: bool,
}

/// Numba's `DeviceOnlyEMMPlugin`: hands out counter values as pointers and records sizes; the
/// release action removes the record at once.
#[derive(Debug, Clone, Default)]
pub struct DeviceOnlyEmmPlugin {
    pub state: Arc<Mutex<PluginState>>,
}

impl DeviceAllocator for DeviceOnlyEmmPlugin {
    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let mut st = self.state.lock().unwrap();
        if !st.initialized {
            return Err(EmmError::NotSupported {
                operation: "memalloc",
                manager: "DeviceOnlyEMMPlugin".into(),
                advice: "memalloc called before initialize",
            });
        }
        st.count += 1;
        let n = st.count;
        st.allocations.insert(n, bytes);
        let state = Arc::clone(&self.state);
        let cx = host.context();
        // SAFETY: the plugin's addresses are fake, as in Numba's test, and the tests that use it
        // never copy into or out of them; the release only forgets the entry.
        Ok(unsafe {
            MemoryPointer::with_release(
                cx.device,
                cx.context,
                DevicePtr(n),
                bytes,
                move |ptr, _| {
                    state.lock().unwrap().allocations.remove(&ptr.0);
                },
            )
        })
    }

    fn initialize(&self, _host: &HostLayer) -> Result<(), EmmError> {
        self.state.lock().unwrap().initialized = true;
        Ok(())
    }

    fn get_memory_info(&self, _host: &HostLayer) -> Result<MemoryInfo, EmmError> {
        Ok(MemoryInfo {
            free: 32,
            total: 64,
        })
    }

    fn get_ipc_handle(
        &self,
        _host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<IpcHandle, EmmError> {
        let text = format!("Dummy IPC handle for alloc {}", memory.device_ptr().0);
        let mut bytes = [0u8; 64];
        bytes[..text.len()].copy_from_slice(text.as_bytes());
        Ok(IpcHandle::new(IpcMemHandle(bytes), memory.size(), 0, None))
    }

    fn reset(&self, _host: &HostLayer) -> Result<(), EmmError> {
        self.state.lock().unwrap().reset_called = true;
        Ok(())
    }
}

/// A runtime whose manager is the plugin; returns the plugin's state.
fn with_plugin(target: Target) -> Result<(TestCtx, Arc<Mutex<PluginState>>), Failed> {
    let plugin = DeviceOnlyEmmPlugin::default();
    let state = Arc::clone(&plugin.state);
    let t = TestCtx::with(target, move |b| {
        b.memory_manager(FnFactory::new("DeviceOnlyEMMPlugin", move |cx| {
            Ok(Box::new(HostOnly::new(cx, plugin.clone())))
        }))
    })?;
    Ok((t, state))
}

/// Numba `test_memalloc`: the plugin allocates, its records match, a drop releases at once.
pub fn test_memalloc(target: Target) -> Result<(), Failed> {
    let (t, state) = with_plugin(target)?;
    let ctx = t.context()?;
    let frees_before = t.sim().map(|s| s.count(Op::MemAlloc));
    let first = ctx.memalloc(80)?;
    ensure_eq!(state.lock().unwrap().count, 1);
    ensure_eq!(state.lock().unwrap().allocations.get(&1).copied(), Some(80));
    let second = ctx.memalloc(40)?;
    ensure_eq!(state.lock().unwrap().count, 2);
    ensure_eq!(state.lock().unwrap().allocations.get(&2).copied(), Some(40));
    drop(first);
    ensure!(
        !state.lock().unwrap().allocations.contains_key(&1),
        "key 1 is released at once"
    );
    ensure!(
        state.lock().unwrap().allocations.contains_key(&2),
        "key 2 is still held"
    );
    drop(second);
    ensure!(state.lock().unwrap().allocations.is_empty());
    if let (Some(sim), Some(before)) = (t.sim(), frees_before) {
        ensure_eq!(
            sim.count(Op::MemAlloc),
            before,
            "no cuMemAlloc while a plugin owns device memory"
        );
    }
    Ok(())
}

/// Numba `test_initialized_in_context`: using the context runs the plugin's `initialize`.
pub fn test_initialized_in_context(target: Target) -> Result<(), Failed> {
    let (t, state) = with_plugin(target)?;
    ensure!(!state.lock().unwrap().initialized);
    t.context()?;
    ensure!(
        state.lock().unwrap().initialized,
        "Runtime::context calls initialize"
    );
    Ok(())
}

/// Numba `test_reset`: a context reset calls the plugin's reset, and the host layer's reset
/// runs too, although the plugin does not call it.
pub fn test_reset(target: Target) -> Result<(), Failed> {
    let (t, state) = with_plugin(target)?;
    let ctx = t.context()?;
    let mapped = ctx.memhostalloc(64, true, false, false)?;
    ctx.reset()?;
    ensure!(state.lock().unwrap().reset_called, "the plugin's reset ran");
    ensure!(
        !mapped.mapped().expect("mapped").device().is_live(),
        "the host layer's reset freed the mapped memory"
    );
    if let Some(sim) = t.sim() {
        ensure!(
            sim.leak_report().host_allocations.is_empty(),
            "{}",
            sim.leak_report()
        );
    }
    Ok(())
}

/// Numba `test_get_memory_info`: the context asks the plugin.
pub fn test_get_memory_info(target: Target) -> Result<(), Failed> {
    let (t, _) = with_plugin(target)?;
    let info = t.context()?.get_memory_info()?;
    ensure_eq!(
        info,
        MemoryInfo {
            free: 32,
            total: 64
        }
    );
    Ok(())
}

/// Numba `test_get_ipc_handle`: the context asks the plugin; the pointer value passes through.
pub fn test_get_ipc_handle(target: Target) -> Result<(), Failed> {
    let (t, _) = with_plugin(target)?;
    let ctx = t.context()?;
    let mem = ctx.memalloc(16)?;
    let handle = ctx.get_ipc_handle(&mem)?;
    let emm::contract::IpcMemory::Allocation(raw) = handle.handle() else {
        return Err(format!("the plugin's handle came back as {:?}", handle.handle()).into());
    };
    let text = String::from_utf8_lossy(&raw.0);
    ensure!(text.contains("Dummy IPC handle for alloc 1"), "{text:?}");
    Ok(())
}

/// Numba's `BadVersionEMMPlugin`: the plugin itself declares interface version 2.
#[derive(Debug, Default)]
struct BadVersionEmmPlugin(DeviceOnlyEmmPlugin);

impl DeviceAllocator for BadVersionEmmPlugin {
    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        self.0.memalloc(host, bytes)
    }

    fn initialize(&self, host: &HostLayer) -> Result<(), EmmError> {
        self.0.initialize(host)
    }

    fn get_memory_info(&self, host: &HostLayer) -> Result<MemoryInfo, EmmError> {
        self.0.get_memory_info(host)
    }

    fn get_ipc_handle(
        &self,
        host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<IpcHandle, EmmError> {
        self.0.get_ipc_handle(host, memory)
    }

    fn interface_version(&self) -> u32 {
        2
    }
}

fn version_error(e: &str) -> Result<(), Failed> {
    ensure!(
        e.contains("EMM Plugin interface has version 2 - version 1 required"),
        "{e}"
    );
    Ok(())
}

/// Numba `test_bad_plugin_version`: a plugin of interface version 2 is refused with Numba's
/// message, whether its factory declares the version (refused when the manager is selected) or
/// the plugin itself does, as Numba's `BadVersionEMMPlugin` (refused when the manager is built
/// for a context, which leaves no primary context retained).
pub fn test_bad_plugin_version(target: Target) -> Result<(), Failed> {
    let result = TestCtx::with(target, |b| {
        b.memory_manager(
            FnFactory::new("BadVersionEMMPlugin", |cx| {
                Ok(Box::new(HostOnly::new(cx, DeviceOnlyEmmPlugin::default())))
            })
            .with_interface_version(2),
        )
    });
    match result {
        Err(e) => version_error(&e)?,
        Ok(_) => return Err("a factory of version 2 was accepted".into()),
    }
    let t = TestCtx::with(target, |b| {
        b.memory_manager(FnFactory::new("BadVersionEMMPlugin", |cx| {
            Ok(Box::new(HostOnly::new(cx, BadVersionEmmPlugin::default())))
        }))
    })?;
    match t.context() {
        Err(e) => version_error(&e.to_string())?,
        Ok(_) => return Err("a plugin declaring version 2 was used".into()),
    }
    if let Some(sim) = t.sim() {
        ensure_eq!(
            sim.context_refcount(0.into()),
            0,
            "the refused manager's context was released"
        );
    }
    Ok(())
}
