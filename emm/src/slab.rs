//! [`Slab`]: values in a vector, named by index, with the freed indices reused (layer 0).
//!
//! The host layer's allocation table and the pool's arena both name their entries by a slab
//! index instead of hashing an address: recording, finding and releasing an entry is an index
//! into a vector.

use std::ops::{Index, IndexMut};

/// Values named by a `u32` index; a removed value's index is handed out again, most recently
/// freed first, so the slab grows to the most values held at once, not to the number inserted.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    entries: Vec<Option<T>>,
    /// Indices of the empty entries, the most recently emptied last.
    vacant: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Slab<T> {
        Slab {
            entries: Vec::new(),
            vacant: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Stores `value`; returns its index. Always inlined, the slab's growth out of line: a
    /// call here copies the value twice on its way to the entry, on the default manager's
    /// hot path.
    #[inline(always)]
    pub(crate) fn insert(&mut self, value: T) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.len += 1;
                self.entries[i as usize] = Some(value);
                i
            }
            None => self.push(value),
        }
    }

    /// [`insert`](Self::insert) with no empty entry to reuse.
    #[inline(never)]
    fn push(&mut self, value: T) -> u32 {
        let i = u32::try_from(self.entries.len()).expect(
            "fewer than 2^32 entries in one slab (a manager's live allocations, a pool's free blocks)",
        );
        self.len += 1;
        self.entries.push(Some(value));
        i
    }

    /// The value at `index`, if one is there.
    pub(crate) fn get(&self, index: u32) -> Option<&T> {
        self.entries.get(index as usize)?.as_ref()
    }

    /// Takes the value at `index` out, if one is there; the index is handed out again later.
    pub(crate) fn remove(&mut self, index: u32) -> Option<T> {
        let value = self.entries.get_mut(index as usize)?.take()?;
        self.len -= 1;
        self.vacant.push(index);
        Some(value)
    }

    /// Drops the value at `index`, if one is there, without moving it out (a caller that
    /// read what it needs in place saves the copy); the index is handed out again later.
    #[inline(always)]
    pub(crate) fn discard(&mut self, index: u32) {
        if let Some(entry) = self.entries.get_mut(index as usize)
            && entry.is_some()
        {
            *entry = None;
            self.len -= 1;
            self.vacant.push(index);
        }
    }

    /// How many values the slab holds.
    /// The entries with their indices, in index order.
    pub(crate) fn iter_indexed(&self) -> impl Iterator<Item = (u32, &T)> {
        (0u32..)
            .zip(self.entries.iter())
            .filter_map(|(i, e)| e.as_ref().map(|e| (i, e)))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Empties the slab.
    pub(crate) fn clear(&mut self) {
        self.len = 0;
        self.vacant.clear();
        self.entries.clear();
    }

    /// Empties the slab, returning every value it held.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = T> {
        self.len = 0;
        self.vacant.clear();
        std::mem::take(&mut self.entries).into_iter().flatten()
    }

    /// Entries allocated, held or vacant (what the slab's memory is sized by).
    #[cfg(test)]
    pub(crate) fn capacity_used(&self) -> usize {
        self.entries.len()
    }
}

impl<T> Index<u32> for Slab<T> {
    type Output = T;

    fn index(&self, index: u32) -> &T {
        self.get(index)
            .expect("a slab index names a value it holds")
    }
}

impl<T> IndexMut<u32> for Slab<T> {
    fn index_mut(&mut self, index: u32) -> &mut T {
        self.entries
            .get_mut(index as usize)
            .and_then(Option::as_mut)
            .expect("a slab index names a value it holds")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One step on the slab.
    #[derive(Clone, Debug)]
    enum Step {
        /// Insert a value (distinct from every other).
        Insert,
        /// Remove the value at this index among the held ones, wrapped.
        Remove(usize),
        /// Remove an index that may be held, vacant or never handed out.
        RemoveAny(u32),
        /// Empty the slab (a reset).
        Drain,
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            5 => Just(Step::Insert),
            4 => any::<usize>().prop_map(Step::Remove),
            1 => (0u32..64).prop_map(Step::RemoveAny),
            1 => Just(Step::Drain),
        ]
    }

    proptest::proptest! {
        #![proptest_config(crate::test_config::proptest_config())]

        /// Random inserts, removals (of held indices, and of indices that are vacant or were
        /// never handed out) and drains against a map: every index handed out is distinct
        /// among the held ones, a removal returns exactly the value inserted under its index
        /// and only once, the length is the map's, a drain returns every held value, and an
        /// index is reused only after its value left (so the slab grows to the most values
        /// held at once, not to the number inserted). 256 cases (`PROPTEST_CASES=N` for
        /// more).
        #[test]
        #[cfg_attr(
            miri,
            ignore = "the slab is bookkeeping without unsafe code, which Miri has nothing to check \
                      in; the native run covers it"
        )]
        fn a_slab_hands_out_distinct_indices_and_returns_each_value_once(
            steps in proptest::collection::vec(step(), 1..200)
        ) {
            let mut slab = Slab::default();
            let mut model: std::collections::BTreeMap<u32, usize> = Default::default();
            let (mut next, mut most_held) = (0usize, 0usize);
            for step in steps {
                match step {
                    Step::Insert => {
                        next += 1;
                        let index = slab.insert(next);
                        proptest::prop_assert!(model.insert(index, next).is_none(), "index {index} handed out twice");
                        most_held = most_held.max(model.len());
                    }
                    Step::Remove(i) if !model.is_empty() => {
                        let index = *model.keys().nth(i % model.len()).expect("in range");
                        let value = slab.remove(index).expect("a held index gives its value back");
                        proptest::prop_assert_eq!(Some(value), model.remove(&index));
                        proptest::prop_assert!(slab.remove(index).is_none(), "removed twice");
                    }
                    Step::Remove(_) => {}
                    Step::RemoveAny(index) => {
                        proptest::prop_assert_eq!(slab.remove(index), model.remove(&index));
                    }
                    Step::Drain => {
                        let mut got: Vec<usize> = slab.drain().collect();
                        let mut want: Vec<usize> = std::mem::take(&mut model).into_values().collect();
                        got.sort_unstable();
                        want.sort_unstable();
                        proptest::prop_assert_eq!(got, want);
                        most_held = 0;
                    }
                }
                proptest::prop_assert_eq!(slab.len(), model.len());
                proptest::prop_assert!(slab.capacity_used() <= most_held, "{} entries for at most {most_held} held", slab.capacity_used());
                for (index, value) in &model {
                    proptest::prop_assert_eq!(slab.get(*index), Some(value));
                    proptest::prop_assert_eq!(&slab[*index], value);
                }
            }
        }
    }
}
