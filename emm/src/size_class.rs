//! Size classes shared by the `pool` manager and the pinned host pool: multiples of
//! [`ALIGNMENT`], four classes per doubling, so a request is rounded up by at most a quarter.
//!
//! Classes 0 to 3 are 256, 512, 768 and 1024 bytes; from there each doubling `[2^e, 2^(e+1))`
//! units holds four classes, `5, 6, 7, 8 × 2^(e-2)` units.

/// Alignment and granularity of every block: 256 bytes, as `cuMemAlloc`'s.
pub const ALIGNMENT: usize = 256;

/// The class of a request of `bytes` (at least 1).
///
/// With `u` the request's units less one (`units = u + 1`) and `e` the top bit of `u`, a
/// request of more than four units lies in the doubling `(2^e, 2^(e+1)]`, whose four classes
/// step by `2^(e-2)` units; its class is `4 (e - 2)` plus the number of steps `u` covers,
/// `u >> (e - 2)` (4 to 7). Setting bit 2 of `u` before finding its top bit makes `e` at
/// least 2, which gives the first four classes (`u` = 0 to 3) the same formula: no branch,
/// no division (both pools work a class out on every allocation).
#[inline]
pub(crate) fn class_of(bytes: usize) -> usize {
    debug_assert!(bytes >= 1);
    let u = (bytes - 1) / ALIGNMENT;
    let shift = (usize::BITS - 1 - (u | 4).leading_zeros()) as usize - 2;
    4 * shift + (u >> shift)
}

/// The block size of class `class`.
#[inline]
pub(crate) fn class_size(class: usize) -> usize {
    // A load instead of the arithmetic: both pools work it out on every allocation and free.
    SIZES[class]
}

/// The classes a `usize` request can reach (the last holds requests near `usize::MAX`).
pub(crate) const CLASS_COUNT: usize = 4 + 4 * (usize::BITS as usize - 10);

/// Every class's block size, worked out at compile time.
static SIZES: [usize; CLASS_COUNT] = {
    let mut sizes = [0; CLASS_COUNT];
    let mut class = 0;
    while class < CLASS_COUNT {
        sizes[class] = size_of_class(class);
        class += 1;
    }
    sizes
};

/// The block size of class `class`, computed (saturating for classes past `usize`'s range).
const fn size_of_class(class: usize) -> usize {
    if class < 4 {
        return (class + 1) * ALIGNMENT;
    }
    let e = (class - 4) / 4 + 2;
    let m = (class - 4) % 4 + 5;
    match (m << (e - 2)).checked_mul(ALIGNMENT) {
        Some(size) => size,
        None => usize::MAX,
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;

    /// A request of `bytes` rounded up to its class's block size (0 rounds up to one unit).
    fn round_up(bytes: usize) -> usize {
        class_size(class_of(bytes.max(1)))
    }

    #[test]
    fn classes_round_up_by_at_most_a_quarter() {
        for bytes in (1..5_000)
            .chain((1 << 20) - 3..(1 << 20) + 3)
            .chain([64 << 20])
        {
            let c = round_up(bytes);
            assert!(c >= bytes && c.is_multiple_of(ALIGNMENT), "{bytes} -> {c}");
            assert!(c - bytes <= bytes / 4 + ALIGNMENT, "{bytes} -> {c}");
        }
    }

    #[test]
    fn the_table_covers_every_request() {
        let top = class_of(usize::MAX);
        assert_eq!(top, CLASS_COUNT - 1);
        assert_eq!(class_size(top), usize::MAX, "saturated: 2^64 bytes");
        assert_eq!(class_size(top - 1), 7 << 61);
    }

    /// The class a request belongs to by definition: the smallest whose blocks hold it.
    fn smallest_class_holding(bytes: usize) -> usize {
        SIZES.partition_point(|&size| size < bytes)
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "arithmetic without unsafe code, which Miri has nothing to check in: its 70 000 \
                  requests took 173 s of the CI job's Miri step; the native run covers it"
    )]
    fn every_class_is_the_smallest_that_holds_the_request() {
        let edges = (0..CLASS_COUNT)
            .map(class_size)
            .flat_map(|s| [s.saturating_sub(1), s, s.saturating_add(1)]);
        for bytes in (1..70_000).chain(edges).filter(|&b| b >= 1) {
            assert_eq!(
                class_of(bytes),
                smallest_class_holding(bytes),
                "{bytes} bytes"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn any_request_gets_the_smallest_class_that_holds_it(bytes in 1..=usize::MAX) {
            proptest::prop_assert_eq!(class_of(bytes), smallest_class_holding(bytes));
        }
    }

    #[test]
    fn class_sizes_increase_and_invert() {
        for class in 0..60 {
            assert!(class_size(class) < class_size(class + 1));
            assert_eq!(class_of(class_size(class)), class);
        }
    }
}
