//! What a stream must wait for before it uses a block of an arena that every stream shares:
//! the ranges freed on a stream whose work may still use them.
//!
//! - A block freed on stream T (its only user) goes back to the shared free space at once,
//!   merged with its free neighbours, and its range is recorded here with T and T's count of
//!   frees so far.
//! - Before stream S uses a block, [`FreedRanges::waits_for`] names the streams T other than S
//!   with a recorded range inside it freed after the last time S was ordered after T's work:
//!   S must find T idle ([`FreedRanges::idle`]) or make its own work wait on the GPU for the
//!   work queued on T so far ([`FreedRanges::ordered`]). S needs nothing for its own frees:
//!   its work is ordered.
//! - Once S holds the block, [`FreedRanges::forget_within`] forgets the ranges inside it (the
//!   parts of a range outside the block stay recorded), as it does for a chunk that goes back
//!   to the driver.
//! - A stream is known from its first free until a sweep ([`FreedRanges::sweep`]) finds it
//!   with no range left and no order on a stream that has one: it is then forgotten with its
//!   count and its orders, so that a stream made later with the same handle starts anew, and
//!   the sweep returns it. The caller keeps every known stream alive (a destroyed stream's
//!   handle may name a new stream, which neither its ranges nor its orders are about), and
//!   sweeps where it reclaims memory: a stream that takes back what it freed, the commonest
//!   pair, is not forgotten and known again at every turn.
//!
//! Ranges never overlap and are never merged: each keeps the count of the free that made it, so
//! that a block made of an old free and a recent one waits only where it holds the recent one.
//! The range freed last waits outside the map until the next operation ([`FreedRanges::recent`]):
//! a stream that frees a block and takes the same block back, the pool's commonest pair, makes
//! no map operation. The few known streams and their orders are kept in short lists.

use std::collections::BTreeMap;

use driver_sys::StreamHandle;

/// One range freed on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    /// One past its last byte.
    end: u64,
    /// The stream it was freed on.
    stream: StreamHandle,
    /// That stream's count of frees when it was freed.
    count: u64,
}

/// A known stream's record.
#[derive(Clone, Copy, Debug, Default)]
struct Known {
    /// Its frees so far (since it was last forgotten).
    count: u64,
    /// Its ranges in the map (the range freed last, outside it, is not counted).
    ranges: usize,
    /// Its orders after other streams recorded.
    orders: usize,
}

/// Ranges freed on streams and not known to be past their streams' work (see the module's
/// note).
#[derive(Debug, Default)]
pub(super) struct FreedRanges {
    /// Start -> the range.
    ranges: BTreeMap<u64, Range>,
    /// The range freed last (start, range), not yet in `ranges`: recorded as much as they are.
    recent: Option<(u64, Range)>,
    /// Per known stream: its count of frees, its ranges and its orders.
    streams: Vec<(StreamHandle, Known)>,
    /// (stream, stream it was ordered after) -> the second's count of frees at the time.
    orders: Vec<((StreamHandle, StreamHandle), u64)>,
}

impl FreedRanges {
    /// `stream`'s record, if it is known.
    fn known(&self, stream: StreamHandle) -> Option<&Known> {
        self.streams
            .iter()
            .find(|(s, _)| *s == stream)
            .map(|(_, k)| k)
    }

    /// `stream`'s record, made if it is not known; whether it was made.
    fn entry(&mut self, stream: StreamHandle) -> (bool, &mut Known) {
        match self.streams.iter().position(|(s, _)| *s == stream) {
            Some(k) => (false, &mut self.streams[k].1),
            None => {
                self.streams.push((stream, Known::default()));
                (true, &mut self.streams.last_mut().expect("just pushed").1)
            }
        }
    }

    /// `stream`'s record, made if it is not known.
    fn known_mut(&mut self, stream: StreamHandle) -> &mut Known {
        self.entry(stream).1
    }

    /// The order of `stream` after `after`, if recorded.
    fn order(&self, stream: StreamHandle, after: StreamHandle) -> Option<u64> {
        (self.orders.iter())
            .find(|(k, _)| *k == (stream, after))
            .map(|&(_, c)| c)
    }

    /// Removes the order of `stream` after `after`; whether there was one.
    fn remove_order(&mut self, stream: StreamHandle, after: StreamHandle) -> bool {
        match self.orders.iter().position(|(k, _)| *k == (stream, after)) {
            Some(k) => {
                self.orders.swap_remove(k);
                true
            }
            None => false,
        }
    }

    /// Puts the range freed last in the map.
    #[inline]
    fn settle_recent(&mut self) {
        if let Some((start, range)) = self.recent.take() {
            self.settle(start, range);
        }
    }

    /// Puts `range`, starting at `start`, in the map.
    #[inline(never)]
    fn settle(&mut self, start: u64, range: Range) {
        let before = self.ranges.insert(start, range);
        debug_assert!(before.is_none(), "a freed block overlaps a recorded free");
        self.known_mut(range.stream).ranges += 1;
    }

    /// Records `size` bytes at `addr` freed on `stream`, a range no recorded range overlaps
    /// (the block was in use); whether `stream` was not known before.
    pub(super) fn freed(&mut self, stream: StreamHandle, addr: u64, size: usize) -> bool {
        self.settle_recent();
        let (new, known) = self.entry(stream);
        known.count += 1;
        let range = Range {
            end: addr + size as u64,
            stream,
            count: known.count,
        };
        self.recent = Some((addr, range));
        new
    }

    /// Forgets the range freed last if it is `size` bytes at `addr` freed on `stream`, which
    /// takes it back whole: no other range reaches into it and `stream` waits for nothing
    /// there. Whether it was; if not, [`waits_for`](Self::waits_for) and
    /// [`forget_within`](Self::forget_within) decide.
    #[inline]
    pub(super) fn take_own_recent(&mut self, stream: StreamHandle, addr: u64, size: usize) -> bool {
        match self.recent {
            Some((start, r))
                if start == addr && r.end == addr + size as u64 && r.stream == stream =>
            {
                self.recent = None;
                true
            }
            _ => false,
        }
    }

    /// The recorded ranges that overlap `size` bytes at `addr`: the map's by start, then the
    /// range freed last.
    fn overlapping(&self, addr: u64, size: usize) -> impl Iterator<Item = (u64, Range)> + '_ {
        let end = addr + size as u64;
        // Ranges are disjoint, so at most the last one starting before `addr` reaches into
        // the block.
        let first = self
            .ranges
            .range(..addr)
            .next_back()
            .filter(|(_, r)| r.end > addr)
            .map(|(&start, _)| start)
            .unwrap_or(addr);
        let recent = self
            .recent
            .filter(|&(start, r)| start < end && r.end > addr);
        self.ranges
            .range(first..end)
            .map(|(&s, &r)| (s, r))
            .chain(recent)
    }

    /// The streams other than `stream` that `stream` must find idle or be ordered after before
    /// it uses `size` bytes at `addr`, each once.
    pub(super) fn waits_for(
        &self,
        stream: StreamHandle,
        addr: u64,
        size: usize,
    ) -> Vec<StreamHandle> {
        let mut out = Vec::new();
        // The block freed last, taken back whole: no other range reaches into it.
        if let Some((start, r)) = self.recent
            && start == addr
            && r.end == addr + size as u64
        {
            if r.stream != stream && r.count > self.order(stream, r.stream).unwrap_or(0) {
                out.push(r.stream);
            }
            return out;
        }
        for (_, r) in self.overlapping(addr, size) {
            if r.stream == stream || out.contains(&r.stream) {
                continue;
            }
            let ordered = self.order(stream, r.stream).unwrap_or(0);
            if r.count > ordered {
                out.push(r.stream);
            }
        }
        out
    }

    /// The streams with a recorded range that overlaps `size` bytes at `addr`, each once.
    pub(super) fn streams_within(&self, addr: u64, size: usize) -> Vec<StreamHandle> {
        let mut out = Vec::new();
        for (_, r) in self.overlapping(addr, size) {
            if !out.contains(&r.stream) {
                out.push(r.stream);
            }
        }
        out
    }

    /// Records that `stream`'s work from now on waits for the work queued on `after` so far:
    /// what `after` freed until now no longer needs a wait for `stream`. `stream` is known
    /// from then on while `after` is.
    pub(super) fn ordered(&mut self, stream: StreamHandle, after: StreamHandle) {
        let Some(count) = self.known(after).map(|k| k.count) else {
            return;
        };
        if stream == after {
            return;
        }
        match self.orders.iter_mut().find(|(k, _)| *k == (stream, after)) {
            Some((_, c)) => *c = count,
            None => {
                self.orders.push(((stream, after), count));
                self.known_mut(stream).orders += 1;
            }
        }
    }

    /// Forgets every range of `stream`, whose work is done.
    pub(super) fn idle(&mut self, stream: StreamHandle) {
        self.settle_recent();
        if self.known(stream).is_none_or(|k| k.ranges == 0) {
            return;
        }
        self.known_mut(stream).ranges = 0;
        self.ranges.retain(|_, r| r.stream != stream);
    }

    /// Forgets the streams with no range left and no order on a stream that has one (and the
    /// orders after a stream with no range); returns them.
    pub(super) fn sweep(&mut self) -> Vec<StreamHandle> {
        self.settle_recent();
        let mut gone = Vec::new();
        let empty: Vec<StreamHandle> = (self.streams.iter())
            .filter(|(_, k)| k.ranges == 0)
            .map(|(s, _)| *s)
            .collect();
        for stream in empty {
            self.forget_if_unknown(stream, &mut gone);
        }
        gone
    }

    /// Forgets the recorded ranges inside `size` bytes at `addr` (a block a stream now holds,
    /// or a chunk that leaves the arena), keeping the parts of each outside it.
    pub(super) fn forget_within(&mut self, addr: u64, size: usize) {
        let end = addr + size as u64;
        // The block freed last, taken back whole: no map operation.
        if let Some((start, r)) = self.recent
            && start == addr
            && r.end == end
        {
            self.recent = None;
            return;
        }
        self.settle_recent();
        let hit: Vec<(u64, Range)> = self.overlapping(addr, size).collect();
        for (start, r) in hit {
            self.ranges.remove(&start);
            let mut kept = 0;
            if start < addr {
                self.ranges.insert(start, Range { end: addr, ..r });
                kept += 1;
            }
            if r.end > end {
                self.ranges.insert(end, r);
                kept += 1;
            }
            let known = self.known_mut(r.stream);
            known.ranges = known.ranges + kept - 1;
        }
    }

    /// Forgets `stream` if it has no range and no order left, and then the orders after it,
    /// adding to `gone` every stream that is no longer known.
    fn forget_if_unknown(&mut self, stream: StreamHandle, gone: &mut Vec<StreamHandle>) {
        let Some(known) = self.known(stream).copied() else {
            return;
        };
        if known.ranges > 0 {
            return;
        }
        // With no range, nothing needs an order after it.
        if self.orders.iter().any(|((_, b), _)| *b == stream) {
            let after: Vec<StreamHandle> = (self.orders.iter())
                .filter(|((_, b), _)| *b == stream)
                .map(|((a, _), _)| *a)
                .collect();
            for waiter in after {
                // Where streams were ordered after each other, a call below this one may
                // have forgotten this stream's orders already.
                if !self.remove_order(waiter, stream) {
                    continue;
                }
                if let Some(k) = self.streams.iter().position(|(s, _)| *s == waiter) {
                    self.streams[k].1.orders -= 1;
                }
                self.forget_if_unknown(waiter, gone);
            }
        }
        if let Some(k) = self.streams.iter().position(|(s, _)| *s == stream)
            && self.streams[k].1.orders == 0
        {
            self.streams.swap_remove(k);
            gone.push(stream);
        }
    }

    /// Whether `stream` is known (see the module's note).
    pub(super) fn knows(&self, stream: StreamHandle) -> bool {
        self.known(stream).is_some()
    }

    /// The known streams.
    #[cfg(all(test, not(emm_loom)))]
    pub(super) fn streams(&self) -> impl Iterator<Item = StreamHandle> + '_ {
        self.streams.iter().map(|(s, _)| *s)
    }

    /// How many ranges are recorded.
    #[cfg(all(test, not(emm_loom)))]
    pub(super) fn len(&self) -> usize {
        self.ranges.len() + usize::from(self.recent.is_some())
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests;
