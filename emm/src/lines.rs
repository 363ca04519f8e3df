//! [`Lines`]: a vector whose buffer shares no cache line with another allocation (layer 0).
//!
//! The pools' per-thread shards keep their free lists in these. A `Vec`'s buffer comes from the
//! malloc arena of the thread that grew it, 16-byte aligned, beside whatever that arena hands
//! out next. A shard outlives the threads that grew its lists, and glibc gives a finished
//! thread's arena to the next thread it starts: that thread's own objects then land on the
//! cache lines of lists that another thread (the shard's new owner) writes on every pair, and
//! the two cores pass the lines back and forth, and two threads of cached `pool` pairs then
//! make little more than one thread's rate. A `Lines` buffer is
//! aligned to 128 bytes and sized a multiple of them (two cache
//! lines: the adjacent-line prefetcher fetches them in pairs), so whatever thread grows it, no
//! other allocation shares a line with its elements. Its operations cost what a `Vec`'s do.

// A vector over a raw buffer; each block says why it holds.
#![allow(unsafe_code)]

use std::alloc::{Layout, alloc, dealloc, handle_alloc_error};
use std::ptr::NonNull;

/// The alignment of every buffer, and the granularity of its size.
const LINE: usize = 128;

/// The fewest elements a buffer is made for.
const MIN_CAPACITY: usize = 4;

/// A vector on cache lines of its own (see the module's doc): a `Vec` whose buffer is aligned
/// to 128 bytes and sized a multiple of them. Reads go through the slice it derefs to.
pub(crate) struct Lines<T> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
}

// SAFETY: a `Lines<T>` owns its elements as a `Vec<T>` does; sending or sharing it sends or
// shares them.
unsafe impl<T: Send> Send for Lines<T> {}
// SAFETY: as for `Send`: `&Lines<T>` reaches only `&T`.
unsafe impl<T: Sync> Sync for Lines<T> {}

impl<T> Default for Lines<T> {
    fn default() -> Lines<T> {
        Lines::new()
    }
}

impl<T> Lines<T> {
    /// An empty vector (no buffer allocated).
    pub(crate) const fn new() -> Lines<T> {
        const { assert!(size_of::<T>() > 0, "no zero-sized elements") };
        Lines {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// The buffer's layout for `cap` elements: at least `LINE`-aligned, a multiple of `LINE`
    /// bytes long.
    fn layout(cap: usize) -> Layout {
        let bytes = cap
            .checked_mul(size_of::<T>())
            .and_then(|b| b.checked_next_multiple_of(LINE))
            .expect("a list's capacity overflows the address space");
        Layout::from_size_align(bytes, LINE.max(align_of::<T>())).expect("a valid layout")
    }

    /// Moves the elements to a buffer of at least `want` elements.
    #[cold]
    #[inline(never)]
    fn grow_to(&mut self, want: usize) {
        let cap = want.max(self.cap * 2).max(MIN_CAPACITY);
        let layout = Self::layout(cap);
        // SAFETY: `layout` has a non-zero size (`cap` ≥ 4 elements of a non-zero size).
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            handle_alloc_error(layout)
        };
        // The buffer holds whole lines: the elements the capacity allows in them.
        let cap = layout.size() / size_of::<T>();
        // SAFETY: the old buffer holds `len` elements, the new one room for `cap` ≥ `len`, and
        // they do not overlap (the new one was just allocated).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), ptr.as_ptr(), self.len) };
        self.free_buffer();
        self.ptr = ptr;
        self.cap = cap;
    }

    /// Frees the buffer (its elements were moved out or dropped) and leaves none.
    fn free_buffer(&mut self) {
        if self.cap != 0 {
            // SAFETY: the buffer was allocated by `grow_to` with `layout(self.cap)` (the
            // capacity it records was computed back from that layout, which it gives again).
            unsafe { dealloc(self.ptr.as_ptr().cast(), Self::layout(self.cap)) };
        }
        self.ptr = NonNull::dangling();
        self.cap = 0;
    }

    /// Adds `value` at the end.
    #[inline(always)]
    pub(crate) fn push(&mut self, value: T) {
        if self.len == self.cap {
            self.grow_to(self.len + 1);
        }
        // SAFETY: `len` < `cap`: the slot is inside the buffer and holds no element.
        unsafe { self.ptr.as_ptr().add(self.len).write(value) };
        self.len += 1;
    }

    /// Takes the last element out.
    #[inline(always)]
    pub(crate) fn pop(&mut self) -> Option<T> {
        self.len = self.len.checked_sub(1)?;
        // SAFETY: the slot at the old last index holds an element, which no longer counts as
        // the vector's (`len` is past it) and is read out once.
        Some(unsafe { self.ptr.as_ptr().add(self.len).read() })
    }

    /// Adds every value at the end, in order.
    pub(crate) fn extend(&mut self, values: impl IntoIterator<Item = T>) {
        let values = values.into_iter();
        let more = values.size_hint().0;
        if self.cap - self.len < more {
            self.grow_to(self.len + more);
        }
        for value in values {
            self.push(value);
        }
    }

    /// Moves the elements `from..from + n` to the end of `to`, in order, and those after them
    /// down to `from`.
    fn move_out(&mut self, from: usize, n: usize, to: &mut Vec<T>) {
        debug_assert!(from + n <= self.len);
        to.reserve(n);
        // SAFETY: `from..from + n` are elements of this vector; they are copied to `to`'s
        // spare capacity (reserved above, a different allocation) and then count as `to`'s.
        // The `len - from - n` elements after them are then moved down over their slots
        // (`copy` allows the overlap), and the length drops by `n`: every element is owned
        // once.
        unsafe {
            let src = self.ptr.as_ptr().add(from);
            std::ptr::copy_nonoverlapping(src, to.as_mut_ptr().add(to.len()), n);
            to.set_len(to.len() + n);
            std::ptr::copy(src.add(n), src, self.len - from - n);
        }
        self.len -= n;
    }

    /// Moves the last `n` elements (all of them if fewer) to the end of `to`, in order.
    pub(crate) fn move_last_into(&mut self, n: usize, to: &mut Vec<T>) {
        let n = n.min(self.len);
        self.move_out(self.len - n, n, to);
    }

    /// Takes the last `n` elements out (all of them if fewer), in order.
    pub(crate) fn split_off_last(&mut self, n: usize) -> Vec<T> {
        let mut taken = Vec::new();
        self.move_last_into(n, &mut taken);
        taken
    }

    /// Takes the first `n` elements out (all of them if fewer), in order; the rest move to the
    /// front, in order.
    pub(crate) fn take_first(&mut self, n: usize) -> Vec<T> {
        let mut taken = Vec::new();
        self.move_out(0, n.min(self.len), &mut taken);
        taken
    }

    /// Takes element `i` out; those after it move down one, in order.
    ///
    /// # Panics
    ///
    /// If `i` is not below the length.
    pub(crate) fn remove(&mut self, i: usize) -> T {
        assert!(i < self.len, "index {i} past a list of {}", self.len);
        // SAFETY: `i` < `len`: the slot holds an element, read out once; the `len - i - 1`
        // elements after it then move down over it (`copy` allows the overlap), and the length
        // drops by one, so every element is owned once.
        unsafe {
            let at = self.ptr.as_ptr().add(i);
            let value = at.read();
            std::ptr::copy(at.add(1), at, self.len - i - 1);
            self.len -= 1;
            value
        }
    }

    /// Takes every element out, in order, and frees the buffer.
    pub(crate) fn take_all(&mut self) -> Vec<T> {
        // A pool drains every list of every shard, most of them empty: nothing to move.
        if self.len == 0 {
            self.free_buffer();
            return Vec::new();
        }
        let taken = self.split_off_last(self.len);
        self.free_buffer();
        taken
    }

    /// Drops every element and frees the buffer.
    pub(crate) fn clear(&mut self) {
        drop(self.take_all());
    }
}

impl<T> std::ops::Deref for Lines<T> {
    type Target = [T];

    #[inline(always)]
    fn deref(&self) -> &[T] {
        // SAFETY: the first `len` slots of the buffer hold elements (`ptr` is dangling but
        // aligned when `len` is 0, which a slice allows).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for Lines<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for Lines<T> {
    fn drop(&mut self) {
        // SAFETY: the first `len` slots hold elements, dropped here once; the buffer is freed
        // after.
        unsafe { std::ptr::drop_in_place(&mut **self as *mut [T]) };
        self.len = 0;
        self.free_buffer();
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every buffer is its own lines: aligned to 128 bytes and a multiple of 128 long, for
    /// 8-, 16- and 40-byte elements, with every element they have room for counted in the
    /// capacity (which the free recomputes the layout from).
    #[test]
    fn buffers_are_aligned_and_whole_lines() {
        fn check<T: Default>() {
            let mut l = Lines::<T>::new();
            for n in 0..100 {
                l.push(T::default());
                assert_eq!(l.as_ptr().addr() % 128, 0, "after {n}");
                let bytes = Lines::<T>::layout(l.cap).size();
                assert_eq!(bytes % 128, 0, "after {n}");
                // The capacity is all the elements the lines hold.
                assert!(l.cap >= l.len() && (l.cap + 1) * size_of::<T>() > bytes);
            }
        }
        check::<u64>();
        check::<(u64, usize)>();
        check::<[u64; 5]>();
    }

    /// One operation on a list and on a `Vec` model.
    #[derive(Debug, Clone)]
    enum Op {
        Push(u64),
        Pop,
        Extend(Vec<u64>),
        MoveLastInto(usize),
        SplitOffLast(usize),
        TakeFirst(usize),
        Remove(usize),
        TakeAll,
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => any::<u64>().prop_map(Op::Push),
            3 => Just(Op::Pop),
            1 => proptest::collection::vec(any::<u64>(), 0..40).prop_map(Op::Extend),
            1 => (0usize..40).prop_map(Op::MoveLastInto),
            1 => (0usize..40).prop_map(Op::SplitOffLast),
            1 => (0usize..40).prop_map(Op::TakeFirst),
            1 => (0usize..40).prop_map(Op::Remove),
            1 => Just(Op::TakeAll),
            1 => Just(Op::Clear),
        ]
    }

    /// Operations per case: fewer under Miri, where each costs a hundred times more and the
    /// unsafe paths are all reached within a few dozen.
    const OPS: usize = if cfg!(miri) { 60 } else { 200 };

    proptest! {
        #![proptest_config(crate::test_config::proptest_config())]

        /// A list behaves as a `Vec` under every operation, element by element.
        #[test]
        fn a_list_is_a_vec(ops in proptest::collection::vec(op(), 0..OPS)) {
            let (mut list, mut model) = (Lines::<u64>::new(), Vec::<u64>::new());
            for op in ops {
                match op {
                    Op::Push(v) => {
                        list.push(v);
                        model.push(v);
                    }
                    Op::Pop => prop_assert_eq!(list.pop(), model.pop()),
                    Op::Extend(vs) => {
                        list.extend(vs.iter().copied());
                        model.extend(vs);
                    }
                    Op::MoveLastInto(n) => {
                        let (mut got, mut want) = (vec![7], vec![7]);
                        list.move_last_into(n, &mut got);
                        want.extend(model.drain(model.len() - n.min(model.len())..));
                        prop_assert_eq!(got, want);
                    }
                    Op::SplitOffLast(n) => {
                        let at = model.len() - n.min(model.len());
                        prop_assert_eq!(list.split_off_last(n), model.split_off(at));
                    }
                    Op::TakeFirst(n) => {
                        let n2 = n.min(model.len());
                        prop_assert_eq!(list.take_first(n), model.drain(..n2).collect::<Vec<_>>());
                    }
                    Op::Remove(i) if i < model.len() => {
                        prop_assert_eq!(list.remove(i), model.remove(i));
                    }
                    Op::Remove(_) => {}
                    Op::TakeAll => prop_assert_eq!(list.take_all(), std::mem::take(&mut model)),
                    Op::Clear => {
                        list.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(&*list, &*model);
                if let (Some(first), Some(m)) = (list.first_mut(), model.first_mut()) {
                    *first ^= 1;
                    *m ^= 1;
                }
            }
        }
    }

    /// Every element is dropped once: popped, moved out, removed, cleared or dropped with the
    /// list.
    #[test]
    fn held_elements_drop_once() {
        let counted = std::rc::Rc::new(());
        let mut l: Lines<std::rc::Rc<()>> = Lines::new();
        l.extend((0..20).map(|_| counted.clone()));
        drop(l.pop());
        drop(l.take_first(3));
        drop(l.remove(2));
        drop(l.split_off_last(2));
        assert_eq!(std::rc::Rc::strong_count(&counted), 1 + 13);
        l.clear();
        assert_eq!(std::rc::Rc::strong_count(&counted), 1);
        l.extend((0..5).map(|_| counted.clone()));
        drop(l);
        assert_eq!(std::rc::Rc::strong_count(&counted), 1);
    }
}
