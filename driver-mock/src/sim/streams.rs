//! Streams as ordered queues: asynchronous copies and sets, host functions, event records and
//! waits, stream memory operations (`cuStreamWaitValue32`, `cuStreamWriteValue32`).
//!
//! Queued work runs only when something lets it: a synchronisation (`cuStreamSynchronize`,
//! `cuEventSynchronize`, a synchronous copy, which waits for the legacy default stream), or the
//! test ([`SimDriver::run_streams`](super::SimDriver::run_streams)). `cuStreamQuery` and
//! `cuEventQuery` run nothing: they say whether the work has run. This is the most adversarial
//! schedule a GPU could pick (nothing completes early), and every interleaving a test wants can
//! be made by letting streams run at chosen points.
//!
//! The legacy default stream (handles 0 and `CU_STREAM_LEGACY`) synchronises with blocking
//! streams: work queued on it waits for the work already queued on every blocking stream of its
//! context, and work queued on a blocking stream waits for the work already queued on the
//! legacy stream. Non-blocking streams (`CU_STREAM_NON_BLOCKING`) and the per-thread default
//! stream do not. The per-thread default stream is one stream per process here (the simulator
//! does not tell threads apart; a modelling choice).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use driver_sys::{ContextHandle, DevicePtr, EventHandle, HostFn, StreamHandle, code, wait_value};

use super::Note;
use super::memory::Accessor;
use super::world::{Object, World, context};

/// The key of the legacy default stream of a device in [`Streams`].
const LEGACY: u64 = 0;
/// The key of the per-thread default stream.
const PER_THREAD: u64 = 2;

/// A host function waiting in a queue.
pub(super) struct Pending(HostFn);

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HostFn")
    }
}

/// Where an asynchronous host-to-device copy takes its bytes: pageable memory is copied at
/// once by the driver (so the caller may reuse it), page-locked memory when the copy runs.
#[derive(Debug)]
pub(super) enum Source {
    Snapshot(Vec<u8>),
    Pinned(usize),
}

/// One piece of queued work.
#[derive(Debug)]
pub(super) enum Work {
    HtoD {
        dst: u64,
        src: Source,
        len: usize,
    },
    DtoH {
        dst: usize,
        src: u64,
        len: usize,
    },
    DtoD {
        dst: u64,
        src: u64,
        len: usize,
    },
    Memset {
        dst: u64,
        value: u8,
        len: usize,
    },
    Host(Pending),
    Record {
        event: u64,
        serial: u64,
    },
    WaitEvent {
        event: u64,
        serial: u64,
    },
    WaitStream {
        key: u64,
        upto: u64,
    },
    WaitValue {
        addr: u64,
        value: u32,
        flags: u32,
    },
    WriteValue {
        addr: u64,
        value: u32,
    },
    /// Stand-in for the kernels a recorded program launched on the stream before log time
    /// `at` (nanoseconds): done once the stream's progress ([`SimStream::reached`]) passes
    /// `at`, or a synchronisation waits for it ([`SimDriver::launch_recorded`]).
    ///
    /// [`SimDriver::launch_recorded`]: super::SimDriver::launch_recorded
    Recorded {
        at: u64,
    },
    /// A `cuMemFreeAsync` reached in stream order: the pool block it freed (free `id`)
    /// becomes reusable on every stream (the driver's opportunistic reuse; its inserted
    /// dependencies are not modelled, so other streams wait until the free has run).
    PoolFreed {
        id: u64,
    },
    /// A `cuMemFreeAsync` of `cuMemAlloc` memory reached in stream order: the allocation at
    /// `ptr` goes, and its memory is free for every allocation.
    AllocFreed {
        ptr: u64,
    },
}

/// One stream's queue.
#[derive(Debug, Default)]
pub(super) struct SimStream {
    pub(super) device: usize,
    /// Whether it synchronises with the legacy default stream.
    pub(super) blocking: bool,
    pub(super) priority: i32,
    /// The capture it records into (`capture.rs`).
    pub(super) capture: Option<u64>,
    queue: VecDeque<(u64, Work)>,
    /// Destroyed while work was queued: the queue goes once that work has run.
    destroyed: bool,
    /// Work items queued so far, and run so far (serials count from 1).
    queued: u64,
    done: u64,
    /// How far the GPU got through the recorded program's work on this stream (log
    /// nanoseconds): [`Work::Recorded`] items up to it can run.
    reached: u64,
    /// [`Work::Recorded`] items queued and not run.
    recorded: usize,
}

/// One event's state.
#[derive(Debug, Default)]
pub(super) struct SimEvent {
    pub(super) timing: bool,
    /// The serial of its last record, and the records queued but not run yet. Records
    /// complete in any order (an event recorded on a held stream, then on an idle one): a
    /// wait names the record it waits for, as the driver's does.
    pub(super) recorded: u64,
    pub(super) pending: BTreeSet<u64>,
    /// The simulated time its last completed record ran at.
    at: Option<f64>,
    /// The capture its last record was made in, and the stream key recorded on.
    pub(super) captured: Option<(u64, u64)>,
    /// Its last record was made in a capture that ended: the record is the graph's, and
    /// queries are refused until the event is recorded again.
    pub(super) in_graph: bool,
}

impl SimEvent {
    /// Whether record `serial` ran (0, never recorded, always has).
    fn is_done(&self, serial: u64) -> bool {
        !self.pending.contains(&serial)
    }
}

/// A process's streams (by handle; the legacy default stream of device `d` is `LEGACY + d`
/// scaled apart from real handles, see [`key`]) and events.
#[derive(Debug, Default)]
pub(super) struct Streams {
    pub(super) streams: BTreeMap<u64, SimStream>,
    pub(super) events: BTreeMap<u64, SimEvent>,
    /// The simulated clock: each piece of work that runs takes a microsecond.
    clock: f64,
}

/// The queue key of `stream` in a context of `device`.
fn key(stream: StreamHandle, device: usize) -> u64 {
    match stream.raw() {
        0 | 1 => LEGACY + ((device as u64) << 2),
        2 => PER_THREAD + ((device as u64) << 2),
        h => h,
    }
}

/// Whether `stream` names one of the implicit streams (not a created one).
fn implicit(stream: StreamHandle) -> bool {
    stream.raw() <= 2
}

/// Whether the wait condition holds.
fn condition(word: u32, value: u32, flags: u32) -> bool {
    match flags {
        wait_value::GEQ => (word.wrapping_sub(value) as i32) >= 0,
        wait_value::EQ => word == value,
        wait_value::AND => word & value != 0,
        _ => !(word | value) != 0,
    }
}

impl World {
    /// The queue for `stream` in context `ctx` of process `pid`, made on first use for the
    /// implicit streams; `CUDA_ERROR_INVALID_HANDLE` for a handle that is no stream of it.
    pub(super) fn stream_key(
        &mut self,
        pid: usize,
        device: usize,
        stream: StreamHandle,
    ) -> Result<u64, u32> {
        let k = key(stream, device);
        let p = &mut self.processes[pid];
        if implicit(stream) {
            p.streams.streams.entry(k).or_insert_with(|| SimStream {
                device,
                blocking: stream.raw() != 2,
                ..SimStream::default()
            });
            return Ok(k);
        }
        match p.objects.get(&stream.raw()) {
            Some((Object::Stream, _)) => Ok(k),
            _ => Err(code::INVALID_HANDLE),
        }
    }

    /// Registers a created stream's queue.
    pub(super) fn add_stream(
        &mut self,
        pid: usize,
        handle: u64,
        device: usize,
        flags: u32,
        priority: i32,
    ) {
        self.processes[pid].streams.streams.insert(
            handle,
            SimStream {
                device,
                blocking: flags & driver_sys::stream_flags::NON_BLOCKING == 0,
                priority,
                ..SimStream::default()
            },
        );
    }

    /// Registers a created event.
    pub(super) fn add_event(&mut self, pid: usize, handle: u64, flags: u32) {
        self.processes[pid].streams.events.insert(
            handle,
            SimEvent {
                timing: flags & driver_sys::event_flags::DISABLE_TIMING == 0,
                ..SimEvent::default()
            },
        );
    }

    /// Forgets a destroyed stream or event. A destroyed stream's queued work still runs (the
    /// driver finishes it); it is left in place until it has.
    pub(super) fn drop_stream_or_event(&mut self, pid: usize, handle: u64) {
        // A stream destroyed while capturing ends its capture (its graph is never made).
        self.processes[pid]
            .captures
            .retain(|_, c| c.origin != handle);
        let s = &mut self.processes[pid].streams;
        s.events.remove(&handle);
        match s.streams.get_mut(&handle) {
            Some(q) if q.queue.is_empty() => {
                s.streams.remove(&handle);
            }
            Some(q) => q.destroyed = true,
            None => {}
        }
    }

    /// Drops every queue and event of process `pid` on `device` (its context is destroyed).
    pub(super) fn drop_streams_of(&mut self, pid: usize, device: usize) {
        let s = &mut self.processes[pid].streams;
        s.streams.retain(|_, q| q.device != device);
        self.drop_graphs_of(pid, device);
    }

    /// Queues `work` on `stream` with the legacy stream's implicit waits.
    pub(super) fn enqueue(
        &mut self,
        pid: usize,
        device: usize,
        stream: StreamHandle,
        work: Work,
    ) -> Result<(), u32> {
        let k = self.stream_key(pid, device, stream)?;
        let legacy = key(StreamHandle::NULL, device);
        let Some(work) = self.capture_work(pid, device, k, k == legacy, work)? else {
            return Ok(());
        };
        let s = &self.processes[pid].streams.streams;
        let mut waits = Vec::new();
        if k == legacy {
            for (&other, q) in s.iter() {
                if other != legacy && q.device == device && q.blocking && q.done < q.queued {
                    waits.push(Work::WaitStream {
                        key: other,
                        upto: q.queued,
                    });
                }
            }
        } else if s[&k].blocking
            && let Some(q) = s.get(&legacy)
            && q.done < q.queued
        {
            waits.push(Work::WaitStream {
                key: legacy,
                upto: q.queued,
            });
        }
        let q = self.processes[pid]
            .streams
            .streams
            .get_mut(&k)
            .expect("made above");
        for w in waits.into_iter().chain(std::iter::once(work)) {
            q.queued += 1;
            q.queue.push_back((q.queued, w));
        }
        Ok(())
    }

    /// Whether the first piece of work on queue `k` can run now.
    fn runnable(&self, pid: usize, k: u64) -> bool {
        let s = &self.processes[pid].streams;
        let Some((_, w)) = s.streams.get(&k).and_then(|q| q.queue.front()) else {
            return false;
        };
        let device = s.streams[&k].device;
        match w {
            Work::WaitEvent { event, serial } => {
                s.events.get(event).is_none_or(|e| e.is_done(*serial))
            }
            Work::WaitStream { key, upto } => s.streams.get(key).is_none_or(|q| q.done >= *upto),
            Work::Recorded { at } => *at <= s.streams[&k].reached,
            Work::WaitValue { addr, value, flags } => {
                let mut word = [0u8; 4];
                // SAFETY: the caller of `cuStreamWaitValue32` keeps the word live (the driver
                // contract); reading it races only with the host's own writes of a flag, which
                // is what the operation is for.
                let read = unsafe { self.read(Accessor { pid, device }, *addr, &mut word) };
                read.is_ok() && condition(u32::from_le_bytes(word), *value, *flags)
            }
            _ => true,
        }
    }

    /// Runs the first piece of work on queue `k` (which [`runnable`](Self::runnable) allowed).
    fn run_one(&mut self, pid: usize, k: u64) -> Result<(), u32> {
        let s = &mut self.processes[pid].streams;
        let q = s.streams.get_mut(&k).expect("runnable");
        let device = q.device;
        let (serial, work) = q.queue.pop_front().expect("runnable");
        q.done = serial;
        if matches!(work, Work::Recorded { .. }) {
            q.recorded -= 1;
        }
        if q.destroyed && q.queue.is_empty() {
            // A destroyed stream's last work: nothing can queue more, and a wait on it finds
            // no queue, which counts as drained.
            s.streams.remove(&k);
        }
        s.clock += 0.001;
        let clock = s.clock;
        let by = Accessor { pid, device };
        // SAFETY (every copy below): the asynchronous calls' contracts keep both ranges live and
        // untouched by others until the work completes, which is now.
        match work {
            Work::HtoD { dst, src, len } => {
                let bytes = match src {
                    Source::Snapshot(b) => b,
                    Source::Pinned(at) => {
                        let mut b = vec![0u8; len];
                        // SAFETY: see above: page-locked memory the caller keeps live.
                        unsafe {
                            std::ptr::copy(
                                std::ptr::with_exposed_provenance::<u8>(at),
                                b.as_mut_ptr(),
                                len,
                            );
                        }
                        b
                    }
                };
                // SAFETY: see above.
                unsafe { self.write(by, dst, &bytes) }?;
            }
            Work::DtoH { dst, src, len } => {
                let mut b = vec![0u8; len];
                // SAFETY: see above.
                unsafe { self.read(by, src, &mut b) }?;
                // SAFETY: see above: the caller's destination, live and untouched until now.
                unsafe {
                    std::ptr::copy(
                        b.as_ptr(),
                        std::ptr::with_exposed_provenance_mut::<u8>(dst),
                        len,
                    );
                }
            }
            Work::DtoD { dst, src, len } => {
                let mut b = vec![0u8; len];
                // SAFETY: see above.
                unsafe {
                    self.read(by, src, &mut b)?;
                    self.write(by, dst, &b)?;
                }
            }
            Work::Memset { dst, value, len } => {
                // SAFETY: see above.
                unsafe { self.write(by, dst, &vec![value; len]) }?;
            }
            Work::Host(Pending(f)) => f(),
            Work::Record { event, serial } => {
                if let Some(e) = self.processes[pid].streams.events.get_mut(&event) {
                    e.pending.remove(&serial);
                    if serial == e.recorded {
                        e.at = Some(clock);
                    }
                }
            }
            Work::WriteValue { addr, value } => {
                // SAFETY: see above.
                unsafe { self.write(by, addr, &value.to_le_bytes()) }?;
            }
            Work::PoolFreed { id } => {
                for pool in self.processes[pid].pools.values_mut() {
                    for b in pool.free.iter_mut().filter(|b| b.id == id) {
                        b.ready = true;
                    }
                }
            }
            Work::AllocFreed { ptr } => self.run_queued_device_free(pid, ptr),
            Work::WaitEvent { .. }
            | Work::WaitStream { .. }
            | Work::WaitValue { .. }
            | Work::Recorded { .. } => {}
        }
        Ok(())
    }

    /// Runs queued work of process `pid` until `done` says to stop or nothing can run. Returns
    /// whether `done` held at the end.
    pub(super) fn run_until(&mut self, pid: usize, done: impl Fn(&World) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            let keys: Vec<u64> = self.processes[pid]
                .streams
                .streams
                .keys()
                .copied()
                .collect();
            let mut progressed = false;
            for k in keys {
                while self.runnable(pid, k) {
                    // A copy that fails (memory freed under queued work) is dropped: the GPU
                    // would report it at the next synchronisation as a sticky error; the
                    // simulator leaves that to the leak and double-free checks.
                    let _ = self.run_one(pid, k);
                    progressed = true;
                }
            }
            if !progressed {
                return done(self);
            }
        }
    }

    /// Whether queue `k` of process `pid` is empty.
    pub(super) fn drained(&self, pid: usize, k: u64) -> bool {
        self.processes[pid]
            .streams
            .streams
            .get(&k)
            .is_none_or(|q| q.queue.is_empty())
    }

    /// Runs everything that can run; returns how much work still waits (on values or events
    /// that nothing queued will satisfy).
    pub(super) fn run_streams(&mut self, pid: usize) -> usize {
        self.run_until(pid, |_| false);
        self.processes[pid]
            .streams
            .streams
            .values()
            .map(|q| q.queue.len())
            .sum()
    }

    /// What a synchronous call on the legacy stream of `device` waits for: the legacy stream
    /// and every blocking stream of the context. `CUDA_ERROR_ILLEGAL_STATE` where that work
    /// waits on something nothing will provide (the GPU would hang).
    pub(super) fn settle_legacy(&mut self, pid: usize, device: usize) -> Result<(), u32> {
        self.drain_device(pid, device, true)
    }

    /// Runs work until every stream of `device` (the blocking ones alone, with `blocking`) is
    /// drained; `CUDA_ERROR_ILLEGAL_STATE` where that work waits on something nothing will
    /// provide.
    fn drain_device(&mut self, pid: usize, device: usize, blocking: bool) -> Result<(), u32> {
        let keys: Vec<u64> = self.processes[pid]
            .streams
            .streams
            .iter()
            .filter(|(_, q)| q.device == device && (q.blocking || !blocking))
            .map(|(&k, _)| k)
            .collect();
        self.wait_until(pid, |w| keys.iter().all(|&k| w.drained(pid, k)))
    }

    /// Runs work until every stream of `device` is drained (`cuCtxSynchronize`'s wait);
    /// `CUDA_ERROR_ILLEGAL_STATE` where that work waits on something nothing will provide.
    pub(super) fn drain_all(&mut self, pid: usize, device: usize) -> Result<(), u32> {
        self.drain_device(pid, device, false)
    }

    /// Runs work until `stream` of `ctx` is drained (`cuStreamSynchronize`'s wait).
    pub(super) fn drain_stream(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        self.refuse_if_captured(pid, k)?;
        if k == key(StreamHandle::NULL, device) {
            return self.settle_legacy(pid, device);
        }
        self.wait_until(pid, |w| w.drained(pid, k))
    }

    /// `cuStreamGetPriority`: the implicit streams have priority 0.
    pub(super) fn stream_priority(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<i32, u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        Ok(self.processes[pid].streams.streams[&k].priority)
    }

    /// `cuStreamQuery`: runs nothing.
    pub(super) fn stream_query(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<bool, u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        self.refuse_if_captured(pid, k)?;
        Ok(self.drained(pid, k))
    }

    fn event_mut(&mut self, pid: usize, event: EventHandle) -> Result<&mut SimEvent, u32> {
        self.processes[pid]
            .streams
            .events
            .get_mut(&event.raw())
            .ok_or(code::INVALID_HANDLE)
    }

    /// `cuEventRecord`.
    pub(super) fn event_record(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        self.event_mut(pid, event)?;
        if self.capture_event_record(pid, k, event.raw()) {
            let work = Work::Record {
                event: event.raw(),
                serial: 0,
            };
            return self.enqueue(pid, device, stream, work);
        }
        let e = self.event_mut(pid, event)?;
        e.captured = None;
        e.in_graph = false;
        e.recorded += 1;
        let serial = e.recorded;
        e.pending.insert(serial);
        self.enqueue(
            pid,
            device,
            stream,
            Work::Record {
                event: event.raw(),
                serial,
            },
        )
    }

    /// `cuStreamWaitEvent`.
    pub(super) fn stream_wait_event(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        let serial = self.event_mut(pid, event)?.recorded;
        if !self.processes[pid].captures.is_empty() {
            let k = self.stream_key(pid, device, stream)?;
            self.capture_event_wait(pid, k, event.raw());
        }
        self.enqueue(
            pid,
            device,
            stream,
            Work::WaitEvent {
                event: event.raw(),
                serial,
            },
        )
    }

    /// `cuEventQuery`: runs nothing; an event never recorded is complete.
    pub(super) fn event_query(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<bool, u32> {
        context(self, pid, ctx, note)?;
        self.event_mut(pid, event)?;
        self.refuse_captured_event(pid, event.raw())?;
        let e = self.event_mut(pid, event)?;
        Ok(e.is_done(e.recorded))
    }

    /// `cuEventSynchronize`.
    pub(super) fn event_synchronize(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        self.event_mut(pid, event)?;
        self.refuse_captured_event(pid, event.raw())?;
        let target = self.event_mut(pid, event)?.recorded;
        let h = event.raw();
        self.wait_until(pid, |w| {
            w.processes[pid]
                .streams
                .events
                .get(&h)
                .is_none_or(|e| e.is_done(target))
        })
    }

    /// `cuEventElapsedTime`: both events recorded and complete, both timing events.
    #[allow(clippy::too_many_arguments)] // the driver call's arguments, one for one
    pub(super) fn event_elapsed_time(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, u32> {
        context(self, pid, ctx, note)?;
        let mut at = [0f64; 2];
        for (i, ev) in [start, end].into_iter().enumerate() {
            let e = self.event_mut(pid, ev)?;
            if !e.timing || e.recorded == 0 {
                return Err(code::INVALID_HANDLE);
            }
            if !e.is_done(e.recorded) {
                return Err(code::NOT_READY);
            }
            at[i] = e.at.expect("completed");
        }
        Ok(((at[1] - at[0]) as f32).max(0.0))
    }

    /// `cuLaunchHostFunc`.
    pub(super) fn launch_host_func(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
        f: HostFn,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        self.enqueue(pid, device, stream, Work::Host(Pending(f)))
    }

    /// `cuStreamWaitValue32`: `addr` must be memory of the context (device or mapped host).
    #[allow(clippy::too_many_arguments)] // the driver call's arguments, one for one
    pub(super) fn stream_wait_value32(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        flags: u32,
    ) -> Result<(), u32> {
        let device = self.word(pid, note, ctx, addr)?;
        if flags > wait_value::NOR {
            return Err(code::INVALID_VALUE);
        }
        self.enqueue(
            pid,
            device,
            stream,
            Work::WaitValue {
                addr: addr.0,
                value,
                flags,
            },
        )
    }

    /// `cuStreamWriteValue32`.
    pub(super) fn stream_write_value32(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<(), u32> {
        let device = self.word(pid, note, ctx, addr)?;
        self.enqueue(
            pid,
            device,
            stream,
            Work::WriteValue {
                addr: addr.0,
                value,
            },
        )
    }

    /// The checks of a stream memory operation on the 32-bit word at `addr`: the context, and
    /// the word lies in memory of it.
    fn word(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        addr: DevicePtr,
    ) -> Result<usize, u32> {
        Ok(self
            .async_range(pid, note, ctx, addr, 4)?
            .expect("four bytes"))
    }

    /// Runs work until `done` holds; `CUDA_ERROR_ILLEGAL_STATE` where it never can (the GPU
    /// would hang).
    pub(super) fn wait_until(
        &mut self,
        pid: usize,
        done: impl Fn(&World) -> bool,
    ) -> Result<(), u32> {
        if self.run_until(pid, &done) {
            return Ok(());
        }
        // The host waits for the GPU: the recorded program's work queued so far completes.
        if self.pass_recorded(pid, None) && self.run_until(pid, &done) {
            return Ok(());
        }
        Err(code::ILLEGAL_STATE)
    }

    /// Lets every [`Work::Recorded`] item queued so far on process `pid`'s streams (those of
    /// `device` alone, where given) run: a synchronisation waited for the GPU. Returns whether
    /// any was waiting.
    pub(super) fn pass_recorded(&mut self, pid: usize, device: Option<usize>) -> bool {
        let mut any = false;
        for q in self.processes[pid].streams.streams.values_mut() {
            if q.recorded == 0 || device.is_some_and(|d| d != q.device) {
                continue;
            }
            any = true;
            let latest = q.queue.iter().filter_map(|(_, w)| match w {
                Work::Recorded { at } => Some(*at),
                _ => None,
            });
            q.reached = q.reached.max(latest.max().unwrap_or(0));
        }
        any
    }

    /// Where a recorded program's work is queued on `device` (the replay of a log with its
    /// GPU progress): the GPU finishes it before a call that waits for the whole device
    /// returns, as `cuMemFree` and `cuMemUnmap` do on a GPU. Elsewhere nothing runs.
    pub(super) fn settle_recorded(&mut self, pid: usize, device: usize) -> Result<(), u32> {
        if !self.pass_recorded(pid, Some(device)) {
            return Ok(());
        }
        self.drain_device(pid, device, false)
    }

    /// Queues a [`Work::Recorded`] item at log time `at` on `stream`.
    pub(super) fn launch_recorded(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
        at: u64,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        // A replay does not capture: a captured stream's work would be the graph's.
        if self.processes[pid].streams.streams[&k].capture.is_some() {
            return Err(code::INVALID_VALUE);
        }
        self.enqueue(pid, device, stream, Work::Recorded { at })?;
        if let Some(q) = self.processes[pid].streams.streams.get_mut(&k) {
            q.recorded += 1;
        }
        Ok(())
    }

    /// Moves `stream`'s progress through the recorded program's work to log time `at` (never
    /// back), then runs what can run.
    pub(super) fn reach_recorded(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
        at: u64,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        if let Some(q) = self.processes[pid].streams.streams.get_mut(&k) {
            q.reached = q.reached.max(at);
        }
        self.run_until(pid, |_| false);
        Ok(())
    }

    /// `cuStreamCreateWithPriority`: priorities are clamped into the range, as the driver does.
    pub(super) fn priority_range(&self) -> (i32, i32) {
        (0, -5)
    }
}
