//! Numba's `test_context_stack.py` and `test_select_device.py`, where they apply.

use integration::{Target, TestCtx, make_driver};
use libtest_mimic::Failed;

/// Numba `test_attached_primary`: a primary context retained by a third party is the one emm
/// uses, and either side may release first.
pub fn test_attached_primary(target: Target) -> Result<(), Failed> {
    let (third_party, _) = make_driver(target)?;
    third_party.init()?;
    let t = TestCtx::new(target)?;
    let theirs = t.driver.primary_ctx_retain(0.into())?;
    let ctx = t.context()?;
    ensure_eq!(ctx.handle(), theirs);
    let m = ctx.to_device(&[3u8; 16])?;
    // SAFETY: matches the retain above; emm holds its own reference.
    #[allow(unsafe_code)]
    unsafe {
        t.driver.primary_ctx_release(0.into())?
    };
    let mut back = [0u8; 16];
    ctx.copy_to_host(&mut back, &m)?;
    ensure_eq!(back, [3u8; 16]);
    drop(third_party);
    Ok(())
}

/// Numba `test_select_device`: ten threads in turn use device 0 (a stream, a copy, a free)
/// without error.
pub fn test_select_device(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    for i in 0..10u8 {
        let r = std::thread::scope(|s| {
            s.spawn(|| -> Result<(), String> {
                let ctx = t.runtime.context(0).map_err(|e| e.to_string())?;
                let _stream = ctx.create_stream().map_err(|e| e.to_string())?;
                let m = ctx.to_device(&[i; 32]).map_err(|e| e.to_string())?;
                let mut back = [0u8; 32];
                ctx.copy_to_host(&mut back, &m).map_err(|e| e.to_string())?;
                if back != [i; 32] {
                    return Err("wrong bytes".into());
                }
                Ok(())
            })
            .join()
        });
        r.map_err(|_| Failed::from("thread panicked"))??;
    }
    Ok(())
}

/// Streams, events and modules on the context's own queue: a module unloads when dropped, and
/// a context reset unloads the modules it still holds (Numba's `modules.clear()`).
pub fn modules_unload_on_drop_and_reset(target: Target) -> Result<(), Failed> {
    const PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\n.visible .entry emm_noop()\n{\n\tret;\n}\n";
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let a = ctx.load_module(PTX.as_bytes())?;
    drop(a);
    ensure_eq!(ctx.own_deallocations().len(), 1);
    let b = ctx.load_module(PTX.as_bytes())?;
    ctx.reset()?;
    ensure!(!b.is_loaded(), "the reset unloaded it");
    ensure_eq!(
        ctx.own_deallocations().len(),
        0,
        "the reset flushed the context's queue"
    );
    drop(b);
    ensure_eq!(
        ctx.own_deallocations().len(),
        0,
        "a module from before the reset unloads nothing"
    );
    if let Some(sim) = t.sim() {
        ensure_eq!(sim.count(driver_mock::Op::ModuleUnload), 2);
        ensure!(sim.leak_report().modules == 0, "{}", sim.leak_report());
    }
    let bad = ctx.load_module(b"not an image");
    ensure!(bad.is_err(), "a garbage image is refused");
    Ok(())
}
