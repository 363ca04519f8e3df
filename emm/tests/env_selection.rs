//! `EMM_MEMORY_MANAGER` and the deallocation thresholds read from the real environment. One
//! test in its own binary: it changes the process environment, which no other test shares.
#![cfg(not(emm_loom))]
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::{DefaultManager, EmmError, FnFactory, Runtime};

fn set(var: &str, value: Option<&str>) {
    // SAFETY: this binary holds one test, which runs alone on its thread before it starts any
    // other thread; nothing reads the environment concurrently.
    unsafe {
        match value {
            Some(v) => std::env::set_var(var, v),
            None => std::env::remove_var(var),
        }
    }
}

fn sim() -> Arc<SimDriver> {
    Arc::new(SimDriver::new(SimConfig::default()))
}

#[test]
fn the_environment_picks_the_manager_and_the_thresholds() {
    let mine = || {
        FnFactory::new("mine", |cx| {
            Ok(Box::new(DefaultManager::default_manager(cx)))
        })
    };

    set("EMM_MEMORY_MANAGER", Some("mine"));
    let rt = Runtime::builder(sim())
        .register_manager(mine())
        .build()
        .unwrap();
    assert_eq!(rt.context(0).unwrap().memory_manager_name(), "mine");

    // Code wins over the environment (Numba: set_memory_manager before the first context).
    let rt = Runtime::builder(sim())
        .register_manager(mine())
        .memory_manager_name("default")
        .build()
        .unwrap();
    assert_eq!(rt.memory_manager_name(), "default");

    set("EMM_MEMORY_MANAGER", Some("rmm.allocators.numba"));
    let err = Runtime::builder(sim()).build().unwrap_err();
    assert!(matches!(err, EmmError::UnknownManager { .. }), "{err:?}");
    assert!(
        err.to_string().contains("registered managers: default"),
        "{err}"
    );

    set("EMM_MEMORY_MANAGER", Some(""));
    let err = Runtime::builder(sim()).build().unwrap_err();
    assert!(
        err.to_string()
            .starts_with("EMM_MEMORY_MANAGER=\"\" is invalid"),
        "{err}"
    );
    set("EMM_MEMORY_MANAGER", None);

    set("EMM_MAX_PENDING_DEALLOCS_COUNT", Some("3"));
    set("EMM_MAX_PENDING_DEALLOCS_RATIO", Some("0.5"));
    let rt = Runtime::new(sim()).unwrap();
    let config = rt.dealloc_config();
    assert_eq!((config.max_count, config.max_ratio), (3, 0.5));
    let queue = rt.context(0).unwrap().deallocations().unwrap().clone();
    assert_eq!(queue.max_pending_bytes(), (1 << 30) / 2);

    set("EMM_MAX_PENDING_DEALLOCS_RATIO", Some("NaN"));
    let err = Runtime::new(sim()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("EMM_MAX_PENDING_DEALLOCS_RATIO=\"NaN\" is invalid"),
        "{err}"
    );
    set("EMM_MAX_PENDING_DEALLOCS_COUNT", None);
    set("EMM_MAX_PENDING_DEALLOCS_RATIO", None);

    // `ignore_env` builds the defaults whatever is set.
    set("EMM_MEMORY_MANAGER", Some("nonsense"));
    assert!(Runtime::builder(sim()).ignore_env().build().is_ok());
    set("EMM_MEMORY_MANAGER", None);
}
