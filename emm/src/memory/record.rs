//! The shared record behind every [`MemoryPointer`](super::MemoryPointer): a reference count
//! and the allocation it describes, in a box that is recycled instead of freed.
//!
//! `std::sync::Arc` would do the counting, but an `Arc` frees its box when the count reaches
//! zero, so every allocation a manager hands out would cost a heap allocation and a heap free
//! (a large share of a cached `pool` pair). [`Record`]
//! counts the same way (`Relaxed` increments, a `Release` decrement and an `Acquire` fence
//! before the value is dropped) and, once the value is dropped, keeps the empty box in a short
//! per-thread list for the next pointer made on that thread. The last owner also skips the
//! atomic decrement when it can see it is alone (a count of one, read with `Acquire`: no other
//! holder exists to clone it), which is the common case of a pointer made and dropped once.
//!
//! Spare boxes are plain memory: at most [`SPARES`] per thread, freed when the thread exits.
//! A thread whose list is full hands half of it, as one batch, to a process-wide depot (at
//! most [`DEPOT_BATCHES`] batches per type: 16 384 boxes, 4 MiB of `malloc` blocks, enough for
//! a program that holds ten thousand pointers and lets them all go to make them again without
//! a heap allocation; boxes beyond it are freed), and a thread whose list is empty takes a batch
//! from there before it allocates: when one thread makes the pointers and another drops them,
//! the boxes (and the release-hook clones they keep) travel back in batches, one lock per
//! [`SPARES`]` / 2` pointers, instead of being allocated on one thread and freed on the other,
//! which cost such a pair of threads most of their throughput.
//! A type may also keep a record whole when its last owner drops ([`Recycle::park`]): the
//! `pool` manager keeps a small block's record, value and all, with the block, and revives it
//! for the next allocation of that size ([`Parked::revive`]).
//! Under `--cfg emm_loom` no box goes through the spare lists (the per-thread list is
//! sequential code; the count is what the models check); parking still runs, so the pool's
//! loom models cover it.

// The reference count and the recycled box are raw-pointer code; each block says why it holds.
#![allow(unsafe_code)]

use std::alloc::{Layout, alloc, dealloc, handle_alloc_error};
use std::mem::MaybeUninit;
use std::ops::Deref;
use std::ptr::NonNull;

use crate::sync::{AtomicUsize, Ordering, fence};

/// The most spare boxes one thread keeps.
const SPARES: usize = 64;

/// The most batches of [`SPARES`]` / 2` spare boxes the depot of one type keeps: enough that a
/// program holding ten thousand pointers (RMM's random workload at 10 000 allocations holds
/// 4 600 at its peak) makes no new box after its first run.
const DEPOT_BATCHES: usize = 512;

/// The process-wide batches of spare boxes of one [`Recycle`] type. Held in statics, so std's
/// lock (loom's cannot be one).
pub(crate) type Depot<T> = std::sync::Mutex<Vec<Vec<Spare<T>>>>;

/// The box: aligned to 128 bytes and sized a multiple of them (an `Allocation`'s is 128 bytes
/// either way), so it shares no cache line with another allocation ([`LineBox`]). A box outlives the thread
/// that made it (it is recycled, and a pool parks it with its block in a shard), and the next
/// thread that takes the maker's malloc arena would otherwise put its own objects on the lines
/// the box's new user writes on every pair (see `lines.rs`).
#[repr(align(128))]
struct Inner<T> {
    refs: AtomicUsize,
    value: T,
}

/// A reference-counted, shared, immutable `T` whose box is recycled per thread.
///
/// Only [`Allocation`](super::pointer::Allocation) uses it; the spare list is per type through
/// [`Recycle`].
pub(crate) struct Record<T: Recycle> {
    ptr: NonNull<Inner<T>>,
}

/// A type whose records recycle their boxes through a per-thread list of spares.
pub(crate) trait Recycle: Sized + Send + Sync + 'static {
    /// What a spare box keeps of the value it last held, for the next value made in it (a
    /// pool's pointer keeps its clone of the pool's release hook, so that the next pointer
    /// made in the box need not clone it again).
    type Keep: Send + 'static;

    /// Runs `f` on this thread's spare boxes; `None` while the thread is being torn down.
    fn with_spares<R>(f: impl FnOnce(&mut Vec<Spare<Self>>) -> R) -> Option<R>;

    /// The type's depot of spare batches, shared by every thread.
    fn depot() -> &'static Depot<Self>;

    /// Called on the last owner's thread just before the value drops: takes out what the box
    /// keeps, if anything (and does whatever the value's drop would have done with it). A
    /// value that returns `Some` has been emptied: it owns nothing more and its drop would do
    /// nothing, so the record skips the drop (a pool's pointer: a tenth of its pair's
    /// instructions). Returning `Some` from a value that still owns something leaks it.
    fn retire(&mut self) -> Option<Self::Keep>;

    /// Offered the whole record, value and box, when its last owner drops and before
    /// [`retire`](Self::retire): a type that keeps it (a pool keeps a pointer's record with its
    /// block, so that the next allocation of that size finds both in one) returns `None`;
    /// otherwise the record is handed back and retired as usual. The default keeps nothing.
    #[inline(always)]
    fn park(record: Parked<Self>) -> Option<Parked<Self>> {
        Some(record)
    }
}

/// A record whose last owner dropped, with its value still in it, kept by its type
/// ([`Recycle::park`]) to be made a record again ([`revive`](Self::revive)) with one owner.
/// Dropping it retires it as the last owner's drop would have.
pub(crate) struct Parked<T: Recycle> {
    ptr: NonNull<Inner<T>>,
}

// SAFETY: a parked record is owned by one holder, which alone reaches its value (`value_mut`
// takes `&mut self`); `T: Send + Sync` (the `Recycle` bound) lets it move between threads and
// be read through `&`.
unsafe impl<T: Recycle> Send for Parked<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Recycle> Sync for Parked<T> {}

impl<T: Recycle> Parked<T> {
    /// The value, as the last owner left it.
    #[inline(always)]
    pub(crate) fn value(&self) -> &T {
        // SAFETY: the box holds a value while it is parked, and no record points to it.
        unsafe { &self.ptr.as_ref().value }
    }

    /// The value, to change before it is revived.
    #[inline(always)]
    pub(crate) fn value_mut(&mut self) -> &mut T {
        // SAFETY: as in `value`; `&mut self` is the only way to the box.
        unsafe { &mut self.ptr.as_mut().value }
    }

    /// A record of the value again, with one owner.
    #[inline(always)]
    pub(crate) fn revive(self) -> Record<T> {
        let ptr = self.ptr;
        std::mem::forget(self);
        // SAFETY: as in `value`. Relaxed: the parked record reached this thread through
        // whatever synchronised its handover (a pool's shard lock), as a new record does.
        unsafe { ptr.as_ref() }.refs.store(1, Ordering::Relaxed);
        Record { ptr }
    }

    /// Retires the value through `retire` instead of [`Recycle::retire`] (same contract: a
    /// value it returns `Some` for owns nothing more and is not dropped), and keeps the box
    /// among the thread's spares.
    pub(crate) fn retire_with(self, retire: impl FnOnce(&mut T) -> Option<T::Keep>) {
        let ptr = self.ptr;
        std::mem::forget(self);
        // SAFETY: a parked record is its value's last owner, and it is gone (forgotten above).
        unsafe { retire_last(ptr, retire) }
    }
}

impl<T: Recycle> Drop for Parked<T> {
    fn drop(&mut self) {
        // SAFETY: a parked record is its value's last owner, and this is its only drop.
        unsafe { retire_last(self.ptr, T::retire) }
    }
}

/// An empty box that held a `T`'s record, and what it kept of that value.
pub(crate) struct Spare<T: Recycle>(LineBox<T>, Option<T::Keep>);

/// The memory of one record's box: an `Inner<T>`'s size, at its alignment (128 bytes), carved
/// out of a plain `malloc` block one alignment larger, not allocated with `posix_memalign`.
/// glibc serves an over-aligned request by splitting a larger chunk and freeing the ends,
/// which in a heap of thousands of live pointers costs several times this carving. The box
/// shares no cache line with another
/// allocation either way; the block's start is kept in the word after the box, so that the
/// box alone frees it.
pub(crate) struct LineBox<T> {
    ptr: NonNull<MaybeUninit<Inner<T>>>,
}

// SAFETY: a `LineBox` owns uninitialised memory and no `T`: moving it between threads moves
// only the right to write and free that memory.
unsafe impl<T> Send for LineBox<T> {}

impl<T> LineBox<T> {
    /// The `malloc` block's layout: the box, and its alignment again, at a word's alignment
    /// (served by `malloc` itself).
    const LAYOUT: Layout = {
        let align = std::mem::align_of::<Inner<T>>();
        let word = std::mem::align_of::<*mut u8>();
        // The block starts on a word; the box on the first multiple of `align` at or after it
        // (at most `align - word` later); its end leaves a word for the block's start.
        assert!(align >= 2 * word && std::mem::size_of::<Inner<T>>().is_multiple_of(align));
        match Layout::from_size_align(std::mem::size_of::<Inner<T>>() + align, word) {
            Ok(l) => l,
            Err(_) => panic!("a record's box fits a layout"),
        }
    };

    /// Uninitialised memory for an `Inner<T>`. Out of line: the pointers' hot paths take a
    /// spare box.
    #[inline(never)]
    fn new() -> LineBox<T> {
        let layout = Self::LAYOUT;
        // SAFETY: the layout's size is not zero.
        let block = unsafe { alloc(layout) };
        if block.is_null() {
            handle_alloc_error(layout);
        }
        let align = std::mem::align_of::<Inner<T>>();
        let skip = (align - block.addr() % align) % align;
        // SAFETY: `block` is word aligned, so `skip <= align - word`: the box (`skip` bytes in)
        // and the word after it (at `skip + size`, word aligned since `align` and `size` are)
        // lie inside the block of `size + align` bytes.
        unsafe {
            let boxed = block.add(skip);
            boxed
                .add(std::mem::size_of::<Inner<T>>())
                .cast::<*mut u8>()
                .write(block);
            LineBox {
                ptr: NonNull::new_unchecked(boxed.cast()),
            }
        }
    }

    /// Takes back the memory of a box given out by [`write_into_raw`](Self::write_into_raw).
    ///
    /// # Safety
    ///
    /// `ptr` came from `write_into_raw`, and nothing else owns it now (its value, if any, was
    /// dropped or moved out: the box frees the memory without dropping it).
    unsafe fn from_raw(ptr: NonNull<Inner<T>>) -> LineBox<T> {
        LineBox { ptr: ptr.cast() }
    }

    /// Writes `value` into the box and gives up its memory, to be taken back by
    /// [`from_raw`](Self::from_raw).
    fn write_into_raw(self, value: Inner<T>) -> NonNull<Inner<T>> {
        let ptr = self.ptr;
        std::mem::forget(self);
        // SAFETY: the box's memory is valid for an `Inner<T>` and aligned for it, and owned by
        // `self` (forgotten above, so not freed).
        unsafe { ptr.as_ptr().write(MaybeUninit::new(value)) };
        ptr.cast()
    }
}

impl<T> Drop for LineBox<T> {
    fn drop(&mut self) {
        // SAFETY: `new` wrote the block's start in the word after the box, and `LAYOUT` is the
        // block's layout; the box holds no value to drop (`MaybeUninit`).
        unsafe {
            let word = self
                .ptr
                .as_ptr()
                .cast::<u8>()
                .add(std::mem::size_of::<Inner<T>>())
                .cast::<*mut u8>();
            dealloc(word.read(), Self::LAYOUT);
        }
    }
}

// SAFETY: a record hands out only shared references to `T` (`Deref`) and drops `T` on the
// thread of the last owner, as `Arc<T>` does; `T: Send + Sync` (the `Recycle` bound) makes
// both sound.
unsafe impl<T: Recycle> Send for Record<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Recycle> Sync for Record<T> {}

impl<T: Recycle> Record<T> {
    /// A record holding `value`, with one owner. Kept out of line: its callers (the tracked
    /// managers' pointers) are on the pair's path, and inlining it there lengthens it.
    #[inline(never)]
    pub(crate) fn new(value: T) -> Record<T> {
        Self::new_with(|_| value)
    }

    /// A record holding the value `make` returns, with one owner; `make` is handed what the
    /// recycled box kept of its last value, if anything (dropping it is fine). Always inlined:
    /// a pool's pointer is made through it, on the cached pair's path.
    #[inline(always)]
    pub(crate) fn new_with(make: impl FnOnce(Option<T::Keep>) -> T) -> Record<T> {
        let spare = if cfg!(emm_loom) {
            None
        } else {
            T::with_spares(|s| s.pop()).flatten().or_else(refill::<T>)
        };
        let (boxed, kept) = match spare {
            Some(Spare(spare, kept)) => (spare, kept),
            None => (LineBox::new(), None),
        };
        Record {
            ptr: boxed.write_into_raw(Inner {
                refs: AtomicUsize::new(1),
                value: make(kept),
            }),
        }
    }

    fn inner(&self) -> &Inner<T> {
        // SAFETY: the box lives while any record points to it, and this one does.
        unsafe { self.ptr.as_ref() }
    }

    /// How many records share the value.
    pub(crate) fn count(this: &Record<T>) -> usize {
        this.inner().refs.load(Ordering::Acquire)
    }

    /// The value, mutably, when this record is its only owner (as `Arc::get_mut`): no atomic
    /// read-modify-write, and no lock needed around it.
    pub(crate) fn get_mut(this: &mut Record<T>) -> Option<&mut T> {
        // A count of one seen with Acquire: no other owner exists to use the value or clone
        // this one (it is borrowed mutably), and every earlier owner's use of the value
        // happened before its decrement, which this load synchronises with.
        if Record::count(this) != 1 {
            return None;
        }
        // SAFETY: the box lives while this record does, and nothing else reaches the value
        // while `this` is borrowed (above).
        Some(unsafe { &mut this.ptr.as_mut().value })
    }

    /// Whether `a` and `b` share one value.
    pub(crate) fn ptr_eq(a: &Record<T>, b: &Record<T>) -> bool {
        a.ptr == b.ptr
    }
}

impl<T: Recycle> Clone for Record<T> {
    fn clone(&self) -> Record<T> {
        // Relaxed, as `Arc`: a new owner is made from an existing one, which keeps the value
        // alive; nothing is published by the increment.
        let old = self.inner().refs.fetch_add(1, Ordering::Relaxed);
        if old > isize::MAX as usize {
            // As `Arc`: a count this high means clones were leaked; wrapping would free the
            // value while it is used.
            std::process::abort();
        }
        Record { ptr: self.ptr }
    }
}

impl<T: Recycle> Deref for Record<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.inner().value
    }
}

impl<T: Recycle> Drop for Record<T> {
    fn drop(&mut self) {
        let refs = &self.inner().refs;
        // A count of one seen with Acquire: this record is the only owner (no other exists to
        // clone it), and every other owner's use of the value happened before its decrement,
        // which this load synchronises with. Otherwise decrement as `Arc` does.
        if refs.load(Ordering::Acquire) != 1 {
            if refs.fetch_sub(1, Ordering::Release) != 1 {
                return;
            }
            fence(Ordering::Acquire);
        }
        if let Some(parked) = T::park(Parked { ptr: self.ptr }) {
            drop(parked);
        }
    }
}

/// Retires the value of the record at `ptr` and keeps its box among the thread's spares.
///
/// # Safety
///
/// The caller is the value's last owner (no record or parked record reaches it afterwards),
/// and calls this once.
#[inline(always)]
unsafe fn retire_last<T: Recycle>(
    ptr: NonNull<Inner<T>>,
    retire: impl FnOnce(&mut T) -> Option<T::Keep>,
) {
    let raw = ptr.as_ptr();
    // SAFETY: the caller is the last owner, so nothing else reads or writes the value while
    // it is retired and dropped; it is dropped at most once, here (not when `retire` emptied
    // it, which only forgoes a drop that does nothing), and the box then holds no value
    // (`MaybeUninit`). The box came from `LineBox::write_into_raw` in `new_with`.
    let (spare, kept) = unsafe {
        let kept = retire(&mut (*raw).value);
        if kept.is_none() {
            std::ptr::drop_in_place(raw);
        }
        (LineBox::from_raw(ptr), kept)
    };
    if cfg!(emm_loom) {
        return;
    }
    let mut spare = Some(Spare(spare, kept));
    T::with_spares(|s| {
        if s.len() < SPARES {
            s.extend(spare.take());
        }
    });
    if let Some(spare) = spare {
        spill(spare);
    }
}

/// This thread has no spare box: its list takes a batch from the depot, and hands back one
/// of its boxes.
#[cold]
#[inline(never)]
fn refill<T: Recycle>() -> Option<Spare<T>> {
    let batch = lock_depot::<T>().pop()?;
    // Not run while the thread is being torn down: the batch is then freed with the closure.
    T::with_spares(|s| {
        s.extend(batch);
        s.pop()
    })
    .flatten()
}

/// A spare that found this thread's list full (or the thread exiting): half the list goes to
/// the depot as one batch, and the spare takes its place. Boxes the depot has no room for are
/// freed here, with no lock held and the list not borrowed (what they kept may run any drop).
#[cold]
#[inline(never)]
fn spill<T: Recycle>(spare: Spare<T>) {
    let mut spare = Some(spare);
    let unwanted = T::with_spares(|s| {
        let batch = s.split_off(s.len().min(SPARES / 2));
        s.extend(spare.take());
        let mut depot = lock_depot::<T>();
        if depot.len() < DEPOT_BATCHES && !batch.is_empty() {
            depot.push(batch);
            None
        } else {
            Some(batch)
        }
    });
    drop(unwanted);
    drop(spare);
}

/// Takes out of the depot's spare boxes every kept value `unwanted` picks (a dropped manager's
/// clones of its hook), and drops them with the depot unlocked; the boxes stay. A box in a
/// thread's own list keeps its value until that thread reuses the box or exits.
pub(crate) fn forget_kept<T: Recycle>(unwanted: impl Fn(&T::Keep) -> bool) {
    let forgotten: Vec<T::Keep> = {
        let mut depot = lock_depot::<T>();
        depot
            .iter_mut()
            .flatten()
            .filter_map(|Spare(_, kept)| kept.take_if(|k| unwanted(k)))
            .collect()
    };
    drop(forgotten);
}

/// How many of the depot's spare boxes keep a value `pick` picks (tests).
#[cfg(all(test, not(emm_loom)))]
pub(crate) fn depot_keeps<T: Recycle>(pick: impl Fn(&T::Keep) -> bool) -> usize {
    lock_depot::<T>()
        .iter()
        .flatten()
        .filter(|Spare(_, kept)| kept.as_ref().is_some_and(&pick))
        .count()
}

/// `T`'s depot, locked; a panic elsewhere while it was held left only whole batches in it.
fn lock_depot<T: Recycle>() -> std::sync::MutexGuard<'static, Vec<Vec<Spare<T>>>> {
    T::depot()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Declares the per-thread spare list of a [`Recycle`] type, which keeps `$keep` of its values
/// through `$retire` (and, given `$park`, parks its records through it: [`Recycle::park`]).
macro_rules! recycle_per_thread {
    ($t:ty, $keep:ty, $retire:expr) => {
        $crate::memory::record::recycle_per_thread!(@impl $t, $keep, $retire, {});
    };
    ($t:ty, $keep:ty, $retire:expr, $park:expr) => {
        $crate::memory::record::recycle_per_thread!(@impl $t, $keep, $retire, {
            #[inline(always)]
            fn park(
                record: $crate::memory::record::Parked<$t>,
            ) -> Option<$crate::memory::record::Parked<$t>> {
                $park(record)
            }
        });
    };
    (@impl $t:ty, $keep:ty, $retire:expr, {$($park:tt)*}) => {
        impl $crate::memory::record::Recycle for $t {
            type Keep = $keep;

            fn retire(&mut self) -> Option<$keep> {
                $retire(self)
            }

            $($park)*

            #[inline(always)]
            fn with_spares<R>(
                f: impl FnOnce(&mut Vec<$crate::memory::record::Spare<$t>>) -> R,
            ) -> Option<R> {
                thread_local! {
                    static SPARES: std::cell::RefCell<Vec<$crate::memory::record::Spare<$t>>> =
                        const { std::cell::RefCell::new(Vec::new()) };
                }
                SPARES
                    .try_with(|s| s.try_borrow_mut().ok().map(|mut s| f(&mut s)))
                    .ok()
                    .flatten()
            }

            fn depot() -> &'static $crate::memory::record::Depot<$t> {
                static DEPOT: $crate::memory::record::Depot<$t> = std::sync::Mutex::new(Vec::new());
                &DEPOT
            }
        }
    };
}
pub(crate) use recycle_per_thread;

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize as StdAtomic;

    /// Counts its drops.
    struct Counted(Arc<StdAtomic>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    recycle_per_thread!(Counted, (), |_: &mut Counted| None);

    /// A pointer's box fills its 128-byte lines exactly: aligned, with no other allocation on
    /// them, and nothing wasted (a larger `Allocation` would cost a second pair of lines).
    #[test]
    fn a_pointers_box_is_one_pair_of_lines() {
        assert_eq!(
            std::mem::align_of::<Inner<crate::memory::pointer::Allocation>>(),
            128
        );
        #[cfg(target_pointer_width = "64")]
        assert_eq!(
            std::mem::size_of::<Inner<crate::memory::pointer::Allocation>>(),
            128
        );
        let r = Record::new(Counted(Arc::new(StdAtomic::new(0))));
        assert_eq!(r.ptr.as_ptr().addr() % 128, 0);
    }

    /// `get_mut` reaches the value only while the record is its only owner: not while a
    /// clone lives (here or on another thread), again once the clones are gone, and what it
    /// wrote is what every owner sees.
    #[test]
    fn get_mut_reaches_the_value_only_for_the_only_owner() {
        let drops = Arc::new(StdAtomic::new(0));
        let mut a = Record::new(Counted(drops.clone()));
        assert!(Record::get_mut(&mut a).is_some(), "one owner");
        let b = a.clone();
        assert!(Record::get_mut(&mut a).is_none(), "a clone lives");
        std::thread::spawn(move || drop(b)).join().expect("thread");
        let fresh = Arc::new(StdAtomic::new(7));
        Record::get_mut(&mut a).expect("the clone is gone").0 = fresh.clone();
        let c = a.clone();
        assert_eq!(c.0.load(std::sync::atomic::Ordering::SeqCst), 7);
        drop((a, c));
        assert_eq!(
            fresh.load(std::sync::atomic::Ordering::SeqCst),
            8,
            "dropped once"
        );
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[test]
    fn the_value_drops_once_when_the_last_owner_goes_and_the_box_is_reused() {
        let drops = Arc::new(StdAtomic::new(0));
        let a = Record::new(Counted(drops.clone()));
        let b = a.clone();
        assert_eq!(Record::count(&a), 2);
        assert!(Record::ptr_eq(&a, &b));
        let addr = a.ptr;
        drop(a);
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(b);
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 1);
        let c = Record::new(Counted(drops.clone()));
        assert_eq!(
            c.ptr, addr,
            "the freed box is the next one used on this thread"
        );
        assert_eq!(Record::count(&c), 1);
        drop(c);
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn owners_on_many_threads_drop_the_value_exactly_once() {
        let drops = Arc::new(StdAtomic::new(0));
        // Miri interprets every step: fewer rounds there.
        let rounds = if cfg!(miri) { 10 } else { 200 };
        for _ in 0..rounds {
            let r = Record::new(Counted(drops.clone()));
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let r = r.clone();
                    std::thread::spawn(move || drop(r))
                })
                .collect();
            drop(r);
            for h in handles {
                h.join().expect("a dropping thread");
            }
        }
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), rounds);
    }

    /// Keeps its `Arc` in the spare box when retired.
    struct Holder(Option<Arc<StdAtomic>>);
    recycle_per_thread!(Holder, Arc<StdAtomic>, |h: &mut Holder| h.0.take());

    #[test]
    fn a_recycled_box_hands_what_it_kept_to_the_next_value() {
        let shared = Arc::new(StdAtomic::new(0));
        let r = Record::new(Holder(Some(shared.clone())));
        assert_eq!(Arc::strong_count(&shared), 2);
        drop(r);
        assert_eq!(
            Arc::strong_count(&shared),
            2,
            "the spare box keeps the clone"
        );
        let r = Record::new_with(|kept| {
            let kept = kept.expect("the spare's clone");
            assert!(Arc::ptr_eq(&kept, &shared));
            Holder(Some(kept))
        });
        assert_eq!(Arc::strong_count(&shared), 2, "reused, not cloned again");
        drop(r);
    }

    /// Drops of `Emptied` values (only the test below makes them).
    static EMPTIED_DROPS: StdAtomic = StdAtomic::new(0);

    /// Counts its drops; its retire empties it (hands its `Arc` on) when it holds one.
    struct Emptied(Option<Arc<StdAtomic>>);
    impl Drop for Emptied {
        fn drop(&mut self) {
            EMPTIED_DROPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    recycle_per_thread!(Emptied, Arc<StdAtomic>, |e: &mut Emptied| e.0.take());

    #[test]
    fn a_value_its_retire_emptied_is_not_dropped_and_one_it_did_not_is() {
        let drops = || EMPTIED_DROPS.load(std::sync::atomic::Ordering::SeqCst);
        let shared = Arc::new(StdAtomic::new(0));
        drop(Record::new(Emptied(Some(shared.clone()))));
        assert_eq!(drops(), 0, "emptied by its retire: not dropped");
        assert_eq!(
            Arc::strong_count(&shared),
            2,
            "the spare keeps the handed-on clone"
        );
        // The next value in that box takes the clone; this one owns nothing to hand on.
        let r = Record::new_with(|kept| {
            assert!(kept.is_some_and(|k| Arc::ptr_eq(&k, &shared)));
            Emptied(None)
        });
        assert_eq!(Arc::strong_count(&shared), 1);
        drop(r);
        assert_eq!(drops(), 1, "not emptied: dropped");
    }

    /// Drops of `Parkable` values (only the test below makes them).
    static PARKABLE_DROPS: StdAtomic = StdAtomic::new(0);

    /// Parks its records in `PARKED` while `park` is set; its retire hands its `Arc` on.
    struct Parkable {
        park: bool,
        held: Option<Arc<StdAtomic>>,
    }
    impl Drop for Parkable {
        fn drop(&mut self) {
            PARKABLE_DROPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    static PARKED: std::sync::Mutex<Vec<Parked<Parkable>>> = std::sync::Mutex::new(Vec::new());
    recycle_per_thread!(
        Parkable,
        Arc<StdAtomic>,
        |p: &mut Parkable| p.held.take(),
        |record: Parked<Parkable>| {
            if !record.value().park {
                return Some(record);
            }
            PARKED.lock().unwrap().push(record);
            None
        }
    );

    #[test]
    fn a_parked_record_keeps_its_value_and_box_until_revived_or_let_go() {
        let drops = || PARKABLE_DROPS.load(std::sync::atomic::Ordering::SeqCst);
        let parked = || PARKED.lock().unwrap().len();
        let shared = Arc::new(StdAtomic::new(0));
        let a = Record::new(Parkable {
            park: true,
            held: Some(shared.clone()),
        });
        let b = a.clone();
        let addr = a.ptr;
        drop(a);
        assert_eq!(parked(), 0, "another owner lives");
        drop(b);
        assert_eq!(parked(), 1, "the last owner's drop parked it");
        assert_eq!(
            (drops(), Arc::strong_count(&shared)),
            (0, 2),
            "value kept whole"
        );
        // Revived: the same box and value, one owner, changed through `value_mut`.
        let mut p = PARKED.lock().unwrap().pop().unwrap();
        p.value_mut().park = false;
        let r = p.revive();
        assert_eq!((r.ptr, Record::count(&r)), (addr, 1));
        assert!(r.held.as_ref().is_some_and(|h| Arc::ptr_eq(h, &shared)));
        let c = r.clone();
        assert_eq!(Record::count(&r), 2);
        drop((r, c));
        // Not parked now: retired, which handed the `Arc` to the spare box (no drop).
        assert_eq!((parked(), drops(), Arc::strong_count(&shared)), (0, 0, 2));
        let r = Record::new_with(|kept| {
            assert!(kept.is_some_and(|k| Arc::ptr_eq(&k, &shared)));
            Parkable {
                park: true,
                held: None,
            }
        });
        assert_eq!(Arc::strong_count(&shared), 1);
        drop(r);
        // A parked record dropped is retired as its last owner's drop would have: this value
        // kept nothing to hand on, so it is dropped, once.
        let p = PARKED.lock().unwrap().pop().unwrap();
        drop(p);
        assert_eq!(drops(), 1);
        // `retire_with` retires through the given function instead.
        drop(Record::new(Parkable {
            park: true,
            held: None,
        }));
        let p = PARKED.lock().unwrap().pop().unwrap();
        let keep = shared.clone();
        p.retire_with(move |v| {
            assert!(v.held.is_none());
            Some(keep)
        });
        assert_eq!(drops(), 1, "emptied by `retire_with`: not dropped");
        assert_eq!(
            Arc::strong_count(&shared),
            2,
            "the spare box keeps the clone"
        );
    }

    #[test]
    fn a_thread_keeps_a_bounded_number_of_spares() {
        let drops = Arc::new(StdAtomic::new(0));
        let many: Vec<_> = (0..SPARES * 2)
            .map(|_| Record::new(Counted(drops.clone())))
            .collect();
        drop(many);
        let kept = Counted::with_spares(|s| s.len()).expect("the spare list");
        assert!(kept <= SPARES, "{kept} spares kept");
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), SPARES * 2);
    }

    /// Only this test makes and drops `Passed` records, so its depot is this test's alone.
    struct Passed;
    recycle_per_thread!(Passed, (), |_: &mut Passed| None);

    #[test]
    fn spares_pass_between_threads_in_batches_through_a_bounded_depot() {
        // One thread makes records and another drops them, as a producer and a consumer do.
        let made: Vec<_> = (0..SPARES * 2).map(|_| Record::new(Passed)).collect();
        let addrs: std::collections::HashSet<_> = made.iter().map(|r| r.ptr).collect();
        std::thread::spawn(move || {
            drop(made);
            let kept = Passed::with_spares(|s| s.len()).expect("the spare list");
            assert_eq!(kept, SPARES, "the dropping thread keeps a full list");
        })
        .join()
        .expect("the dropping thread");
        let batches = lock_depot::<Passed>().len();
        assert_eq!(batches, 2, "the other {} went to the depot", SPARES);
        assert!(lock_depot::<Passed>().iter().all(|b| b.len() == SPARES / 2));
        // The making thread's list is empty: its next record comes from a depot batch, a box
        // the other thread dropped.
        assert_eq!(Passed::with_spares(|s| s.len()), Some(0));
        let again = Record::new(Passed);
        assert!(addrs.contains(&again.ptr), "a box from the depot");
        assert_eq!(Passed::with_spares(|s| s.len()), Some(SPARES / 2 - 1));
        assert_eq!(lock_depot::<Passed>().len(), 1);
        drop(again);
    }

    /// Only this test makes and drops `Kept` records; each keeps its clone of a token.
    struct Kept(Option<Arc<()>>);
    recycle_per_thread!(Kept, Arc<()>, |k: &mut Kept| k.0.take());

    #[test]
    fn forgetting_takes_the_picked_values_out_of_the_depots_boxes() {
        let (a, b) = (Arc::new(()), Arc::new(()));
        std::thread::spawn({
            let (a, b) = (a.clone(), b.clone());
            move || {
                // 200 records: the thread's list keeps 64, the rest go to the depot.
                let made: Vec<_> = (0..200)
                    .map(|i| {
                        Record::new(Kept(Some(if i % 2 == 0 { a.clone() } else { b.clone() })))
                    })
                    .collect();
                drop(made);
            }
        })
        .join()
        .expect("the dropping thread");
        // The thread's own list went with it; the depot's boxes keep their clones.
        let in_depot = |t: &Arc<()>| depot_keeps::<Kept>(|k| Arc::ptr_eq(k, t));
        assert_eq!(Arc::strong_count(&a), 1 + in_depot(&a));
        assert!(in_depot(&a) > 0 && in_depot(&b) > 0);
        let boxes = lock_depot::<Kept>().iter().map(Vec::len).sum::<usize>();
        forget_kept::<Kept>(|k| Arc::ptr_eq(k, &a));
        assert_eq!(Arc::strong_count(&a), 1, "every clone of a let go");
        assert_eq!(in_depot(&a), 0);
        assert!(in_depot(&b) > 0, "b's clones stay");
        assert_eq!(Arc::strong_count(&b), 1 + in_depot(&b));
        let after = lock_depot::<Kept>().iter().map(Vec::len).sum::<usize>();
        assert_eq!(after, boxes, "the boxes stay");
    }

    /// Only this test makes and drops `Bounded` records.
    struct Bounded;
    recycle_per_thread!(Bounded, (), |_: &mut Bounded| None);

    #[test]
    #[cfg_attr(
        miri,
        ignore = "its 32 768 boxes take about 2.5 minutes under Miri; the spares' unsafe code is \
                  covered there by the other tests"
    )]
    fn the_depot_keeps_at_most_its_bound_and_frees_the_rest() {
        // A thread drops more boxes than its list and the depot keep: batches beyond
        // DEPOT_BATCHES are freed, not kept.
        std::thread::spawn(|| {
            let many: Vec<_> = (0..SPARES * DEPOT_BATCHES)
                .map(|_| Record::new(Bounded))
                .collect();
            drop(many);
        })
        .join()
        .expect("a thread that drops many");
        assert_eq!(lock_depot::<Bounded>().len(), DEPOT_BATCHES);
        assert!(
            lock_depot::<Bounded>()
                .iter()
                .all(|b| b.len() == SPARES / 2)
        );
    }
}

/// loom models of the count: run with the crate's loom models (see `loom_models.rs`).
#[cfg(all(test, emm_loom))]
mod loom_models {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicUsize as LoomAtomic;

    /// Read by owners on several threads, written by its drop: loom reports the drop if it is
    /// not ordered after every read (a decrement or fence too weak, or the unique-owner fast
    /// path taken while another owner lives).
    struct Probe {
        cell: UnsafeCell<u64>,
        drops: Arc<LoomAtomic>,
    }
    impl Drop for Probe {
        fn drop(&mut self) {
            self.cell.with_mut(|v| {
                // SAFETY: loom checks this access against the owners' reads.
                unsafe { *v = 0 }
            });
            self.drops.fetch_add(1, Ordering::Relaxed);
        }
    }
    // SAFETY: the probe's cell is only read through shared owners and written in `drop`, which
    // the count orders after them; loom checks exactly that.
    unsafe impl Sync for Probe {}
    recycle_per_thread!(Probe, (), |_: &mut Probe| None);

    #[test]
    fn loom_models_record_drops_its_value_once_after_every_owner() {
        loom::model(|| {
            let drops = Arc::new(LoomAtomic::new(0));
            let r = Record::new(Probe {
                cell: UnsafeCell::new(7),
                drops: drops.clone(),
            });
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let r = r.clone();
                    loom::thread::spawn(move || {
                        // SAFETY: a read; loom checks it against the drop's write.
                        let v = r.cell.with(|v| unsafe { *v });
                        assert_eq!(v, 7);
                    })
                })
                .collect();
            drop(r);
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(drops.load(Ordering::Relaxed), 1);
        });
    }
}
