//! The pool's own history, always on: each shard keeps a ring of its thread's last
//! allocations and frees, written under the shard the path enters anyway. An allocation's
//! event has its address, size, tag and [`clock::stamp`]; a free's has the address and, for
//! order, the ring's last allocation stamp (a second counter read per pair would cost the
//! cached pair more than the rest of the history together).
//!
//! A snapshot merges the rings by stamp and keeps the window after every full ring's oldest
//! event, so that no allocation in it is missing. The allocations made in the window that
//! are still live carry their tag and time; older ones show as unrecorded in-use space. Which
//! are still live comes from the allocations alone, with the pool's lists: a later
//! allocation that overlaps an earlier one's block ends it, a free on the allocating thread
//! ends it, and the snapshot keeps only those whose address lies in in-use space (a free on
//! another thread has only a lower bound of its time, so it may sort before its allocation:
//! the freed block is then cached, free, or another allocation's, and is dropped there).
//! The `history` adaptor, where present, gives every allocation instead.

use std::collections::BTreeMap;

use crate::clock;
use crate::contract::manager::HistoryRecord;
use crate::contract::snapshot::{AllocationInfo, HistoryAction, HistoryEvent, Tag};

/// Events one shard keeps: 32 bytes each.
pub(super) const EVENTS_PER_SHARD: usize = 128;

/// An event's stream where the allocation was not stream-ordered (no stream handle is all
/// ones: the legacy and per-thread default streams are 0, 1 and 2).
const NO_STREAM: u64 = u64::MAX;

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
    /// The stamp of the ring's last allocation: a free's stamp.
    last: u64,
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
            last: 0,
        }
    }

    /// Records an allocation of `bytes` (more than 0) at `addr` by this shard's thread.
    #[inline(always)]
    pub(super) fn alloc(&mut self, addr: u64, bytes: usize) {
        self.alloc_on(addr, bytes, NO_STREAM);
    }

    /// Records an allocation of `bytes` (more than 0) at `addr` on `stream` ([`NO_STREAM`]:
    /// none).
    #[inline(always)]
    pub(super) fn alloc_on(&mut self, addr: u64, bytes: usize, stream: u64) {
        let stamp = clock::stamp();
        self.last = stamp;
        self.events[self.next % EVENTS_PER_SHARD] = Event {
            addr,
            stamp,
            bytes: bytes as u64,
            tag: u64::from(Tag::current().raw()),
            stream,
        };
        self.next += 1;
    }

    /// Records the free of the allocation at `addr` by this shard's thread.
    #[inline(always)]
    pub(super) fn free(&mut self, addr: u64) {
        let slot = &mut self.events[self.next % EVENTS_PER_SHARD];
        slot.addr = addr;
        slot.stamp = self.last;
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
    // By stamp; a free after the allocation it shares a stamp with on its ring.
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
            // A free on the allocating thread's ring ends its allocation for sure; one on
            // another thread's (its stamp a lower bound) only if it sorts after it.
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
