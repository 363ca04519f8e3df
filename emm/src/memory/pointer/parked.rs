//! [`ParkedPointer`]: a pool pointer's record kept whole with its block after the last drop,
//! revived by the next allocation of the block's size.

use super::*;

/// A built-in pool's pointer whose last clone dropped, its record kept whole with the block
/// ([`PoolHook::park`]), so that the next allocation of that size makes its pointer by
/// changing two fields: no record to find, no hook to clone, nothing else to write. Dropped, it
/// releases the block through its hook as the pointer would have.
pub(crate) struct ParkedPointer(pub(super) Parked<Allocation>);

impl ParkedPointer {
    /// A pointer to the block again, of `size` bytes (at most the block's), stamped `tag`, its
    /// allocation's history stamp `stamp` ([`stamp`](Self::stamp)).
    #[inline(always)]
    pub(crate) fn revive(mut self, size: usize, tag: u64, stamp: u64) -> MemoryPointer {
        self.0.value_mut().size = size;
        if let Release::Pool {
            tag: t, stamp: s, ..
        } = &mut self.0.value_mut().release
        {
            *t = tag;
            *s = stamp;
        }
        MemoryPointer {
            alloc: self.0.revive(),
            offset: 0,
            size,
        }
    }

    /// A pointer again to a block that may be elsewhere than the record's last one (a
    /// stream-ordered pool's: the driver hands out the addresses): `size` bytes at `base`,
    /// stamped `tag` and `stamp`.
    #[inline(always)]
    pub(crate) fn revive_at(
        mut self,
        base: DevicePtr,
        size: usize,
        tag: u64,
        stamp: u64,
    ) -> MemoryPointer {
        self.0.value_mut().base = base;
        self.revive(size, tag, stamp)
    }

    /// A stream-ordered pointer again ([`MemoryPointer::with_stashed_hook_on`]'s record,
    /// parked with its stream record emptied): `size` bytes at `base`, stamped `tag` and
    /// `stamp`, allocated and to be freed on `stream`, used by no other stream yet.
    #[inline(always)]
    pub(crate) fn revive_on(
        mut self,
        base: DevicePtr,
        size: usize,
        tag: u64,
        stamp: u64,
        stream: StreamHandle,
    ) -> MemoryPointer {
        if let Some(record) = &mut self.0.value_mut().streams {
            let use_ = use_mut(record);
            use_.stream = stream;
            use_.free_on = stream;
        }
        self.revive_at(base, size, tag, stamp)
    }

    /// The history stamp a pool gave the allocation of a pool record (its history ring's
    /// clock then: `managers::pool::history`), 0 for any other record: a free of the block,
    /// on whichever thread, is stamped later than it.
    #[inline(always)]
    pub(crate) fn stamp(&self) -> u64 {
        match &self.0.value().release {
            Release::Pool { stamp, .. } => *stamp,
            _ => 0,
        }
    }

    /// Whether the record is a stream-ordered pointer's.
    #[inline(always)]
    pub(crate) fn has_streams(&self) -> bool {
        self.0.value().streams.is_some()
    }

    /// The stream of a stream-ordered record that no other stream used and that is freed on
    /// the stream it was allocated on; `None` for any other record.
    #[inline(always)]
    pub(crate) fn single_stream(&mut self) -> Option<StreamHandle> {
        let use_ = use_mut(self.0.value_mut().streams.as_mut()?);
        use_.other_streams().next().is_none().then_some(use_.stream)
    }

    /// A stream-ordered record's streams, taken out for its free: the record keeps its stream
    /// record, emptied (no stream recorded, none kept alive), for its revival. `None` for a
    /// record without streams.
    #[inline(always)]
    pub(crate) fn take_stream_use(&mut self) -> Option<StreamUse> {
        let record = self.0.value_mut().streams.as_mut()?;
        let use_ = use_mut(record);
        Some(std::mem::replace(use_, StreamUse::on(StreamHandle::NULL)))
    }

    /// Stamps a parked pool record with `tag` (at its revival, or, for a stream-ordered
    /// pool's, one that names no live block, so that the record releases nothing if it is
    /// dropped instead of revived).
    #[inline(always)]
    pub(crate) fn set_tag(&mut self, tag: u64) {
        if let Release::Pool { tag: t, .. } = &mut self.0.value_mut().release {
            *t = tag;
        }
    }

    /// A tracked pointer again ([`AllocationOwner::park`]): `size` bytes at `base`, recorded
    /// under `key` at `generation` in the table whose clone the record holds (the same
    /// device and context, since one table serves one context).
    #[inline(always)]
    pub(crate) fn revive_tracked(
        mut self,
        base: DevicePtr,
        size: usize,
        (key, generation): (u64, u64),
    ) -> MemoryPointer {
        let a = self.0.value_mut();
        a.base = base;
        a.size = size;
        let Release::Tracked {
            key: k,
            generation: g,
            ..
        } = &mut a.release
        else {
            unreachable!("a table parks only its tracked pointers' records")
        };
        *k = key;
        *g = generation;
        MemoryPointer {
            alloc: self.0.revive(),
            offset: 0,
            size,
        }
    }

    /// A tracked record being parked: its entry was released, so it is stamped
    /// [`PARKED_GENERATION`] and releases nothing if it is ever dropped instead of revived.
    #[inline(always)]
    pub(crate) fn mark_released(&mut self) {
        if let Release::Tracked { generation, .. } = &mut self.0.value_mut().release {
            *generation = PARKED_GENERATION;
        }
    }

    /// The block's address.
    pub(crate) fn base(&self) -> u64 {
        self.0.value().base.0
    }

    /// The block's address, the record let go without releasing the block (the pool takes it
    /// back itself: a trim, a reset, a full shard): its box goes to this thread's spares with
    /// the hook's clone, as a retired pool pointer's does.
    pub(crate) fn into_base(self) -> DevicePtr {
        let base = self.0.value().base;
        // Owns nothing more once its hook and streams are out (a pool's pointer has no owner).
        self.0.retire_with(|a| {
            let emptied = a.streams.take().map(|record| empty_stream_record(record).1);
            a.take_pool_hook().map(|(hook, ..)| KeptHook {
                hook,
                streams: emptied,
            })
        });
        base
    }
}
