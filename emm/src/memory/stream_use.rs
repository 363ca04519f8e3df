//! The streams a stream-ordered allocation belongs to ([`StreamUse`]), and the records its
//! pointers share it through.

use std::sync::Arc;
// std's lock, not loom's: stream records are recycled through process-wide depots (statics,
// `record.rs`), which would outlive a loom execution.
use std::sync::Mutex;

use driver_sys::StreamHandle;

use super::host::HostOwner;
use super::pointer::PoolHook;

/// A stream-ordered allocation's [`StreamUse`], as its pointers share it.
pub(crate) type StreamRecord = Box<Mutex<StreamUse>>;

/// What a pool pointer's recycled box keeps for the next pointer made in it: its clone of the
/// pool's release hook, and the emptied stream-use record of a stream-ordered pointer, so that
/// the next pointer made on a stream allocates no record of its own.
pub(crate) struct KeptHook {
    pub(crate) hook: Arc<dyn PoolHook>,
    pub(crate) streams: Option<StreamRecord>,
}

/// The stream use out of `record`, and the record left holding an empty use (no streams, no
/// owners) to be filled again.
pub(crate) fn empty_stream_record(mut record: StreamRecord) -> (StreamUse, StreamRecord) {
    let taken = std::mem::replace(use_mut(&mut record), StreamUse::on(StreamHandle::NULL));
    (taken, record)
}

/// A stream-use record for memory allocated on `stream`: `kept` filled anew, or a new one.
#[inline(always)]
pub(crate) fn stream_record_on(kept: Option<StreamRecord>, stream: StreamHandle) -> StreamRecord {
    match kept {
        Some(mut record) => {
            *use_mut(&mut record) = StreamUse::on(stream);
            record
        }
        None => Box::new(Mutex::new(StreamUse::on(stream))),
    }
}

/// The stream use out of its record (unboxed), ignoring poison (a record is plain data).
pub(crate) fn into_stream_use(record: Mutex<StreamUse>) -> StreamUse {
    record.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// Locks a stream-use record, ignoring poison (a record is plain data, always consistent).
/// std's guard: the records' lock is std's (not loom's, see the import).
pub(crate) fn lock_use(m: &Mutex<StreamUse>) -> std::sync::MutexGuard<'_, StreamUse> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A stream-use record its owner reaches without the lock (as [`lock_use`], ignoring poison).
pub(crate) fn use_mut(m: &mut Mutex<StreamUse>) -> &mut StreamUse {
    m.get_mut().unwrap_or_else(|p| p.into_inner())
}

/// The streams a stream-ordered allocation belongs to: allocated on [`stream`](Self::stream),
/// freed on [`free_on`](Self::free_on) (the allocation stream unless
/// [`MemoryPointer::free_on`](crate::MemoryPointer::free_on) changed it), and used by the
/// [`recorded`](Self::recorded) streams besides (PyTorch's `record_stream`). A manager may reuse the block on `free_on`
/// in stream order, and anywhere else only once the work queued on `free_on` and on every
/// recorded stream before the free is done.
#[derive(Clone, Debug)]
pub struct StreamUse {
    /// The stream the memory was allocated on.
    pub stream: StreamHandle,
    /// The stream the memory is freed on.
    pub free_on: StreamHandle,
    /// Other streams that used the memory (neither `stream` nor `free_on`), in the order
    /// they were recorded, each once.
    pub recorded: Vec<StreamHandle>,
    /// What keeps emm's own streams among these alive (a created stream is not destroyed
    /// while memory ordered on it may still be freed or cached on it): the allocation
    /// stream's apart, so that the common case allocates nothing.
    alloc_owner: Option<HostOwner>,
    keep: Vec<(StreamHandle, HostOwner)>,
}

/// A stream as the memory layer sees it: its handle, and what keeps it alive. emm's
/// [`Stream`](crate::Stream) keeps itself alive while memory ordered on it needs it. A raw
/// [`StreamHandle`] is no `OrderedOn`: wrap another library's stream with
/// [`Context::external_stream_owned`](crate::Context::external_stream_owned) (or
/// `external_stream`), which is where the caller vouches for it.
///
/// # Safety
///
/// [`stream_handle`](Self::stream_handle) names a stream of the memory's context (or an
/// implicit one) that stays alive while the value, or the owner
/// [`keep_alive`](Self::keep_alive) returns, is held: emm queues frees and waits on it as long
/// as it holds that owner (with `None`, as long as the memory ordered on it lives), and the
/// driver takes the handle unchecked.
#[allow(unsafe_code)] // the trait's contract is the point: implementing it vouches for a stream
pub unsafe trait OrderedOn {
    /// The stream's handle.
    fn stream_handle(&self) -> StreamHandle;

    /// An owner that keeps the stream from being destroyed while it is held (`None` for a
    /// stream emm does not destroy).
    fn keep_alive(&self) -> Option<HostOwner> {
        None
    }
}

impl StreamUse {
    /// Allocated and to be freed on `stream`, used by no other stream yet.
    pub fn on(stream: StreamHandle) -> StreamUse {
        StreamUse {
            stream,
            free_on: stream,
            recorded: Vec::new(),
            alloc_owner: None,
            keep: Vec::new(),
        }
    }

    /// What keeps `stream` alive, if it is one of emm's created streams.
    pub fn owner_of(&self, stream: StreamHandle) -> Option<&HostOwner> {
        if stream == self.stream && self.alloc_owner.is_some() {
            return self.alloc_owner.as_ref();
        }
        self.keep.iter().find(|(s, _)| *s == stream).map(|(_, o)| o)
    }

    pub(crate) fn keep(&mut self, stream: &(impl OrderedOn + ?Sized)) {
        if self.owner_of(stream.stream_handle()).is_some() {
            return;
        }
        let Some(owner) = stream.keep_alive() else {
            return;
        };
        let handle = stream.stream_handle();
        if handle == self.stream {
            self.alloc_owner = Some(owner);
        } else {
            self.keep.push((handle, owner));
        }
    }

    /// The streams whose work must be done before the block can be used outside `free_on`'s
    /// order: the recorded streams, and the allocation stream when the free moved elsewhere.
    pub fn other_streams(&self) -> impl Iterator<Item = StreamHandle> + '_ {
        let moved = (self.stream != self.free_on).then_some(self.stream);
        moved
            .into_iter()
            .chain(self.recorded.iter().copied().filter(|s| *s != self.free_on))
    }
}
