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

    /// A layout with the given strides (in bytes), checked only for its element count.
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
        Ok(Layout {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            itemsize,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in bytes.
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    /// Bytes per element.
    pub fn itemsize(&self) -> usize {
        self.itemsize
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (1 for a 0-dimensional array).
    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes the elements take (`size * itemsize`).
    pub fn nbytes(&self) -> usize {
        self.size() * self.itemsize
    }

    /// The byte offsets the layout reaches, relative to its first element: `lo..hi` (empty
    /// for an array without elements).
    pub fn extent(&self) -> (isize, isize) {
        if self.size() == 0 {
            return (0, 0);
        }
        let (mut lo, mut hi) = (0isize, 0isize);
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let far = s * (n as isize - 1);
            if far < 0 {
                lo += far;
            } else {
                hi += far;
            }
        }
        (lo, hi + self.itemsize as isize)
    }

    /// Whether the elements are contiguous in `order`. Dimensions of length 1 do not count,
    /// and an array without elements is contiguous in both orders (Numba's and NumPy's rule).
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
    pub fn offset_of(&self, index: &[usize]) -> isize {
        index
            .iter()
            .zip(&self.strides)
            .map(|(&i, &s)| i as isize * s)
            .sum()
    }
}
