//! Typed arrays on the simulator: property tests of layouts and copies against a reference
//! model that enumerates every element's byte offset (sharing no code with the layout rules),
//! and the errors of bad input.
//!
//! 256 cases per property; `PROPTEST_CASES=N` for more.

use std::sync::Arc;

use driver_mock::SimDriver;
use emm_array::{ArrayError, DeviceArray, Layout, Order};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn runtime() -> (Arc<SimDriver>, emm::Runtime) {
    let sim = Arc::new(SimDriver::new(Default::default()));
    let rt = emm::Runtime::builder(sim.clone())
        .ignore_env()
        .build()
        .unwrap();
    (sim, rt)
}

/// Every index of `shape`, in `order` (the reference enumeration).
fn indices(shape: &[usize], order: Order) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    for mut k in 0..n {
        let mut idx = vec![0; shape.len()];
        let dims: Vec<usize> = match order {
            Order::C => (0..shape.len()).rev().collect(),
            Order::F => (0..shape.len()).collect(),
        };
        for d in dims {
            idx[d] = k % shape[d];
            k /= shape[d];
        }
        out.push(idx);
    }
    out
}

/// The reference contiguity: the offsets of the elements, enumerated in `order`, are
/// 0, itemsize, 2 * itemsize, ...
fn contiguous_ref(layout: &Layout, order: Order) -> bool {
    indices(layout.shape(), order)
        .iter()
        .enumerate()
        .all(|(k, idx)| layout.offset_of(idx) == (k * layout.itemsize()) as isize)
}

fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..5, 0..4)
}

fn order() -> impl Strategy<Value = Order> {
    prop_oneof![Just(Order::C), Just(Order::F)]
}

/// The factorisations of `n` into `dims` factors, one of them picked by `pick`.
fn factor(n: usize, dims: usize, mut pick: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(dims);
    let mut rest = n;
    for d in 0..dims {
        if d + 1 == dims {
            out.push(rest);
            break;
        }
        let divisors: Vec<usize> = (1..=rest.max(1))
            .filter(|x| rest.is_multiple_of(*x))
            .collect();
        let f = if rest == 0 {
            [0, 1, 2][(pick % 3) as usize]
        } else {
            divisors[(pick as usize) % divisors.len()]
        };
        pick /= 7;
        out.push(f);
        rest = rest.checked_div(f).unwrap_or(0);
    }
    if dims == 0 && n != 1 {
        return vec![n];
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// A new array's layout is contiguous in its order (and the reference agrees in both
    /// orders); host → device → host is exact; nothing leaks.
    #[test]
    fn round_trips_are_exact(shape in shape(), order in order(), seed in any::<u32>()) {
        let (sim, rt) = runtime();
        let ctx = rt.context(0).unwrap();
        let n: usize = shape.iter().product();
        let host: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761).wrapping_add(seed)).collect();
        let a = DeviceArray::to_device(&ctx, &host, &shape, order).unwrap();
        for o in [Order::C, Order::F] {
            prop_assert_eq!(a.layout().is_contiguous(o), contiguous_ref(a.layout(), o), "{:?} {:?}", shape, o);
        }
        prop_assert!(a.layout().is_contiguous(order));
        prop_assert_eq!(a.copy_to_host_vec(&ctx).unwrap(), host.clone());
        prop_assert_eq!(a.memory().is_none(), n == 0, "no allocation without elements");
        let b = DeviceArray::like(&ctx, &a).unwrap();
        b.copy_to_device(&ctx, &a).unwrap();
        prop_assert_eq!(b.copy_to_host_vec(&ctx).unwrap(), host);
        drop((a, b));
        ctx.flush_deallocations().unwrap();
        drop(ctx);
        drop(rt);
        prop_assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
    }

    /// `reshape` and `ravel` in the array's own order are views that keep the elements in
    /// that order; in the other order they are allowed exactly when the reference says the
    /// array is contiguous in it, and refused as needing a copy otherwise.
    #[test]
    fn reshape_and_ravel_follow_the_reference(shape in shape(), order in order(), dims in 0usize..4, pick in any::<u64>()) {
        let (_sim, rt) = runtime();
        let ctx = rt.context(0).unwrap();
        let n: usize = shape.iter().product();
        let host: Vec<u16> = (0..n as u16).collect();
        let a = DeviceArray::to_device(&ctx, &host, &shape, order).unwrap();
        let target = factor(n, dims, pick);
        prop_assert_eq!(target.iter().product::<usize>(), n);
        for o in [Order::C, Order::F] {
            let r = a.reshape_in(&target, o);
            if o == order || contiguous_ref(a.layout(), o) || a.shape() == target.as_slice() {
                let r = r.unwrap();
                prop_assert!(r.layout().is_contiguous(o) || r.shape() == a.shape());
                if o == order {
                    prop_assert_eq!(r.copy_to_host_vec(&ctx).unwrap(), host.clone());
                }
                prop_assert_eq!(r.memory().map(|m| m.device_ptr()), a.memory().map(|m| m.device_ptr()), "a view");
            } else {
                let refused = matches!(r, Err(ArrayError::NeedsCopy { what: "reshape", .. }));
                prop_assert!(refused, "reshape needing a copy");
            }
        }
        let flat = a.ravel();
        if contiguous_ref(a.layout(), Order::C) {
            let flat = flat.unwrap();
            prop_assert_eq!(flat.shape(), &[n][..]);
        } else {
            let refused = matches!(flat, Err(ArrayError::NeedsCopy { what: "ravel", .. }));
            prop_assert!(refused, "ravel of a non-contiguous array");
        }
    }

    /// Slices along the first axis hold the reference's elements (for C arrays, the rows'
    /// elements; any slice's contiguity agrees with the reference), and outlive the array
    /// they came from.
    #[test]
    fn first_axis_slices(shape in prop::collection::vec(0usize..5, 1..4), order in order(), a0 in 0usize..5, a1 in 0usize..5) {
        let (sim, rt) = runtime();
        let ctx = rt.context(0).unwrap();
        let n: usize = shape.iter().product();
        let host: Vec<u8> = (0..n).map(|i| i as u8).collect();
        let a = DeviceArray::to_device(&ctx, &host, &shape, order).unwrap();
        let (lo, hi) = (a0.min(a1).min(shape[0]), a0.max(a1).min(shape[0]));
        let s = a.slice(lo, hi).unwrap();
        prop_assert_eq!(s.shape()[0], hi - lo);
        for o in [Order::C, Order::F] {
            prop_assert_eq!(s.layout().is_contiguous(o), contiguous_ref(s.layout(), o));
        }
        drop(a);
        if order == Order::C {
            let row: usize = shape[1..].iter().product();
            prop_assert_eq!(s.copy_to_host_vec(&ctx).unwrap(), host[lo * row..hi * row].to_vec());
        } else if !(s.is_c_contiguous() || s.is_f_contiguous()) {
            let refused = matches!(s.copy_to_host_vec(&ctx), Err(ArrayError::NeedsCopy { .. }));
            prop_assert!(refused, "a copy of a non-contiguous slice");
        }
        prop_assert!(a0.max(a1) <= shape[0] || s.shape()[0] <= shape[0]);
        drop(s);
        ctx.flush_deallocations().unwrap();
        drop(ctx);
        drop(rt);
        prop_assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
    }
}

/// Bad input gets an error that says what to do, never a crash: an overflowing shape, a host
/// slice of the wrong length, a reshape to another element count, a slice out of range, a
/// copy between arrays of different layouts.
#[test]
fn bad_input_is_refused_clearly() {
    let (_sim, rt) = runtime();
    let ctx = rt.context(0).unwrap();
    let e = DeviceArray::<u64>::new(&ctx, &[usize::MAX / 2, 4], Order::C).unwrap_err();
    assert!(matches!(e, ArrayError::ShapeOverflow { .. }), "{e}");
    assert!(e.to_string().contains("smaller shape"), "{e}");
    let e = DeviceArray::to_device(&ctx, &[1u8, 2, 3], &[2, 2], Order::C).unwrap_err();
    assert!(
        matches!(
            e,
            ArrayError::HostLength {
                got: 3,
                expected: 4
            }
        ),
        "{e}"
    );
    let a = DeviceArray::<f32>::new(&ctx, &[2, 3], Order::C).unwrap();
    let e = a.reshape(&[4, 2]).unwrap_err();
    assert!(e.to_string().contains("element counts must match"), "{e}");
    let e = a.slice(1, 3).unwrap_err();
    assert!(e.to_string().contains("rows 1..3"), "{e}");
    let b = DeviceArray::<f32>::new(&ctx, &[3, 2], Order::C).unwrap();
    let e = b.copy_to_device(&ctx, &a).unwrap_err();
    assert!(e.to_string().contains("shape or strides"), "{e}");
    let f = DeviceArray::<f32>::new(&ctx, &[2, 3], Order::F).unwrap();
    let e = f.reshape(&[3, 2]).unwrap_err();
    assert!(matches!(e, ArrayError::NeedsCopy { .. }), "{e}");
    assert!(
        e.to_string().contains("copy it into a contiguous array"),
        "{e}"
    );
    let zero = DeviceArray::<f64>::new(&ctx, &[0, 5], Order::C).unwrap();
    assert!(zero.memory().is_none() && zero.copy_to_host_vec(&ctx).unwrap().is_empty());
}

/// Copies on a stream: pageable memory in the stream's order, and page-locked memory
/// asynchronously, handed back by `wait` with the array's bytes.
#[test]
fn copies_on_a_stream() {
    let (_sim, rt) = runtime();
    let ctx = rt.context(0).unwrap();
    let s = ctx.create_stream().unwrap();
    let host: Vec<f64> = (0..24).map(f64::from).collect();
    let a = DeviceArray::<f64>::new(&ctx, &[4, 6], Order::F).unwrap();
    a.copy_from_host_on(&ctx, &host, &s).unwrap();
    let mut back = vec![0f64; 24];
    a.copy_to_host_on(&ctx, &mut back, &s).unwrap();
    assert_eq!(back, host);
    let pinned = ctx.memhostalloc(a.nbytes(), false, false, false).unwrap();
    let pinned = a
        .copy_to_pinned_async(&ctx, pinned, &s)
        .unwrap()
        .wait()
        .unwrap();
    let mut bytes = vec![0u8; a.nbytes()];
    pinned.read(0, &mut bytes).unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, f64>(&bytes), &host[..]);
    let b = DeviceArray::<f64>::like(&ctx, &a).unwrap();
    let pinned = b
        .copy_from_pinned_async(&ctx, pinned, &s)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(b.copy_to_host_vec(&ctx).unwrap(), host);
    let short = ctx.memhostalloc(8, false, false, false).unwrap();
    assert!(
        b.copy_from_pinned_async(&ctx, short, &s).is_err(),
        "a short source"
    );
    drop(pinned);
}

/// Host arrays: pinned (read and written by copy, no device view), mapped and managed (the
/// device view reaches the same bytes, both ways); the wrong length is refused; an array
/// without elements takes no allocation.
#[test]
fn host_arrays() {
    use emm_array::HostArray;
    let (sim, rt) = runtime();
    let ctx = rt.context(0).unwrap();
    let data: Vec<i32> = (0..12).map(|i| i * 3 - 7).collect();
    let pinned = HostArray::<i32>::pinned(&ctx, &[3, 4], Order::C).unwrap();
    pinned.write(&data).unwrap();
    assert_eq!(pinned.read().unwrap(), data);
    assert!(pinned.device_view().is_err(), "not mapped");
    assert!(matches!(
        pinned.write(&data[1..]),
        Err(ArrayError::HostLength {
            got: 11,
            expected: 12
        })
    ));
    for array in [
        HostArray::<i32>::mapped(&ctx, &[3, 4], Order::F).unwrap(),
        HostArray::<i32>::managed(&ctx, &[3, 4], Order::F).unwrap(),
    ] {
        array.write(&data).unwrap();
        let dev = array.device_view().unwrap();
        assert!(dev.is_f_contiguous());
        assert_eq!(dev.copy_to_host_vec(&ctx).unwrap(), data);
        let twice: Vec<i32> = data.iter().map(|x| x * 2).collect();
        dev.copy_from_host(&ctx, &twice).unwrap();
        assert_eq!(array.read().unwrap(), twice);
    }
    let empty = HostArray::<u8>::mapped(&ctx, &[0], Order::C).unwrap();
    assert!(empty.host_memory().is_none() && empty.read().unwrap().is_empty());
    drop((pinned, empty));
    ctx.flush_deallocations().unwrap();
    drop(ctx);
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}

/// The scoped pin: the slice is registered with the driver only inside the scope (also when
/// the scope returns an error), copies run through it both ways, and an empty slice is
/// refused.
#[test]
fn scoped_pins() {
    use emm_array::with_pinned;
    let (sim, rt) = runtime();
    let ctx = rt.context(0).unwrap();
    let dev = DeviceArray::<u16>::new(&ctx, &[64], Order::C).unwrap();
    let mut host: Vec<u16> = (0..64).collect();
    let inside = with_pinned(&ctx, &mut host, |p| {
        p.copy_to_device(&ctx, &dev).unwrap();
        p.as_mut_slice().fill(9);
        p.copy_from_device(&ctx, &dev).unwrap();
        sim.count(driver_mock::Op::MemHostRegister)
    })
    .unwrap();
    assert_eq!(inside, 1);
    assert_eq!(
        sim.count(driver_mock::Op::MemHostUnregister),
        1,
        "unpinned at the scope's end"
    );
    assert_eq!(host, (0..64).collect::<Vec<u16>>());
    let failed: Result<(), ArrayError> = with_pinned(&ctx, &mut host, |p| {
        p.copy_to_device(
            &ctx,
            &DeviceArray::<u16>::new(&ctx, &[3], Order::C).unwrap(),
        )
    })
    .unwrap();
    assert!(matches!(failed, Err(ArrayError::HostLength { .. })));
    assert_eq!(sim.count(driver_mock::Op::MemHostUnregister), 2);
    let mut empty: Vec<u16> = Vec::new();
    assert!(with_pinned(&ctx, &mut empty, |_| ()).is_err());
}
