//! [`SimDriver`]: a deterministic simulated CUDA system, as a small model of CUDA in parts:
//!
//! | file | part of the model |
//! | --- | --- |
//! | `config` | the machine's configuration and address-space layout |
//! | `world` | the machine, its processes, devices, primary contexts, streams, events, modules |
//! | `memory` | device memory: pages, packing, backing bytes, address resolution |
//! | `host` | page-locked and registered host memory |
//! | `ipc` | IPC handles and mappings in other processes |
//! | `pools` | stream-ordered pools, stream order, pool export and import |
//! | `capture` | stream capture, graphs, graph memory, the calls a capture refuses |
//! | `log` | the operations, the call log, scripted faults, the leak report |
//! | `driver` | the `Driver` impl: one logged, faultable call into the model per method |
//!
//! Every rule lives in the model, as a method of the machine (`World`) in the file of its part;
//! the `Driver` impl only names the call, and [`SimDriver`]'s `call` logs it, fires scripted
//! faults, checks initialisation and runs the rule under the machine's one lock.
//!
//! Unsafe code is confined to `memory` (copies into and out of host memory that the caller
//! mapped into the simulated device) and `driver` (the trait's unsafe methods); the
//! [`Driver`](driver_sys::Driver) contract makes the caller vouch for it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use driver_sys::{
    ContextHandle, DeviceOrdinal, DevicePtr, DriverError, ErrorKind, HostPtr, StreamHandle, code,
};

mod async_copies;
mod capture;
mod config;
mod driver;
mod host;
mod ipc;
mod log;
mod memory;
mod pool_space;
mod pools;
mod streams;
mod vmm;
mod world;

pub use config::{DEFAULT_ALIGNMENT, PAGE_SIZE, SMALL_MAX, SimConfig, SimDeviceConfig};
pub use log::{CallRecord, Fault, LeakReport, Op};

use memory::{Accessor, DeviceMem};
use world::{Object, Process, World, context};

thread_local! {
    /// Release calls the simulated driver refused on this thread, in any process.
    static FAILED_RELEASES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Allocations freed on this thread while another process still had them mapped.
    static FREED_WHILE_IMPORTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many release calls (frees, unpins, closes, destroys) any simulated driver refused on
/// the calling thread, scripted faults not counted: the simulator's side of
/// `CudaDriver::failed_releases`. A test harness reads it before and after a test that runs on
/// one thread; in correct use emm makes none.
pub fn failed_releases_on_this_thread() -> u64 {
    FAILED_RELEASES.with(std::cell::Cell::get)
}

/// How many allocations the exporting process freed (`cuMemFree`, `cuMemFreeAsync`, its
/// context's destruction) on the calling thread while another process still had them mapped
/// (`cuIpcOpenMemHandle` not yet closed, `cuMemPoolImportPointer` not yet freed). The driver
/// documents this as undefined behaviour in the importer, so the simulator does not model an
/// outcome for it (its mapping keeps reading the old bytes): it counts it, and a test harness
/// fails a test that does it. Correct use makes none: the importer lets go first.
pub fn frees_while_imported_on_this_thread() -> u64 {
    FREED_WHILE_IMPORTED.with(std::cell::Cell::get)
}

/// A deterministic simulated CUDA system, as seen by one process.
///
/// # Model
///
/// - **Devices** are configured up front ([`SimConfig`]). Each process has a primary context
///   per device with a reference count; devices may or may not be peers.
/// - **Address space and accounting**, as measured on an H200 (driver 580, CUDA 13.0; see
///   `ci/hardware-runs.md`). Device memory is handed out in 2 MiB pages. Allocations of up to
///   1 MiB are packed into shared pages at 512-byte granularity (first fit, lowest address);
///   larger ones get whole 2 MiB-aligned pages of their own. A page is returned as soon as its
///   last allocation is freed. `free` in [`Driver::mem_get_info`](driver_sys::Driver::mem_get_info) is
///   `total - live contexts × context overhead - pages in use × 2 MiB`, so a 1-byte allocation
///   that opens a page costs 2 MiB and one that fits an open page costs nothing, exactly as on
///   the GPU. Device `d`'s addresses start at `0x7000_0000_0000 + d * 2^40`; addresses are
///   unified, so copies find any memory of the process whatever the context.
/// - **Real bytes.** Device allocations have zero-initialised backing bytes; copies move data.
///   `cuMemHostAlloc` returns real, zeroed host memory, and mapped host memory (allocated or
///   registered) is reached from the device at the same address (unified addressing), so a
///   copy to its device address lands in the host bytes.
/// - **Processes and IPC.** [`SimDriver::spawn_process`] gives another process on the same
///   machine. An IPC handle names an allocation; another process opens it at an address of its
///   own and sees the same bytes; opening it again in the same context returns the same address
///   and counts the opens (the driver's documented behaviour), and each close undoes one. Opening
///   in the exporting process, or on a device that is not a peer of the allocation's, fails as
///   on the GPU. The memory lives while
///   any process maps it.
/// - **Stream-ordered pools and their IPC.** Pools, the release threshold and stream order (a
///   freed block is reusable on its stream at once, on others after a synchronisation). A pool
///   created for export exports as a real file descriptor (one end of a pipe, known by its
///   inode), so it can travel over a Unix socket; another process imports it and then imports
///   allocations through it. As measured on the H200: allocations export only once their pool
///   was exported; an imported pointer is reached only from devices the imported pool grants
///   access to.
/// - **Host memory** as measured: `cuMemHostAlloc(0)` succeeds with the null pointer; pinned
///   and registered memory has a device address (the host address) whatever the flags.
/// - **Contexts and unified addressing**, as measured on two H200s: copies and frees reach any
///   device's memory of the process whatever context names them; `cuMemGetAddressRange` finds
///   only memory of the context's own device (`CUDA_ERROR_NOT_FOUND` otherwise).
/// - **Contract checking** with the real driver's codes: zero-byte allocations, unknown or
///   interior pointers, double frees and out-of-range copies give `CUDA_ERROR_INVALID_VALUE`
///   (freeing the null pointer succeeds); a request larger than what is free gives
///   `CUDA_ERROR_OUT_OF_MEMORY`; registering a range twice gives
///   `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, unregistering an unknown one
///   `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
/// - **Primary contexts.** Releasing the last reference destroys the context and everything it
///   owns (device memory, pinned memory, portable too, as measured, streams, events, modules, IPC mappings);
///   `cuDevicePrimaryCtxReset` does so even while references remain. A destroyed context
///   answers `CUDA_ERROR_CONTEXT_IS_DESTROYED` until the next retain re-creates it (with the
///   same handle, as on the GPU); releasing at count zero is `CUDA_ERROR_INVALID_CONTEXT`.
/// - **Observability.** Every call is appended to the process's log ([`SimDriver::calls`]) with
///   its arguments and outcome; [`SimDriver::leak_report`] lists what the process still holds.
/// - **Scripted faults.** [`SimDriver::inject`] makes the Nth call of one operation (or of any
///   operation) fail with a chosen error kind, once.
/// - **A hook before every call**, in loom builds (`--cfg emm_loom`): `SimDriver::set_call_hook`
///   makes every call a model checker's scheduling point. The machine's lock is a plain mutex,
///   which loom does not see; without the hook, a driver call runs in one step with the code
///   before it, and loom never puts another thread's call between them. Other builds have no
///   hook and pay nothing for it.
/// - **Determinism.** The same calls give the same device addresses, handles, errors and log,
///   every run. Host addresses are real heap addresses and are the one exception.
///
/// Shareable across threads (`Arc<SimDriver>` coerces to `Arc<dyn Driver>`); one lock guards
/// the whole machine, so each log has one total order.
pub struct SimDriver {
    world: Arc<Mutex<World>>,
    pid: usize,
    /// Run at the start of every call, before the lock is taken; shared by the processes.
    #[cfg(emm_loom)]
    hook: Arc<std::sync::OnceLock<CallHook>>,
}

/// What `SimDriver::set_call_hook` (loom builds) installs: run with the operation at the
/// start of every driver call, on the calling thread, with no lock of the simulator held.
pub type CallHook = Box<dyn Fn(Op) + Send + Sync>;

impl std::fmt::Debug for SimDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDriver")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// What a single call observed, for the log.
#[derive(Default)]
pub(super) struct Note {
    pub(super) device: Option<DeviceOrdinal>,
    pub(super) ptr: Option<DevicePtr>,
    pub(super) host: Option<HostPtr>,
    pub(super) bytes: Option<usize>,
}

impl SimDriver {
    /// A simulated machine with the given devices, seen by its first process. The driver
    /// starts uninitialised, as libcuda does: call [`Driver::init`](driver_sys::Driver::init) first.
    pub fn new(config: SimConfig) -> SimDriver {
        let n = config.devices.len();
        let devices = config
            .devices
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                if c.pci_bus_id == 0 {
                    c.pci_bus_id = i as i32 + 1;
                }
                assert!(
                    c.total_mem as u64 <= config::POOL_SPACE_OFFSET,
                    "a simulated device has at most {} bytes, got {}",
                    config::POOL_SPACE_OFFSET,
                    c.total_mem
                );
                DeviceMem {
                    config: c,
                    allocs: BTreeMap::new(),
                    pages: BTreeMap::new(),
                    phys_bytes: 0,
                    pool_space: pool_space::PoolSpace::new(
                        DeviceMem::base(i) + config::POOL_SPACE_OFFSET,
                        config::POOL_SPACE_LEN,
                    ),
                }
            })
            .collect();
        let world = World {
            devices,
            stores: BTreeMap::new(),
            processes: vec![Process::new(n)],
            peer_access: config.peer_access,
            pinned_limit: config.pinned_host_limit,
            pinned: 0,
            next_handle: 0,
            pool_exports: BTreeMap::new(),
            phys_exports: BTreeMap::new(),
            phys: BTreeMap::new(),
            quarantine: None,
        };
        SimDriver {
            world: Arc::new(Mutex::new(world)),
            pid: 0,
            #[cfg(emm_loom)]
            hook: Arc::new(std::sync::OnceLock::new()),
        }
    }

    /// Runs `hook` at the start of every driver call of every process of this machine, before
    /// the call takes the machine's lock. Meant for model checking: a loom model's hook
    /// touches one loom atomic, which makes each driver call a point where loom may run
    /// another thread, and makes every two calls dependent, so that loom tries them in both
    /// orders. Set once.
    ///
    /// # Panics
    ///
    /// If a hook is already set: keep one hook that does everything wanted.
    #[cfg(emm_loom)]
    pub fn set_call_hook(&self, hook: CallHook) {
        assert!(
            self.hook.set(hook).is_ok(),
            "SimDriver::set_call_hook: a hook is already set on this machine; set one hook that does everything wanted"
        );
    }

    /// From now on keeps the host blocks `cuMemFreeHost` frees (`cuMemHostAlloc` memory),
    /// filled with a poison byte, instead of giving them back: a host write after the free
    /// lands there and [`freed_host_untouched`](Self::freed_host_untouched) says so. For tests
    /// of races between host-side writes and frees; the blocks are given back when the machine
    /// drops.
    pub fn quarantine_host_frees(&self) {
        self.lock().quarantine.get_or_insert_with(Vec::new);
    }

    /// Whether every block kept by [`quarantine_host_frees`](Self::quarantine_host_frees)
    /// still holds only the poison byte: no write reached it after its free.
    pub fn freed_host_untouched(&self) -> bool {
        let w = self.lock();
        w.quarantine
            .iter()
            .flatten()
            .all(|b| b.all(host::QUARANTINE_BYTE))
    }

    /// Another process on the same simulated machine: it shares the devices and their memory
    /// (for IPC), and has its own contexts, host memory, log and faults. Uninitialised.
    pub fn spawn_process(&self) -> SimDriver {
        let mut w = self.lock();
        let n = w.devices.len();
        w.processes.push(Process::new(n));
        SimDriver {
            world: Arc::clone(&self.world),
            pid: w.processes.len() - 1,
            #[cfg(emm_loom)]
            hook: Arc::clone(&self.hook),
        }
    }

    /// This process's number on the machine (0 for the first).
    pub fn process_id(&self) -> usize {
        self.pid
    }

    fn lock(&self) -> MutexGuard<'_, World> {
        // A panic in a test thread must not hide every later call.
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn with_process<T>(&self, f: impl FnOnce(&Process) -> T) -> T {
        f(&self.lock().processes[self.pid])
    }

    /// Scripts a fault for this process; see [`Fault`].
    pub fn inject(&self, fault: Fault) {
        assert!(fault.nth >= 1, "Fault::nth is 1-based");
        self.lock().processes[self.pid].faults.push((fault, 0));
    }

    /// Removes every scripted fault of this process that has not fired yet.
    pub fn clear_faults(&self) {
        self.lock().processes[self.pid].faults.clear();
    }

    /// Empties this process's call log (counts, `calls`, `ops` start again), for a long-lived
    /// simulator that makes millions of calls, such as a fuzz target's: the log is kept in
    /// full otherwise. The model's state is untouched.
    pub fn clear_calls(&self) {
        self.lock().processes[self.pid].log.clear();
    }

    /// A copy of this process's call log.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.with_process(|p| p.log.clone())
    }

    /// How many calls of `op` this process made (successful or not).
    pub fn count(&self, op: Op) -> usize {
        self.with_process(|p| p.log.iter().filter(|c| c.op == op).count())
    }

    /// How many driver calls this process made in all.
    pub fn total_calls(&self) -> usize {
        self.with_process(|p| p.log.len())
    }

    /// The operations of the log, in order (for ordering assertions).
    pub fn ops(&self) -> Vec<Op> {
        self.with_process(|p| p.log.iter().map(|c| c.op).collect())
    }

    /// This process's live allocations on `dev`: address and requested size, in address order.
    pub fn live_allocations(&self, dev: DeviceOrdinal) -> Vec<(DevicePtr, usize)> {
        let w = self.lock();
        w.devices
            .get(dev.0 as usize)
            .map(|d| {
                d.allocs
                    .iter()
                    .filter(|(_, a)| a.owner == self.pid)
                    .map(|(&b, a)| (DevicePtr(b), a.size))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// This process's primary-context reference count on `dev`.
    pub fn context_refcount(&self, dev: DeviceOrdinal) -> u32 {
        self.with_process(|p| p.contexts.get(dev.0 as usize).map_or(0, |c| c.refcount))
    }

    /// Page-locked host bytes on the whole machine.
    pub fn pinned_bytes(&self) -> usize {
        self.lock().pinned
    }

    /// Frees this process made that the driver itself refused because the pointer was unknown
    /// (never allocated, or freed already); scripted faults are not counted.
    pub fn rejected_frees(&self) -> Vec<CallRecord> {
        self.failed_releases()
            .into_iter()
            .filter(|c| {
                matches!(c.op, Op::MemFree | Op::MemFreeHost | Op::MemHostUnregister)
                    && matches!(
                        c.outcome,
                        Err(ErrorKind::InvalidValue | ErrorKind::HostMemoryNotRegistered)
                    )
            })
            .collect()
    }

    /// Release calls (frees, unpins, closes, destroys) this process made that the driver
    /// refused, scripted faults not counted: what [`CudaDriver::failed_releases`] counts on the
    /// GPU. In correct use emm makes none.
    ///
    /// [`CudaDriver::failed_releases`]: driver_sys
    pub fn failed_releases(&self) -> Vec<CallRecord> {
        self.with_process(|p| {
            p.log
                .iter()
                .filter(|c| !c.injected && c.op.is_release() && c.outcome.is_err())
                .cloned()
                .collect()
        })
    }

    /// What destroying this process's contexts (a release of the last reference, or
    /// `cuDevicePrimaryCtxReset`) took with it while it was still held: memory, mappings,
    /// streams, events, modules, pools. The driver reclaims all of it, so [`leak_report`]
    /// cannot show it; a manager that frees everything before its context goes leaves this
    /// empty.
    ///
    /// [`leak_report`]: Self::leak_report
    pub fn reclaimed_by_destroy(&self) -> LeakReport {
        self.with_process(|p| p.reclaimed.clone())
    }

    /// What this process still holds.
    pub fn leak_report(&self) -> LeakReport {
        let w = self.lock();
        let mut report = w.held(self.pid, None);
        for (i, c) in w.processes[self.pid].contexts.iter().enumerate() {
            if c.refcount > 0 {
                report
                    .retained_contexts
                    .push((DeviceOrdinal(i as u32), c.refcount));
            }
        }
        report
    }

    /// Runs one driver call: checks scripted faults, runs `body`, logs the outcome.
    fn call<T>(
        &self,
        op: Op,
        body: impl FnOnce(&mut World, usize, &mut Note) -> Result<T, u32>,
    ) -> Result<T, DriverError> {
        #[cfg(emm_loom)]
        if let Some(hook) = self.hook.get() {
            hook(op);
        }
        let mut w = self.lock();
        let pid = self.pid;
        let mut note = Note::default();
        let seq = w.processes[pid].log.len() as u64;
        let faulted = Self::take_fault(&mut w.processes[pid], op);
        let result = match faulted {
            Some(kind) => Err(kind.representative_code()),
            None if op != Op::Init && !w.processes[pid].initialized => Err(code::NOT_INITIALIZED),
            None => w
                .check_capture_unsafe(pid, op)
                .and_then(|()| body(&mut w, pid, &mut note)),
        };
        let outcome = result
            .as_ref()
            .map(|_| ())
            .map_err(|&c| ErrorKind::from_code(c));
        if faulted.is_none() && op.is_release() && outcome.is_err() {
            FAILED_RELEASES.with(|n| n.set(n.get() + 1));
        }
        w.processes[pid].log.push(CallRecord {
            seq,
            op,
            device: note.device,
            ptr: note.ptr,
            host: note.host,
            bytes: note.bytes,
            outcome,
            injected: faulted.is_some(),
        });
        drop(w);
        result.map_err(|c| {
            let e = DriverError::from_code(op.call_name(), c);
            if faulted.is_some() {
                e.with_detail("injected by SimDriver")
            } else {
                e
            }
        })
    }

    /// Runs a copy or memset of `bytes` at `ptr` in context `ctx`: logs it, checks the context,
    /// and treats zero bytes as done.
    fn copy_call(
        &self,
        op: Op,
        ctx: ContextHandle,
        ptr: DevicePtr,
        bytes: usize,
        body: impl FnOnce(&mut World, Accessor) -> Result<(), u32>,
    ) -> Result<(), DriverError> {
        self.call(op, move |w: &mut World, pid: usize, note: &mut Note| {
            note.ptr = Some(ptr);
            note.bytes = Some(bytes);
            let device = context(w, pid, ctx, note)?;
            // A synchronous copy or set is issued on the legacy default stream: it waits for
            // the work queued there and on the blocking streams.
            w.settle_legacy(pid, device)?;
            if bytes == 0 {
                Ok(())
            } else {
                body(w, Accessor { pid, device })
            }
        })
    }

    /// Creates a stream, event or module; `valid` says whether the arguments (flags, image) are
    /// acceptable.
    fn create_object(
        &self,
        op: Op,
        ctx: ContextHandle,
        kind: Object,
        valid: bool,
    ) -> Result<u64, DriverError> {
        self.call(op, move |w: &mut World, pid: usize, note: &mut Note| {
            let i = context(w, pid, ctx, note)?;
            if !valid {
                return Err(if kind == Object::Module {
                    code::INVALID_IMAGE
                } else {
                    code::INVALID_VALUE
                });
            }
            let h = w.new_handle();
            w.processes[pid].objects.insert(h, (kind, i));
            Ok(h)
        })
    }

    /// Destroys a stream, event or module of this process.
    fn destroy_object(
        &self,
        op: Op,
        ctx: ContextHandle,
        kind: Object,
        handle: u64,
    ) -> Result<(), DriverError> {
        self.call(op, move |w: &mut World, pid: usize, note: &mut Note| {
            context(w, pid, ctx, note)?;
            let objects = &mut w.processes[pid].objects;
            match objects.get(&handle) {
                Some((k, _)) if *k == kind => {
                    objects.remove(&handle);
                    Ok(())
                }
                _ => Err(code::INVALID_HANDLE),
            }?;
            w.drop_stream_or_event(pid, handle);
            Ok(())
        })
    }

    /// Creates a stream (`flags`, `priority` clamped into the range) with its queue.
    fn create_stream(
        &self,
        op: Op,
        ctx: ContextHandle,
        flags: u32,
        priority: i32,
    ) -> Result<StreamHandle, DriverError> {
        self.call(op, move |w: &mut World, pid: usize, note: &mut Note| {
            let i = context(w, pid, ctx, note)?;
            if flags > driver_sys::stream_flags::NON_BLOCKING {
                return Err(code::INVALID_VALUE);
            }
            let (least, greatest) = w.priority_range();
            let h = w.new_handle();
            w.processes[pid].objects.insert(h, (Object::Stream, i));
            w.add_stream(pid, h, i, flags, priority.clamp(greatest, least));
            Ok(made(StreamHandle::from_raw, h))
        })
    }

    /// Runs every stream's queued work that can run (host functions, copies, event records,
    /// waits whose condition holds), as a GPU would when given time; returns how many pieces
    /// of work still wait (on a value or an event nothing queued will satisfy). Queued work
    /// otherwise runs only at synchronisations: see the model above.
    pub fn run_streams(&self) -> usize {
        let mut w = self.lock();
        w.run_streams(self.pid)
    }

    /// Queues on `stream` a stand-in for the work a recorded program launched there before log
    /// time `at` (nanoseconds): it completes once [`reach_recorded`](Self::reach_recorded)
    /// moves the stream's progress to `at` or past it, and everything queued behind it (an
    /// event a manager records, a free's point of reuse) waits for it. A synchronisation that
    /// waits for it lets it complete (the host waited for the GPU), and so does every
    /// `cuMemFree` and `cuMemUnmap` of the device while such work is queued, as on a GPU, where
    /// they wait for the device's work. For replaying a log with its GPU progress
    /// (`emm::replay`); an error for a context or stream the process does not have.
    pub fn launch_recorded(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        at: u64,
    ) -> Result<(), DriverError> {
        let mut w = self.lock();
        w.launch_recorded(self.pid, &mut Note::default(), ctx, stream, at)
            .map_err(|c| DriverError::from_code("SimDriver::launch_recorded", c))
    }

    /// Moves `stream`'s progress through recorded work to log time `at` (never back): the
    /// stand-ins queued up to `at` complete, and what waited behind them runs.
    pub fn reach_recorded(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        at: u64,
    ) -> Result<(), DriverError> {
        let mut w = self.lock();
        w.reach_recorded(self.pid, &mut Note::default(), ctx, stream, at)
            .map_err(|c| DriverError::from_code("SimDriver::reach_recorded", c))
    }

    /// How many stream queues this process's simulated driver keeps: its created streams not
    /// destroyed, destroyed ones whose queued work has not run yet, and the implicit streams
    /// it has used. A destroyed stream's queue goes once its work has run.
    pub fn stream_queues(&self) -> usize {
        self.lock().processes[self.pid].streams.streams.len()
    }

    fn take_fault(p: &mut Process, op: Op) -> Option<ErrorKind> {
        let mut fired = None;
        for (fault, seen) in p.faults.iter_mut() {
            if fault.op.is_none_or(|o| o == op) {
                *seen += 1;
                if *seen == fault.nth && fired.is_none() {
                    fired = Some(fault.kind);
                }
            }
        }
        p.faults.retain(|(f, seen)| *seen < f.nth);
        fired
    }
}

/// A handle to an object the simulator made. Safe: the simulator looks every handle up in its
/// tables (a made-up one is an error, never a dereference), so its handles vouch for nothing
/// beyond the simulator that made them.
pub(crate) fn made<H>(from_raw: unsafe fn(u64) -> H, raw: u64) -> H {
    // SAFETY: `from_raw`'s contract (a live object of the driver the handle goes to) holds for
    // the simulator's own objects; a handle the simulator made and another driver is given
    // is that caller's breach, as for handles of two real drivers.
    unsafe { from_raw(raw) }
}
