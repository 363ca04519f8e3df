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
