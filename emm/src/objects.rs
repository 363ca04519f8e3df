//! Streams, events and modules: context objects whose destruction is deferred on the
//! context's own queue, which no memory manager touches (Numba's two queues).
//!
//! Streams and events are released when their handle drops. Modules are also tracked by the
//! context, as Numba's `Context.modules` does, so that a context reset unloads them; a module
//! handle that outlives the reset unloads nothing when it drops.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use driver_sys::{DeviceOrdinal, EventHandle, ModuleHandle, StreamHandle};

use crate::memory::pending::{Free, PendingDeallocs};
use crate::sync::{AtomicU64, Mutex, Ordering, lock};

/// A stream (`cuStreamCreate`); destroyed through the context's queue when dropped.
pub struct Stream {
    handle: StreamHandle,
    device: DeviceOrdinal,
    queue: Arc<PendingDeallocs>,
}

/// An event (`cuEventCreate`); destroyed through the context's queue when dropped.
pub struct Event {
    handle: EventHandle,
    device: DeviceOrdinal,
    queue: Arc<PendingDeallocs>,
}

/// A loaded module (`cuModuleLoadData`); unloaded through the context's queue when dropped or
/// when the context is reset.
pub struct Module {
    handle: ModuleHandle,
    device: DeviceOrdinal,
    registry: Arc<ModuleRegistry>,
    generation: u64,
}

macro_rules! context_object {
    ($ty:ident, $handle:ty, $free:ident, $what:literal) => {
        impl $ty {
            pub(crate) fn new(
                handle: $handle,
                device: DeviceOrdinal,
                queue: Arc<PendingDeallocs>,
            ) -> $ty {
                $ty {
                    handle,
                    device,
                    queue,
                }
            }

            #[doc = concat!("The driver's ", $what, " handle.")]
            pub fn handle(&self) -> $handle {
                self.handle
            }

            /// The device.
            pub fn device(&self) -> DeviceOrdinal {
                self.device
            }
        }

        impl Drop for $ty {
            fn drop(&mut self) {
                self.queue.push_from_drop(Free::$free(self.handle));
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($ty))
                    .field("handle", &self.handle)
                    .field("device", &self.device)
                    .finish()
            }
        }
    };
}

context_object!(Stream, StreamHandle, Stream, "stream");
context_object!(Event, EventHandle, Event, "event");

/// The modules a context has loaded (Numba's `Context.modules`).
#[derive(Debug)]
pub(crate) struct ModuleRegistry {
    loaded: Mutex<BTreeSet<ModuleHandle>>,
    generation: AtomicU64,
    queue: Arc<PendingDeallocs>,
}

impl ModuleRegistry {
    pub(crate) fn new(queue: Arc<PendingDeallocs>) -> ModuleRegistry {
        ModuleRegistry {
            loaded: Mutex::new(BTreeSet::new()),
            generation: AtomicU64::new(0),
            queue,
        }
    }

    pub(crate) fn register(
        self: &Arc<Self>,
        handle: ModuleHandle,
        device: DeviceOrdinal,
    ) -> Module {
        let mut loaded = lock(&self.loaded);
        loaded.insert(handle);
        Module {
            handle,
            device,
            registry: Arc::clone(self),
            generation: self.generation.load(Ordering::Acquire),
        }
    }

    /// Queues an unload for every loaded module (Numba's `modules.clear()`).
    pub(crate) fn clear(&self) {
        let mut loaded = lock(&self.loaded);
        self.generation.fetch_add(1, Ordering::AcqRel);
        let all = std::mem::take(&mut *loaded);
        self.queue
            .push_all_without_flush(all.into_iter().map(Free::Module));
    }

    pub(crate) fn len(&self) -> usize {
        lock(&self.loaded).len()
    }

    fn release(&self, handle: ModuleHandle, generation: u64) {
        let flush = {
            let mut loaded = lock(&self.loaded);
            if self.generation.load(Ordering::Acquire) != generation || !loaded.remove(&handle) {
                return;
            }
            self.queue.push_all_without_flush([Free::Module(handle)])
        };
        if flush {
            self.queue.apply_thresholds_from_drop();
        }
    }
}

impl Module {
    /// The driver's module handle.
    pub fn handle(&self) -> ModuleHandle {
        self.handle
    }

    /// The device.
    pub fn device(&self) -> DeviceOrdinal {
        self.device
    }

    /// Whether the module is still loaded (false after a context reset unloaded it).
    pub fn is_loaded(&self) -> bool {
        self.registry.generation.load(Ordering::Acquire) == self.generation
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        self.registry.release(self.handle, self.generation);
    }
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module")
            .field("handle", &self.handle)
            .field("device", &self.device)
            .field("loaded", &self.is_loaded())
            .finish()
    }
}
