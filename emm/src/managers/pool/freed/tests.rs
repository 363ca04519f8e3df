use std::collections::HashMap;

use driver_sys::StreamHandle;
use proptest::prelude::*;

use super::FreedRanges;
use crate::test_config::proptest_config;

const UNIT: u64 = 256;
const BASE: u64 = 1 << 30;

/// A made-up stream handle: these tests compare handles and never give one to a driver.
#[allow(unsafe_code)]
fn stream(k: u8) -> StreamHandle {
    // SAFETY: the handle is only compared and hashed, never used as a stream.
    unsafe { StreamHandle::from_raw(0x1000 * (u64::from(k) + 1)) }
}

#[test]
fn a_stream_waits_only_for_others_and_only_once_ordered() {
    let (s, t) = (stream(0), stream(1));
    let mut f = FreedRanges::default();
    f.freed(t, BASE, 1024);
    assert_eq!(f.waits_for(s, BASE, 512), vec![t]);
    assert!(
        f.waits_for(t, BASE, 512).is_empty(),
        "a stream's own frees are ordered"
    );
    f.ordered(s, t);
    assert!(f.waits_for(s, BASE, 1024).is_empty());
    // A free after the order needs another.
    f.freed(t, BASE + 1024, 1024);
    assert!(f.waits_for(s, BASE, 1024).is_empty());
    assert_eq!(f.waits_for(s, BASE + 512, 1024), vec![t]);
}

#[test]
fn a_taken_block_keeps_the_rest_of_a_range() {
    let (s, t) = (stream(0), stream(1));
    let mut f = FreedRanges::default();
    f.freed(t, BASE, 4096);
    f.forget_within(BASE + 1024, 1024);
    assert_eq!(f.len(), 2);
    assert!(f.waits_for(s, BASE + 1024, 1024).is_empty());
    assert_eq!(f.waits_for(s, BASE, 1025), vec![t]);
    assert_eq!(f.waits_for(s, BASE + 2047, 2), vec![t]);
    f.forget_within(BASE, 4096);
    assert!(f.knows(t), "known until a sweep");
    assert_eq!(f.sweep(), vec![t], "t has no range left");
    assert!(!f.knows(t));
}

#[test]
fn an_idle_stream_is_forgotten_with_its_orders() {
    let (s, t) = (stream(0), stream(1));
    let mut f = FreedRanges::default();
    f.freed(t, BASE, 4096);
    f.freed(s, BASE + 4096, 4096);
    f.ordered(s, t);
    f.idle(t);
    assert_eq!(
        f.sweep(),
        vec![t],
        "s stays known: it has a range of its own"
    );
    assert!(f.waits_for(s, BASE, 8192).is_empty());
    // A stream made later with t's handle counts its frees anew: no order of s's covers them.
    f.freed(t, BASE, 256);
    assert_eq!(f.waits_for(s, BASE, 256), vec![t]);
    assert_eq!(f.streams().count(), 2);
}

/// One step of the property test, in units of 256 bytes of a 64-unit space.
#[derive(Clone, Debug)]
enum Op {
    Free { stream: u8, at: u64, units: u64 },
    Take { at: u64, units: u64 },
    Order { stream: u8, after: u8 },
    Idle { stream: u8 },
    Check { stream: u8, at: u64, units: u64 },
    Sweep,
}

fn op() -> impl Strategy<Value = Op> {
    let span = (0u64..64, 1u64..16);
    prop_oneof![
        3 => (0u8..3, span.clone()).prop_map(|(stream, (at, units))| Op::Free { stream, at, units }),
        2 => span.clone().prop_map(|(at, units)| Op::Take { at, units }),
        1 => (0u8..3, 0u8..3).prop_map(|(stream, after)| Op::Order { stream, after }),
        1 => (0u8..3).prop_map(|stream| Op::Idle { stream }),
        3 => (0u8..3, span).prop_map(|(stream, (at, units))| Op::Check { stream, at, units }),
        1 => Just(Op::Sweep),
    ]
}

/// The rules of the module's note, unit by unit: per unit the stream that freed it and that
/// stream's count then; per known stream its count.
#[derive(Default)]
struct Model {
    units: Vec<Option<(u8, u64)>>,
    counts: HashMap<u8, u64>,
    orders: HashMap<(u8, u8), u64>,
}

impl Model {
    /// Forgets `s` once it has no unit and no order, and the orders after it once it has no
    /// unit, adding every stream forgotten to `gone`.
    fn forget_if_unknown(&mut self, s: u8, gone: &mut Vec<u8>) {
        if !self.counts.contains_key(&s) || self.units.iter().flatten().any(|&(t, _)| t == s) {
            return;
        }
        let waiters: Vec<u8> = self
            .orders
            .keys()
            .filter(|k| k.1 == s)
            .map(|k| k.0)
            .collect();
        for w in waiters {
            self.orders.remove(&(w, s));
            self.forget_if_unknown(w, gone);
        }
        if !self.orders.keys().any(|k| k.0 == s) && self.counts.remove(&s).is_some() {
            gone.push(s);
        }
    }

    fn waits_for(&self, s: u8, at: u64, units: u64) -> Vec<u8> {
        let mut out: Vec<u8> = Vec::new();
        for &(t, count) in self.units[at as usize..(at + units) as usize]
            .iter()
            .flatten()
        {
            if t != s && !out.contains(&t) && count > self.orders.get(&(s, t)).copied().unwrap_or(0)
            {
                out.push(t);
            }
        }
        out.sort_unstable();
        out
    }
}

proptest! {
    #![proptest_config(proptest_config())]

    /// The ranges agree with the unit-by-unit rules on every check, whatever the frees,
    /// takes, orders and idle streams before it.
    #[test]
    fn ranges_follow_the_rules_unit_by_unit(ops in proptest::collection::vec(op(), 1..80)) {
        let mut f = FreedRanges::default();
        let mut m = Model { units: vec![None; 80], ..Model::default() };
        let addr = |at: u64| BASE + at * UNIT;
        for op in ops {
            match op {
                Op::Free { stream: s, at, units } => {
                    // Only a block in use is freed: one overlapping a recorded free is taken
                    // first.
                    let range = at as usize..(at + units) as usize;
                    if m.units[range.clone()].iter().any(Option::is_some) {
                        continue;
                    }
                    f.freed(stream(s), addr(at), (units * UNIT) as usize);
                    let count = m.counts.entry(s).or_insert(0);
                    *count += 1;
                    let count = *count;
                    for u in &mut m.units[range] {
                        *u = Some((s, count));
                    }
                }
                Op::Take { at, units } => {
                    f.forget_within(addr(at), (units * UNIT) as usize);
                    for u in &mut m.units[at as usize..(at + units) as usize] {
                        *u = None;
                    }
                }
                Op::Sweep => {
                    let mut gone: Vec<u8> = f
                        .sweep()
                        .into_iter()
                        .map(|h| (0..3).find(|&k| stream(k) == h).unwrap())
                        .collect();
                    gone.sort_unstable();
                    let mut expected = Vec::new();
                    for k in 0..3 {
                        m.forget_if_unknown(k, &mut expected);
                    }
                    expected.sort_unstable();
                    prop_assert_eq!(gone, expected);
                }
                Op::Order { stream: s, after } => {
                    f.ordered(stream(s), stream(after));
                    if s != after && let Some(&count) = m.counts.get(&after) {
                        m.orders.insert((s, after), count);
                        m.counts.entry(s).or_insert(0);
                    }
                }
                Op::Idle { stream: s } => {
                    f.idle(stream(s));
                    for u in &mut m.units {
                        if matches!(u, Some((t, _)) if *t == s) {
                            *u = None;
                        }
                    }
                }
                Op::Check { stream: s, at, units } => {
                    let mut got: Vec<u8> = f
                        .waits_for(stream(s), addr(at), (units * UNIT) as usize)
                        .into_iter()
                        .map(|h| (0..3).find(|&k| stream(k) == h).unwrap())
                        .collect();
                    got.sort_unstable();
                    prop_assert_eq!(got, m.waits_for(s, at, units));
                }
            }
            for k in 0..3 {
                prop_assert_eq!(f.knows(stream(k)), m.counts.contains_key(&k));
            }
        }
    }
}
