//! Array layouts: a shape, strides in bytes and an element size, as Numba's device arrays
//! (and NumPy's) describe memory, with the rules for contiguity, `ravel` and `reshape`.

use crate::ArrayError;

/// The order in which a new array's elements are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// Row-major: the last index varies fastest (`'C'`).
    C,
    /// Column-major: the first index varies fastest (`'F'`).
    F,
}

/// A shape, strides in bytes (possibly negative or zero, as views can make them) and an
/// element size. The first element is at byte offset 0 of the array's memory; the bytes the
/// layout reaches are [`extent`](Layout::extent).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<isize>,
    itemsize: usize,
}

impl Layout {
    /// A contiguous layout of `shape` in `order` for elements of `itemsize` bytes. Refused
    /// when the element count or the byte size overflows (`ShapeOverflow`); zero-sized
    /// dimensions are allowed (the array then holds no element).
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// let l = Layout::contiguous(&[2, 3], Order::C, 8)?;
    /// assert_eq!(l.strides(), &[24, 8]);
    /// assert!(Layout::contiguous(&[usize::MAX, 2], Order::C, 8).is_err()); // overflow
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn contiguous(
        shape: &[usize],
        order: Order,
        itemsize: usize,
    ) -> Result<Layout, ArrayError> {
        let overflow = || ArrayError::ShapeOverflow {
            shape: shape.to_vec(),
            itemsize,
        };
        let mut strides = vec![0isize; shape.len()];
        let mut step = itemsize;
        let dims: Box<dyn Iterator<Item = usize>> = match order {
            Order::C => Box::new((0..shape.len()).rev()),
            Order::F => Box::new(0..shape.len()),
        };
        for d in dims {
            strides[d] = isize::try_from(step).map_err(|_| overflow())?;
            step = step.checked_mul(shape[d].max(1)).ok_or_else(overflow)?;
        }
        // The element count times the item size must fit too (a zero dimension does not
        // excuse an overflow of the others).
        shape
            .iter()
            .try_fold(itemsize, |acc, &n| acc.checked_mul(n.max(1)))
            .filter(|&b| isize::try_from(b).is_ok())
            .ok_or_else(overflow)?;
        Ok(Layout {
            shape: shape.to_vec(),
            strides,
            itemsize,
        })
    }

    /// A layout with the given strides (in bytes), checked for its element count and for the
    /// bytes it reaches, which must fit an `isize` either side of the first element.
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// let l = Layout::with_strides(&[2, 3], &[4, 8], 4)?; // F order, 4-byte elements
    /// assert!(l.is_contiguous(Order::F));
    /// assert!(Layout::with_strides(&[2], &[4, 4], 4).is_err()); // one stride per dimension
    /// assert!(Layout::with_strides(&[3], &[isize::MAX / 2], 4).is_err()); // reaches too far
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_strides(
        shape: &[usize],
        strides: &[isize],
        itemsize: usize,
    ) -> Result<Layout, ArrayError> {
        if shape.len() != strides.len() {
            return Err(ArrayError::Invalid {
                what: "strides",
                reason: format!(
                    "{} strides for a {}-dimensional shape; give one stride per dimension",
                    strides.len(),
                    shape.len()
                ),
            });
        }
        Layout::contiguous(shape, Order::C, itemsize)?;
        if reach(shape, strides, itemsize).is_none() {
            return Err(ArrayError::Invalid {
                what: "strides",
                reason: format!(
                    "strides {strides:?} over shape {shape:?} reach more than isize::MAX bytes \
                     from the first element; no array spans that much memory"
                ),
            });
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            itemsize,
        })
    }

    /// The shape.
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// assert_eq!(Layout::contiguous(&[4, 1], Order::C, 2)?.shape(), &[4, 1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in bytes.
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// assert_eq!(Layout::contiguous(&[4, 5], Order::F, 2)?.strides(), &[2, 8]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    /// Bytes per element.
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// assert_eq!(Layout::contiguous(&[4], Order::C, 2)?.itemsize(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn itemsize(&self) -> usize {
        self.itemsize
    }

    /// Number of dimensions.
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// assert_eq!(Layout::contiguous(&[], Order::C, 2)?.ndim(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (1 for a 0-dimensional array).
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// assert_eq!(Layout::contiguous(&[], Order::C, 2)?.size(), 1); // a 0-dimensional array holds one element
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes the elements take (`size * itemsize`).
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// assert_eq!(Layout::contiguous(&[3, 3], Order::C, 4)?.nbytes(), 36);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn nbytes(&self) -> usize {
        self.size() * self.itemsize
    }

    /// The byte offsets the layout reaches, relative to its first element: `lo..hi` (empty
    /// for an array without elements).
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// let (_, rows) = Layout::contiguous(&[4, 3], Order::C, 4)?.slice_first(1, 3)?;
    /// assert_eq!(rows.extent(), (0, 24));
    /// assert_eq!(Layout::contiguous(&[0], Order::C, 4)?.extent(), (0, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn extent(&self) -> (isize, isize) {
        reach(&self.shape, &self.strides, self.itemsize)
            .expect("every constructor keeps a layout's reach within isize")
    }

    /// Whether the elements are contiguous in `order`. Dimensions of length 1 do not count,
    /// and an array without elements is contiguous in both orders (Numba's and NumPy's rule).
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// let l = Layout::contiguous(&[1, 5], Order::C, 4)?;
    /// assert!(l.is_contiguous(Order::C) && l.is_contiguous(Order::F)); // length-1 dimensions do not count
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_contiguous(&self, order: Order) -> bool {
        if self.size() == 0 {
            return true;
        }
        let mut expected = self.itemsize as isize;
        let dims: Box<dyn Iterator<Item = usize>> = match order {
            Order::C => Box::new((0..self.ndim()).rev()),
            Order::F => Box::new(0..self.ndim()),
        };
        for d in dims {
            if self.shape[d] == 1 {
                continue;
            }
            if self.strides[d] != expected {
                return false;
            }
            expected *= self.shape[d] as isize;
        }
        true
    }

    /// The layout `shape` gives the same elements in `order` (`-1` is not accepted: give every
    /// length). A view is possible when the array is contiguous in `order`; otherwise the
    /// reshape needs a copy, which is refused (as Numba refuses it on device arrays).
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// let l = Layout::contiguous(&[2, 6], Order::C, 4)?;
    /// assert_eq!(l.reshape(&[3, 4], Order::C)?.strides(), &[16, 4]);
    /// assert!(l.reshape(&[5], Order::C).is_err()); // another element count
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reshape(&self, shape: &[usize], order: Order) -> Result<Layout, ArrayError> {
        let wanted = Layout::contiguous(shape, order, self.itemsize)?;
        if wanted.size() != self.size() {
            return Err(ArrayError::Invalid {
                what: "reshape",
                reason: format!(
                    "cannot reshape {} elements ({:?}) into {:?} ({} elements); the element \
                     counts must match",
                    self.size(),
                    self.shape,
                    shape,
                    wanted.size()
                ),
            });
        }
        if self.shape == shape {
            return Ok(self.clone());
        }
        if !self.is_contiguous(order) {
            return Err(ArrayError::NeedsCopy {
                what: "reshape",
                order,
            });
        }
        Ok(wanted)
    }

    /// The one-dimensional layout of the elements in `order`: a view of a contiguous array,
    /// refused (it would need a copy) otherwise.
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// let f = Layout::contiguous(&[2, 6], Order::F, 4)?;
    /// assert_eq!(f.ravel(Order::F)?.shape(), &[12]);
    /// assert!(f.ravel(Order::C).is_err()); // would need a copy
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn ravel(&self, order: Order) -> Result<Layout, ArrayError> {
        if !self.is_contiguous(order) {
            return Err(ArrayError::NeedsCopy {
                what: "ravel",
                order,
            });
        }
        Layout::contiguous(&[self.size()], order, self.itemsize)
    }

    /// Rows `start..stop` along the first axis: the byte offset of the first and the layout.
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// let (offset, rows) = Layout::contiguous(&[4, 3], Order::C, 4)?.slice_first(1, 3)?;
    /// assert_eq!((offset, rows.shape()), (12, &[2, 3][..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn slice_first(&self, start: usize, stop: usize) -> Result<(isize, Layout), ArrayError> {
        let Some(&n) = self.shape.first() else {
            return Err(ArrayError::Invalid {
                what: "slice",
                reason: "a 0-dimensional array has no axis to slice".into(),
            });
        };
        if start > stop || stop > n {
            return Err(ArrayError::Invalid {
                what: "slice",
                reason: format!("rows {start}..{stop} of an axis of length {n}"),
            });
        }
        let mut shape = self.shape.clone();
        shape[0] = stop - start;
        let offset = if stop > start {
            self.strides[0] * start as isize
        } else {
            0
        };
        Ok((
            offset,
            Layout {
                shape,
                strides: self.strides.clone(),
                itemsize: self.itemsize,
            },
        ))
    }

    /// The byte offset of the element at `index` (one index per dimension, each in range).
    ///
    /// ```
    /// # use emm_array::{Layout, Order};
    /// assert_eq!(Layout::contiguous(&[4, 3], Order::F, 4)?.offset_of(&[1, 2]), 36);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn offset_of(&self, index: &[usize]) -> isize {
        index
            .iter()
            .zip(&self.strides)
            .map(|(&i, &s)| i as isize * s)
            .sum()
    }
}

/// The byte offsets `strides` over `shape` reach from the first element, `lo..hi` (`(0, 0)`
/// without elements), or `None` when they do not fit an `isize`.
fn reach(shape: &[usize], strides: &[isize], itemsize: usize) -> Option<(isize, isize)> {
    if shape.contains(&0) {
        return Some((0, 0));
    }
    let (mut lo, mut hi) = (0isize, isize::try_from(itemsize).ok()?);
    for (&n, &s) in shape.iter().zip(strides) {
        let far = s.checked_mul(isize::try_from(n).ok()? - 1)?;
        if far < 0 {
            lo = lo.checked_add(far)?;
        } else {
            hi = hi.checked_add(far)?;
        }
    }
    Some((lo, hi))
}
