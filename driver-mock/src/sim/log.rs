//! What the simulator lets a test observe and script: the operations ([`Op`]), the call log
//! ([`CallRecord`]), scripted faults ([`Fault`]) and the leak report ([`LeakReport`]).

use std::fmt;

use driver_sys::{DeviceOrdinal, DevicePtr, ErrorKind, HostPtr, PhysHandle};

/// The table's callback that defines [`Op`]: one variant per CUDA operation of
/// `driver_sys::driver_calls!`, with its CUDA name and whether it gives something back.
macro_rules! define_ops {
    (ops [$($op:ident = $cu:literal $($release:ident)?,)*] methods [$($methods:tt)*]) => {
        /// A driver operation, as logged and as named by [`Fault`]. Several `Driver` methods
        /// may make one (`cuMemPoolCreate` makes pools of three kinds).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Op {
            $(
                #[doc = concat!("`", $cu, "`.")]
                $op,
            )*
        }

        impl Op {
            /// Every operation, in the table's order (for fault sweeps).
            pub const ALL: [Op; [$(stringify!($op)),*].len()] = [$(Op::$op),*];

            /// Whether the call gives something back to the driver: a free, an unpin, an IPC
            /// close, a destroy, an unmap or an unload.
            pub fn is_release(self) -> bool {
                match self {
                    $(Op::$op => driver_sys::__is_release!($($release)?),)*
                }
            }

            /// The CUDA driver call this operation stands for.
            pub fn call_name(self) -> &'static str {
                match self {
                    $(Op::$op => $cu,)*
                }
            }
        }
    };
}

driver_sys::driver_calls!(define_ops);

/// One entry of the call log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRecord {
    /// Position in this process's log, from 0.
    pub seq: u64,
    /// The operation.
    pub op: Op,
    /// The device the call concerned, where it names one (directly or through a context).
    pub device: Option<DeviceOrdinal>,
    /// The device pointer argument or result, where there is one.
    pub ptr: Option<DevicePtr>,
    /// The host pointer argument or result, where there is one.
    pub host: Option<HostPtr>,
    /// The byte count argument, where there is one.
    pub bytes: Option<usize>,
    /// `Ok(())`, or the kind of error returned.
    pub outcome: Result<(), ErrorKind>,
    /// Whether the error was scripted with [`SimDriver::inject`](crate::SimDriver::inject) (the call did nothing).
    pub injected: bool,
}

/// A scripted failure: the `nth` call (1-based, counted from when it is injected) of `op`, or of
/// any operation when `op` is `None`, fails with `kind` instead of running. It fires once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Which operation to count; `None` counts every call.
    pub op: Option<Op>,
    /// Which call fails, 1-based.
    pub nth: u64,
    /// The error returned.
    pub kind: ErrorKind,
}

impl Fault {
    /// The `nth` call of `op` fails with `kind`.
    pub fn nth(op: Op, nth: u64, kind: ErrorKind) -> Fault {
        Fault {
            op: Some(op),
            nth,
            kind,
        }
    }

    /// The `nth` driver call of any operation fails with `kind`.
    pub fn nth_call(nth: u64, kind: ErrorKind) -> Fault {
        Fault {
            op: None,
            nth,
            kind,
        }
    }
}

/// What one simulated process still holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeakReport {
    /// Live device allocations (`cuMemAlloc`, and `cuMemAllocManaged`, which `cuMemFree` frees
    /// too): device, address, requested size.
    pub allocations: Vec<(DeviceOrdinal, DevicePtr, usize)>,
    /// Live `cuMemHostAlloc` allocations: address, size.
    pub host_allocations: Vec<(HostPtr, usize)>,
    /// Live `cuMemHostRegister` registrations: address, size.
    pub host_registrations: Vec<(HostPtr, usize)>,
    /// Open IPC mappings: device, mapped address, size.
    pub ipc_mappings: Vec<(DeviceOrdinal, DevicePtr, usize)>,
    /// Streams, events and modules not destroyed: how many of each.
    pub streams: usize,
    /// See `streams`.
    pub events: usize,
    /// See `streams`.
    pub modules: usize,
    /// Stream-ordered pools created or imported and not destroyed (default pools excluded).
    pub pools: usize,
    /// Primary contexts with a non-zero reference count: device, count.
    pub retained_contexts: Vec<(DeviceOrdinal, u32)>,
    /// Physical allocations (`cuMemCreate`) not released, or released and still mapped:
    /// device, handle, size.
    pub physical: Vec<(DeviceOrdinal, PhysHandle, usize)>,
    /// Address reservations (`cuMemAddressReserve`) not freed: address, size.
    pub reservations: Vec<(DevicePtr, usize)>,
}

impl LeakReport {
    /// Adds what `other` lists to this report.
    pub fn absorb(&mut self, other: LeakReport) {
        self.allocations.extend(other.allocations);
        self.host_allocations.extend(other.host_allocations);
        self.host_registrations.extend(other.host_registrations);
        self.ipc_mappings.extend(other.ipc_mappings);
        self.streams += other.streams;
        self.events += other.events;
        self.modules += other.modules;
        self.pools += other.pools;
        self.retained_contexts.extend(other.retained_contexts);
        self.physical.extend(other.physical);
        self.reservations.extend(other.reservations);
    }

    /// Whether no memory (device, host, registered or mapped) is held.
    pub fn no_memory_leaked(&self) -> bool {
        self.allocations.is_empty()
            && self.host_allocations.is_empty()
            && self.host_registrations.is_empty()
            && self.ipc_mappings.is_empty()
            && self.physical.is_empty()
    }

    /// How many objects it lists (allocations, registrations, mappings, physical
    /// allocations, reservations, streams, events, modules, pools), context references aside.
    pub fn objects(&self) -> usize {
        self.allocations.len()
            + self.host_allocations.len()
            + self.host_registrations.len()
            + self.ipc_mappings.len()
            + self.physical.len()
            + self.reservations.len()
            + self.streams
            + self.events
            + self.modules
            + self.pools
    }

    /// Whether nothing at all is held, contexts included.
    pub fn is_clean(&self) -> bool {
        self.no_memory_leaked()
            && self.streams == 0
            && self.events == 0
            && self.modules == 0
            && self.pools == 0
            && self.retained_contexts.is_empty()
            && self.reservations.is_empty()
    }
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clean() {
            return write!(f, "no leaks");
        }
        for (dev, ptr, size) in &self.allocations {
            writeln!(f, "device {dev}: {size} bytes at {ptr} still allocated")?;
        }
        for (ptr, size) in &self.host_allocations {
            writeln!(
                f,
                "pinned host memory: {size} bytes at {ptr} still allocated"
            )?;
        }
        for (ptr, size) in &self.host_registrations {
            writeln!(f, "host range: {size} bytes at {ptr} still registered")?;
        }
        for (dev, ptr, size) in &self.ipc_mappings {
            writeln!(
                f,
                "device {dev}: IPC mapping of {size} bytes at {ptr} still open"
            )?;
        }
        for (what, n) in [
            ("stream", self.streams),
            ("event", self.events),
            ("module", self.modules),
            ("stream-ordered pool", self.pools),
        ] {
            if n > 0 {
                writeln!(f, "{n} {what}(s) not destroyed")?;
            }
        }
        for (dev, count) in &self.retained_contexts {
            writeln!(f, "device {dev}: primary context retained {count} time(s)")?;
        }
        for (dev, handle, size) in &self.physical {
            writeln!(
                f,
                "device {dev}: physical allocation {handle} of {size} bytes not released or still mapped"
            )?;
        }
        for (ptr, size) in &self.reservations {
            writeln!(f, "address range of {size} bytes at {ptr} still reserved")?;
        }
        Ok(())
    }
}
