//! Size classes shared by the `pool` manager and the pinned host pool: multiples of
//! [`ALIGNMENT`], four classes per doubling, so a request is rounded up by at most a quarter.
//!
//! Classes 0 to 3 are 256, 512, 768 and 1024 bytes; from there each doubling `[2^e, 2^(e+1))`
//! units holds four classes, `5, 6, 7, 8 × 2^(e-2)` units.

/// Alignment and granularity of every block: 256 bytes, as `cuMemAlloc`'s.
pub const ALIGNMENT: usize = 256;

/// The class of a request of `bytes` (at least 1).
pub(crate) fn class_of(bytes: usize) -> usize {
    debug_assert!(bytes >= 1);
    let units = bytes.div_ceil(ALIGNMENT).max(1);
    if units <= 4 {
        return units - 1;
    }
    let e = (usize::BITS - 1 - (units - 1).leading_zeros()) as usize;
    let step = 1usize << (e - 2);
    4 + (e - 2) * 4 + (units.div_ceil(step) - 5)
}

/// The block size of class `class`.
#[inline]
pub(crate) fn class_size(class: usize) -> usize {
    // A load instead of the arithmetic: both pools work it out on every allocation and free.
    SIZES[class]
}

/// The classes a `usize` request can reach (the last holds requests near `usize::MAX`).
const CLASS_COUNT: usize = 4 + 4 * (usize::BITS as usize - 10);

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

/// A request of `bytes` rounded up to its class's block size (0 rounds up to one unit).
pub(crate) fn round_up(bytes: usize) -> usize {
    class_size(class_of(bytes.max(1)))
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;

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

    #[test]
    fn class_sizes_increase_and_invert() {
        for class in 0..60 {
            assert!(class_size(class) < class_size(class + 1));
            assert_eq!(class_of(class_size(class)), class);
        }
    }
}
