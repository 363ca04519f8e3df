//! `EMM_MEMORY_MANAGER` and the deallocation thresholds read from the real environment. One
//! test in its own binary: it changes the process environment, which no other test shares.
#![cfg(not(emm_loom))]
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::contract::FnFactory;
use emm::plugin::DefaultManager;
use emm::{EmmError, Runtime};

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
        err.to_string().contains(
            "registered managers: async-pool, async-pool-ipc, async-pool-managed, default, pool"
        ),
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

    // Adaptors and the pinned host pool compose with any manager.
    set("EMM_MEMORY_MANAGER", Some("pool"));
    set("EMM_MEMORY_ADAPTORS", Some("stats, limit=1MiB"));
    set("EMM_PINNED_HOST_POOL", Some("64MiB"));
    let rt = Runtime::new(sim()).unwrap();
    assert_eq!(rt.memory_manager_name(), "limit(stats(pool))");
    let ctx = rt.context(0).unwrap();
    let err = ctx.memalloc(2 << 20).unwrap_err();
    assert!(matches!(err, EmmError::OverLimit { .. }), "{err:?}");
    assert!(err.is_out_of_memory());
    assert!(
        err.to_string().contains("over the limit of 1048576 bytes"),
        "{err}"
    );
    let mem = ctx.memalloc(1000).unwrap();
    let host = ctx.memhostalloc(4096, false, false, false).unwrap();
    let usage = ctx.usage().expect("the stats adaptor");
    assert_eq!(
        (usage.device.current_count, usage.device.current_bytes),
        (1, 1000)
    );
    assert_eq!(usage.pinned.current_count, 1);
    let pools = ctx.pool_stats();
    assert!(
        pools.device.is_some() && pools.pinned_host.is_some(),
        "{pools:?}"
    );
    drop((mem, host));
    assert_eq!(ctx.usage().unwrap().device.current_count, 0);
    assert_eq!(ctx.usage().unwrap().device.total_count, 1);

    set("EMM_MEMORY_ADAPTORS", Some("limit=lots"));
    let err = Runtime::new(sim()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("EMM_MEMORY_ADAPTORS=\"limit=lots\" is invalid"),
        "{err}"
    );
    set("EMM_MEMORY_ADAPTORS", Some("cache"));
    let err = Runtime::new(sim()).unwrap_err();
    assert!(err.to_string().contains("unknown adaptor 'cache'"), "{err}");
    set("EMM_PINNED_HOST_POOL", Some("sometimes"));
    set("EMM_MEMORY_ADAPTORS", None);
    let err = Runtime::new(sim()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("EMM_PINNED_HOST_POOL=\"sometimes\" is invalid"),
        "{err}"
    );
    set("EMM_PINNED_HOST_POOL", None);

    // `ignore_env` builds the defaults whatever is set.
    set("EMM_MEMORY_MANAGER", Some("nonsense"));
    assert!(Runtime::builder(sim()).ignore_env().build().is_ok());
    set("EMM_MEMORY_MANAGER", None);
}
