//! The pool's own history, always on: each shard keeps a ring of its thread's last
//! allocations and frees, written under the shard the path enters anyway. An allocation's
//! event has its address, size, tag and stamp; a free's has the address and its stamp.
//!
//! **Stamps.** Each ring keeps a clock, a [`clock::stamp`] read at the ring's first event and
//! every [`REFRESH`] events after it, counted up by one at each event in between (reading the
//! time-stamp counter at every allocation cost the cached pair more than the rest of the
//! pool's work together). A free is stamped above both its ring's clock and its
//! allocation's stamp, which its pointer carries ([`ParkedPointer::stamp`]): on whichever
//! thread a block is freed, the free sorts after its allocation, and the next allocation of
//! the block after the free, so that the order of the events on one block is exact across
//! rings. A block that moves from one shard to another does so through the depot or the
//! arena, and the shard that takes it reads the counter then (a refill is never a cached
//! allocation). A stamp is never later than the counter when its event happened (the clocks
//! count up by one an event, far slower than the counter), so an event's time in a snapshot
//! is at most its ring's [`REFRESH`] events early.
//!
//! A snapshot merges the rings by stamp and keeps the window after every full ring's oldest
//! event, so that no allocation in it is missing. The allocations made in the window that
//! are still live carry their tag and time; older ones show as unrecorded in-use space. Which
//! are still live comes from the allocations alone, with the pool's lists: a later
//! allocation that overlaps an earlier one's block ends it, a free ends it, and the snapshot
//! keeps only those whose address lies in in-use space.
//! The `history` adaptor, where present, gives every allocation instead, each with its time.

use std::collections::BTreeMap;

use crate::clock;
use crate::contract::manager::HistoryRecord;
use crate::contract::snapshot::{AllocationInfo, HistoryAction, HistoryEvent, Tag};
#[cfg(doc)]
use crate::memory::pointer::ParkedPointer;

/// Events one shard keeps: 40 bytes each.
pub(super) const EVENTS_PER_SHARD: usize = 128;

/// A ring reads the time-stamp counter at its first allocation and every this many events
/// after it (and at every refill from outside its shard: [`Ring::alloc_fresh`]).
pub(super) const REFRESH: usize = 32;

/// An event's stream where the allocation was not stream-ordered (no stream handle is all
/// ones: the legacy and per-thread default streams are 0, 1 and 2).
pub(super) const NO_STREAM: u64 = u64::MAX;

/// One event of a ring: an allocation (its tag in `tag`) or a free (`bytes` is 0: the
/// allocation's event has the size).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Event {
    addr: u64,
    stamp: u64,
    bytes: u64,
    tag: u64,
    /// The stream of a stream-ordered allocation ([`NO_STREAM`]: none).
    stream: u64,
}

/// A shard's last [`EVENTS_PER_SHARD`] events.
#[derive(Clone)]
pub(super) struct Ring {
    events: Box<[Event; EVENTS_PER_SHARD]>,
    /// Events written so far; the next goes to `next % EVENTS_PER_SHARD`.
    next: usize,
    /// The ring's clock: its last event's stamp (see the module's note).
    clock: u64,
}

impl Default for Ring {
    fn default() -> Ring {
        Ring::new()
    }
}

impl Ring {
    pub(super) fn new() -> Ring {
        Ring {
            events: Box::new([Event::default(); EVENTS_PER_SHARD]),
            next: 0,
            clock: 0,
        }
    }

    /// Records an allocation of `bytes` (more than 0) at `addr` by this shard's thread;
    /// returns its stamp, for the pointer to carry.
    #[inline(always)]
    pub(super) fn alloc(&mut self, addr: u64, bytes: usize) -> u64 {
        self.alloc_on(addr, bytes, NO_STREAM)
    }

    /// Records an allocation of `bytes` (more than 0) at `addr` on `stream` ([`NO_STREAM`]:
    /// none); returns its stamp.
    #[inline(always)]
    pub(super) fn alloc_on(&mut self, addr: u64, bytes: usize, stream: u64) -> u64 {
        let stamp = if self.next.is_multiple_of(REFRESH) {
            self.read_clock()
        } else {
            self.clock + 1
        };
        self.write(addr, stamp, bytes, stream)
    }

    /// [`alloc`](Self::alloc) of a block that came from outside the shard (the depot, the
    /// arena, a growth): the counter is read, so that the allocation sorts after whatever
    /// another ring did with the block before.
    pub(super) fn alloc_fresh(&mut self, addr: u64, bytes: usize, stream: u64) -> u64 {
        let stamp = self.read_clock();
        self.write(addr, stamp, bytes, stream)
    }

    /// The counter now, or one above the ring's clock where that is later.
    #[cold]
    fn read_clock(&self) -> u64 {
        clock::stamp().max(self.clock + 1)
    }

    #[inline(always)]
    fn write(&mut self, addr: u64, stamp: u64, bytes: usize, stream: u64) -> u64 {
        self.clock = stamp;
        self.events[self.next % EVENTS_PER_SHARD] = Event {
            addr,
            stamp,
            bytes: bytes as u64,
            tag: u64::from(Tag::current().raw()),
            stream,
        };
        self.next += 1;
        stamp
    }

    /// Records the free, by this shard's thread, of the allocation at `addr` stamped
    /// `allocated` (its pointer's [`ParkedPointer::stamp`]; a fresh [`clock::stamp`] where the
    /// pointer is not at hand).
    #[inline(always)]
    pub(super) fn free(&mut self, addr: u64, allocated: u64) {
        let stamp = self.clock.max(allocated) + 1;
        self.clock = stamp;
        let slot = &mut self.events[self.next % EVENTS_PER_SHARD];
        slot.addr = addr;
        slot.stamp = stamp;
        slot.bytes = 0;
        self.next += 1;
    }

    /// Forgets every event (a reset freed what they name).
    pub(super) fn clear(&mut self) {
        self.next = 0;
    }

    /// The events kept, oldest first, each with its ring and its place in it.
    fn kept(&self, ring: usize) -> impl Iterator<Item = (Event, usize, usize)> + '_ {
        let n = self.next.min(EVENTS_PER_SHARD);
        (self.next - n..self.next).map(move |i| (self.events[i % EVENTS_PER_SHARD], ring, i))
    }

    /// The stamp at or before which this ring may have lost events (0 while it lost none):
    /// its oldest kept event's (stamps never decrease along a ring).
    fn horizon(&self) -> u64 {
        if self.next <= EVENTS_PER_SHARD {
            0
        } else {
            self.events[self.next % EVENTS_PER_SHARD].stamp
        }
    }
}

/// Merges the rings (read under their shards' locks) into a history: the events after every
/// full ring's horizon, in stamp order, and the allocations made then that may still be live
/// (see the module's note; the snapshot keeps those in in-use space).
pub(super) fn merge<'a>(rings: impl IntoIterator<Item = &'a Ring>) -> HistoryRecord {
    let rings: Vec<&Ring> = rings.into_iter().collect();
    let horizon = rings.iter().map(|r| r.horizon()).max().unwrap_or(0);
    let mut events: Vec<(Event, usize, usize)> = rings
        .iter()
        .enumerate()
        .flat_map(|(k, r)| r.kept(k))
        .filter(|(e, _, _)| horizon == 0 || e.stamp > horizon)
        .collect();
    // By stamp; a free sorts after its allocation on whichever ring (the module's note).
    events.sort_by_key(|&(e, ring, i)| (e.stamp, ring, i));
    let to_us = clock::to_unix_us();
    // Live candidates by address.
    let mut live: BTreeMap<u64, AllocationInfo> = BTreeMap::new();
    let mut out = Vec::with_capacity(events.len());
    for (e, _, _) in events {
        let time_us = to_us(e.stamp);
        if e.bytes > 0 {
            let end = e.addr + e.bytes;
            // A candidate whose block this allocation overlaps has ended.
            let overlapping: Vec<u64> = live
                .range(..end)
                .rev()
                .take_while(|(a, other)| **a + other.requested as u64 > e.addr)
                .map(|(&a, _)| a)
                .collect();
            for a in overlapping {
                live.remove(&a);
            }
            let tag = Tag::from_raw(e.tag as u32);
            let stream = (e.stream != NO_STREAM).then_some(e.stream);
            let info = AllocationInfo {
                requested: e.bytes as usize,
                stream,
                tag,
                time_us,
                stack: None,
            };
            live.insert(e.addr, info);
            out.push(HistoryEvent {
                action: HistoryAction::Alloc,
                address: e.addr,
                bytes: e.bytes as usize,
                stream,
                tag,
                time_us,
                stack: None,
            });
        } else {
            // A free ends its allocation.
            let Some(info) = live.remove(&e.addr) else {
                continue; // its allocation is older than the window
            };
            out.push(HistoryEvent {
                action: HistoryAction::Free,
                address: e.addr,
                bytes: info.requested,
                stream: info.stream,
                tag: info.tag,
                time_us,
                stack: None,
            });
        }
    }
    HistoryRecord {
        live: live.into_iter().collect(),
        events: out,
        complete: false,
    }
}
