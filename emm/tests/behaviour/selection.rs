//! Choosing the memory manager: by name, in code, the interface-version check (Numba's text),
//! and the rule that the choice is fixed once a context exists.

use crate::common::sim;
use emm::contract::FnFactory;
use emm::plugin::DefaultManager;
use emm::{EmmError, Runtime};

#[test]
fn default_is_chosen_unless_told_otherwise() {
    let rt = Runtime::builder(sim()).ignore_env().build().unwrap();
    assert_eq!(rt.memory_manager_name(), "default");
    assert_eq!(rt.context(0).unwrap().memory_manager_name(), "default");
    assert_eq!(
        rt.registered_managers(),
        vec![
            "async-pool".to_owned(),
            "async-pool-ipc".to_owned(),
            "async-pool-managed".to_owned(),
            "default".to_owned(),
            "pool".to_owned(),
            "vmm-pool".to_owned()
        ]
    );
}

#[test]
fn an_unknown_name_lists_the_registered_ones() {
    let err = Runtime::builder(sim())
        .ignore_env()
        .register_manager(FnFactory::new("mine", |cx| {
            Ok(Box::new(DefaultManager::default_manager(cx)))
        }))
        .memory_manager_name("slab")
        .build()
        .unwrap_err();
    assert!(matches!(err, EmmError::UnknownManager { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("no memory manager named 'slab'"), "{text}");
    assert!(
        text.contains("registered managers: async-pool, async-pool-ipc, async-pool-managed, default, mine, pool"),
        "{text}"
    );
    assert!(text.contains("EMM_MEMORY_MANAGER"), "{text}");
}

#[test]
fn a_registered_manager_is_used_by_every_context() {
    let rt = Runtime::builder(sim())
        .ignore_env()
        .register_manager(FnFactory::new("mine", |cx| {
            Ok(Box::new(DefaultManager::default_manager(cx)))
        }))
        .memory_manager_name("mine")
        .build()
        .unwrap();
    assert_eq!(rt.context(0).unwrap().memory_manager_name(), "mine");
}

/// Numba `test_bad_plugin_version`.
#[test]
fn test_bad_plugin_version() {
    let bad = FnFactory::new("bad", |cx| {
        Ok(Box::new(DefaultManager::default_manager(cx)))
    })
    .with_interface_version(2);
    let err = Runtime::builder(sim())
        .ignore_env()
        .memory_manager(bad)
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "EMM Plugin interface has version 2 - version 1 required"
    );
    let rt = Runtime::builder(sim()).ignore_env().build().unwrap();
    let bad = FnFactory::new("bad", |cx| {
        Ok(Box::new(DefaultManager::default_manager(cx)))
    })
    .with_interface_version(2);
    let err = rt.set_memory_manager(bad).unwrap_err();
    assert!(err.to_string().contains("version 1 required"), "{err}");
}

#[test]
fn the_choice_is_fixed_once_a_context_exists() {
    let rt = Runtime::builder(sim()).ignore_env().build().unwrap();
    let mine = || {
        FnFactory::new("mine", |cx| {
            Ok(Box::new(DefaultManager::default_manager(cx)))
        })
    };
    rt.set_memory_manager(mine()).unwrap();
    assert_eq!(rt.memory_manager_name(), "mine");
    let ctx = rt.context(0).unwrap();
    let err = rt.set_memory_manager(mine()).unwrap_err();
    assert!(
        matches!(err, EmmError::ManagerAlreadyFixed { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("choose the manager before the first context"),
        "{err}"
    );
    assert!(rt.select_memory_manager("default").is_err());
    // After the device is reset no context exists, and the choice is open again.
    drop(ctx);
    rt.reset_device(0).unwrap();
    rt.select_memory_manager("default").unwrap();
    assert_eq!(rt.context(0).unwrap().memory_manager_name(), "default");
}

#[test]
fn a_factory_error_leaves_no_context_retained() {
    let sim = sim();
    let failing = FnFactory::new("failing", |_| {
        Err(EmmError::Config {
            variable: "X",
            value: "y".into(),
            reason: "for the test".into(),
        })
    });
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager(failing)
        .build()
        .unwrap();
    assert!(rt.context(0).is_err());
    assert_eq!(
        sim.context_refcount(0.into()),
        0,
        "the primary context was released again"
    );
}

#[test]
fn a_device_that_does_not_exist_is_a_clear_error() {
    let rt = Runtime::builder(sim()).ignore_env().build().unwrap();
    let err = rt.context(3).unwrap_err();
    assert_eq!(
        err.to_string(),
        "device 3 does not exist: the driver reports 1 device(s); use an ordinal below 1"
    );
}

/// What each shipped manager can do beyond NBEP 7, as its capability accessors say: a plugin
/// or adaptor asks the accessor, not the manager's name. Every manager built on the host layer
/// holds pinned memory back (`holdings`); the pools keep a history; only `vmm-pool` sleeps and
/// shares memory as file descriptors, and only `async-pool-ipc` exports its pool.
#[test]
fn each_shipped_manager_offers_the_capabilities_its_memory_allows() {
    use emm::contract::{ManagerFactory, MemoryManager};
    use emm::plugin::{AsyncPoolAllocator, PoolAllocator};
    use std::sync::{Arc, Mutex};

    type Seen = Arc<Mutex<Option<[bool; 4]>>>;
    let cases: [(&str, Arc<dyn ManagerFactory>, [bool; 4]); 5] = [
        (
            "default",
            Arc::new(FnFactory::new("default", |cx| {
                Ok(Box::new(DefaultManager::default_manager(cx)))
            })),
            [true, false, false, false],
        ),
        (
            "pool",
            Arc::new(PoolAllocator::factory()),
            [true, true, false, false],
        ),
        (
            "vmm-pool",
            Arc::new(PoolAllocator::vmm_factory()),
            [true, true, true, true],
        ),
        (
            "async-pool",
            Arc::new(AsyncPoolAllocator::factory()),
            [true, false, false, false],
        ),
        (
            "async-pool-ipc",
            Arc::new(AsyncPoolAllocator::ipc_factory()),
            [true, false, true, false],
        ),
    ];
    for (name, inner, expected) in cases {
        let seen: Seen = Arc::new(Mutex::new(None));
        let probe = {
            let seen = Arc::clone(&seen);
            FnFactory::new("probe", move |cx| {
                let m: Box<dyn MemoryManager> = inner.create(cx)?;
                *seen.lock().unwrap() = Some([
                    m.holdings().is_some(),
                    m.records().is_some(),
                    m.exports().is_some(),
                    m.sleeper().is_some(),
                ]);
                Ok(m)
            })
        };
        let rt = Runtime::builder(sim())
            .ignore_env()
            .memory_manager(probe)
            .build()
            .unwrap();
        let ctx = rt.context(0).unwrap();
        assert_eq!(seen.lock().unwrap().take(), Some(expected), "{name}");
        // Through the context: what a manager lacks is refused, naming it.
        if !expected[3] {
            let e = ctx.sleep(&Default::default()).unwrap_err();
            assert!(matches!(e, EmmError::NotSupported { .. }), "{name}: {e}");
        }
        if !expected[2] {
            let e = ctx.memalloc_shared(1 << 20).unwrap_err();
            assert!(matches!(e, EmmError::NotSupported { .. }), "{name}: {e}");
        }
        assert_eq!(ctx.trim().unwrap(), 0, "{name}: nothing held yet");
    }
}
