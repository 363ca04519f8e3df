//! Environment configuration: `EMM_MEMORY_MANAGER`, `EMM_MAX_PENDING_DEALLOCS_COUNT` and
//! `_RATIO` with any value (negative, NaN, empty, huge, garbage): a configuration or a clear
//! error naming the variable, never a panic, never a silent default.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\u{1f}');
    let (count, ratio, name) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let lookup = |var: &str| match var {
        emm::internals::config::ENV_MAX_PENDING_COUNT => Some(count.clone()),
        emm::internals::config::ENV_MAX_PENDING_RATIO => Some(ratio.clone()),
        emm::internals::config::ENV_MEMORY_MANAGER => Some(name.clone()),
        _ => None,
    };
    match emm::plugin::DeallocConfig::from_lookup(lookup) {
        Ok(c) => {
            assert_eq!(Some(c.max_count), count.trim().parse::<usize>().ok());
            assert!(c.max_ratio.is_finite() && c.max_ratio >= 0.0);
            let _ = c.max_pending_bytes(usize::MAX);
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("EMM_MAX_PENDING_DEALLOCS_"), "{msg}");
        }
    }
    match emm::internals::config::manager_name_from_lookup(lookup) {
        Ok(Some(n)) => assert_eq!(n, name.trim()),
        Ok(None) => unreachable!("the variable is set"),
        Err(e) => {
            assert!(name.trim().is_empty() && e.to_string().starts_with("EMM_MEMORY_MANAGER"))
        }
    }
});
