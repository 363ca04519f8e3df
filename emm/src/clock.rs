//! A cheap timestamp for events on hot paths ([`stamp`]), and its conversion to wall-clock
//! time ([`to_unix_us`]). On x86-64 a stamp is the time-stamp counter (one instruction; the
//! counter runs at a constant rate on the CPUs CUDA supports, and is synchronised across
//! cores); elsewhere, and under Miri and loom, nanoseconds since the first stamp.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch, now (0 on a clock set before it).
pub(crate) fn unix_now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The first reading: (stamp, instant, microseconds since the Unix epoch).
fn origin() -> &'static (u64, Instant, u64) {
    static ORIGIN: OnceLock<(u64, Instant, u64)> = OnceLock::new();
    ORIGIN.get_or_init(|| {
        let now = Instant::now();
        (raw(now), now, unix_now_us())
    })
}

#[cfg(all(target_arch = "x86_64", not(miri), not(emm_loom)))]
#[inline(always)]
fn raw(_now: Instant) -> u64 {
    counter()
}

#[cfg(all(target_arch = "x86_64", not(miri), not(emm_loom)))]
#[inline(always)]
#[allow(unsafe_code)]
fn counter() -> u64 {
    // SAFETY: `rdtsc` reads the time-stamp counter; it has no operands and no preconditions
    // on x86-64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(all(target_arch = "x86_64", not(miri), not(emm_loom))))]
fn raw(now: Instant) -> u64 {
    let origin = *ORIGIN_INSTANT.get_or_init(|| now);
    now.saturating_duration_since(origin).as_nanos() as u64
}

#[cfg(not(all(target_arch = "x86_64", not(miri), not(emm_loom))))]
static ORIGIN_INSTANT: OnceLock<Instant> = OnceLock::new();

/// A timestamp for an event: comparable with every other stamp of the process, convertible
/// with [`to_unix_us`].
#[inline(always)]
pub(crate) fn stamp() -> u64 {
    #[cfg(all(target_arch = "x86_64", not(miri), not(emm_loom)))]
    {
        counter()
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri), not(emm_loom))))]
    {
        raw(Instant::now())
    }
}

/// Converts stamps to microseconds since the Unix epoch: a closure that measures the stamp's
/// rate once (between the first stamp and now) and then maps each stamp.
pub(crate) fn to_unix_us() -> impl Fn(u64) -> u64 {
    let &(stamp0, instant0, unix0) = origin();
    let now = Instant::now();
    let stamp_now = stamp();
    let elapsed_ns = now.duration_since(instant0).as_nanos() as f64;
    let ticks = stamp_now.saturating_sub(stamp0) as f64;
    // Ticks per nanosecond (1 where no time passed yet).
    let rate = if elapsed_ns > 0.0 && ticks > 0.0 {
        ticks / elapsed_ns
    } else {
        1.0
    };
    move |s: u64| {
        let ns = (s as f64 - stamp0 as f64) / rate;
        (unix0 as f64 + ns / 1000.0).max(0.0) as u64
    }
}

/// Starts the clock (the origin its conversion measures from); call before the first stamp
/// whose time matters.
pub(crate) fn start() {
    origin();
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "the conversion measures the clock's rate between two readings taken one call apart, which Miri's interpretation stretches to milliseconds; under Miri a stamp is an Instant, with no unsafe code to check; the native run checks the conversion"
    )]
    fn stamps_convert_to_wall_clock_time_in_order() {
        start();
        let a = stamp();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let b = stamp();
        assert!(b > a);
        let convert = to_unix_us();
        let (ua, ub) = (convert(a), convert(b));
        let unix_now = unix_now_us();
        assert!((15_000..200_000).contains(&(ub - ua)), "{ua} {ub}");
        // The conversion measures the counter's rate between two readings: a stamp maps to
        // within a few microseconds of the time it was read.
        assert!(
            ub <= unix_now + 1_000 && unix_now.saturating_sub(ub) < 1_000_000,
            "{unix_now} {ub}"
        );
    }
}
