//! IPC of stream-ordered pools (`async-pool-ipc`) between simulated processes: the pool export
//! over a real Unix socket, imports, direct and staged opens, peers, resets, and a property
//! test of random exports, opens and closes.
//!
//! `PROPTEST_CASES` sets the number of cases of the property test (CI: 256, about 0.2 s; 3000 take 2 s).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use driver_mock::{Op, SimConfig, SimDeviceConfig, SimDriver};
use emm::contract::{IpcMemory, PoolExport};
use emm::{EmmError, IpcHandle, MemoryPointer};
use proptest::prelude::*;

use crate::common::runtime_with;

fn two_devices(peers: bool) -> Arc<SimDriver> {
    Arc::new(SimDriver::new(
        SimConfig::with_devices(vec![
            SimDeviceConfig::new(256 << 20),
            SimDeviceConfig::new(256 << 20),
        ])
        .peer_access(peers),
    ))
}

/// The export crosses a socket pair as a file descriptor; the other process imports it, opens
/// a view directly, sees the exporter's bytes, writes into the shared memory (the exporter
/// sees the write), closes, and ends holding nothing.
#[test]
fn an_export_sent_over_a_socket_opens_in_the_other_process() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "async-pool-ipc");
    let ctx = rt.context(0).unwrap();
    let mem = ctx.to_device(&[5u8; 4096]).unwrap();
    let handle = ctx
        .get_ipc_handle(&mem.view(1024, Some(2048)).unwrap())
        .unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let export = ctx.export_pool().unwrap();
    export.send(&a).unwrap();
    let received = PoolExport::receive(&b).unwrap();
    assert_eq!(received.id(), export.id());
    assert_eq!(received.source(), export.source());
    drop(export);

    let other = Arc::new(sim.spawn_process());
    {
        let ort = runtime_with(&other, "default");
        ort.import_pool(received).unwrap();
        let octx = ort.context(0).unwrap();
        let theirs = IpcHandle::from_bytes(&handle.to_bytes()).unwrap();
        let view = theirs.open(&ort, &octx).unwrap();
        assert!(view.is_ipc_mapping());
        let mut seen = vec![0u8; 1024];
        octx.copy_to_host(&mut seen, &view).unwrap();
        assert_eq!(seen, vec![5u8; 1024]);
        octx.copy_to_device(&view, &[9u8; 16]).unwrap();
        theirs.close().unwrap();
        assert!(!view.is_live());
        assert!(octx.copy_to_host(&mut seen, &view).is_err());
    }
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
    let mut back = vec![0u8; 4096];
    ctx.copy_to_host(&mut back, &mem).unwrap();
    assert_eq!(&back[1024..1040], &[9u8; 16], "the importer's write landed");
    assert_eq!(&back[1040..], &vec![5u8; 4096 - 1040][..]);
    assert_eq!(sim.count(Op::MemPoolExportPointer), 1);
    assert_eq!(other.count(Op::MemPoolImportPointer), 1);
}

/// Importing twice is harmless; the export's descriptor is the driver's (the import reads
/// it), and the import grants nothing on the pool's own device it already has.
#[test]
fn importing_again_does_nothing() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "async-pool-ipc");
    let ctx = rt.context(0).unwrap();
    let other = Arc::new(sim.spawn_process());
    let ort = runtime_with(&other, "default");
    ort.import_pool(ctx.export_pool().unwrap()).unwrap();
    ort.import_pool(ctx.export_pool().unwrap()).unwrap();
    assert_eq!(other.count(Op::MemPoolImportFromShareableHandle), 1);
    assert_eq!(other.count(Op::MemPoolSetAccess), 0);
    drop(ort);
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
}

/// Between peers, a direct open from the other device grants that device access to the
/// imported pool; without peers, `open` stages through the source device.
#[test]
fn peers_open_directly_with_access_and_others_stage() {
    for peers in [true, false] {
        let sim = two_devices(peers);
        let rt = runtime_with(&sim, "async-pool-ipc");
        let ctx = rt.context(0).unwrap();
        let mem = ctx.to_device(&[7u8; 512]).unwrap();
        let handle = ctx.get_ipc_handle(&mem).unwrap();
        let other = Arc::new(sim.spawn_process());
        {
            let ort = runtime_with(&other, "default");
            ort.import_pool(ctx.export_pool().unwrap()).unwrap();
            let on1 = ort.context(1).unwrap();
            let theirs = IpcHandle::from_bytes(&handle.to_bytes()).unwrap();
            let got = theirs.open(&ort, &on1).unwrap();
            assert_eq!(got.is_ipc_mapping(), peers);
            assert_eq!(got.device().0, 1);
            let mut seen = vec![0u8; 512];
            on1.copy_to_host(&mut seen, &got).unwrap();
            assert_eq!(seen, vec![7u8; 512]);
            assert_eq!(other.count(Op::MemPoolSetAccess), usize::from(peers));
            theirs.close().unwrap();
        }
        assert!(other.leak_report().is_clean(), "{}", other.leak_report());
    }
}

/// A device reset in the importing process ends its imports: open pointers turn stale, the
/// imported pool and pointers are released, and a handle opens again after a new import.
#[test]
fn an_importer_reset_ends_the_import() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "async-pool-ipc");
    let ctx = rt.context(0).unwrap();
    let mem = ctx.to_device(&[1u8; 256]).unwrap();
    let bytes = ctx.get_ipc_handle(&mem).unwrap().to_bytes();
    let other = Arc::new(sim.spawn_process());
    let ort = runtime_with(&other, "default");
    ort.import_pool(ctx.export_pool().unwrap()).unwrap();
    let first = IpcHandle::from_bytes(&bytes).unwrap();
    let view = first.open(&ort, &ort.context(0).unwrap()).unwrap();
    ort.reset_device(0).unwrap();
    let mut seen = vec![0u8; 256];
    assert!(
        ort.context(0)
            .unwrap()
            .copy_to_host(&mut seen, &view)
            .is_err()
    );
    first.close().unwrap();
    assert!(other.leak_report().ipc_mappings.is_empty());
    let again = IpcHandle::from_bytes(&bytes).unwrap();
    let e = again.open(&ort, &ort.context(0).unwrap()).unwrap_err();
    assert!(matches!(e, EmmError::PoolNotImported { .. }), "{e:?}");
    ort.import_pool(ctx.export_pool().unwrap()).unwrap();
    let octx = ort.context(0).unwrap();
    let view = again.open(&ort, &octx).unwrap();
    octx.copy_to_host(&mut seen, &view).unwrap();
    assert_eq!(seen, vec![1u8; 256]);
    drop(again);
    drop(ort);
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
}

/// The exporter's handle refuses memory that is not its pool's, and the exporter cannot open
/// its own handle (Numba's text).
#[test]
fn the_exporter_refuses_foreign_memory_and_its_own_open() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "async-pool-ipc");
    let ctx = rt.context(0).unwrap();
    // SAFETY: the pointer is only handed to `get_ipc_handle`, which reads no memory through
    // it (it refuses it as not a live allocation of its pool).
    let foreign = unsafe {
        MemoryPointer::unowned(
            ctx.device(),
            ctx.handle(),
            emm::driver_sys::DevicePtr(0x1000),
            64,
        )
    };
    let e = ctx.get_ipc_handle(&foreign).unwrap_err();
    assert!(matches!(e, EmmError::InvalidArgument { .. }), "{e:?}");
    assert!(e.to_string().contains("not a live allocation"), "{e}");
    let mem = ctx.memalloc(64).unwrap();
    let handle = ctx.get_ipc_handle(&mem).unwrap();
    assert!(matches!(handle.handle(), IpcMemory::PoolAllocation { .. }));
    let e = handle.open(&rt, &ctx).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("opening IpcHandle from original process"),
        "{e}"
    );
}

/// Malformed transfers are clear errors: no descriptor, a closed peer, foreign bytes.
#[test]
fn malformed_transfers_are_refused() {
    let (mut a, b) = UnixStream::pair().unwrap();
    a.write_all(&[0u8; emm::contract::POOL_DESCRIPTOR_LEN])
        .unwrap();
    let e = PoolExport::receive(&b).unwrap_err();
    assert!(e.to_string().contains("exactly one file descriptor"), "{e}");
    drop(a);
    let e = PoolExport::receive(&b).unwrap_err();
    assert!(matches!(e, EmmError::PoolTransfer { .. }), "{e:?}");
    assert!(e.to_string().contains("PoolExport::send"), "{e}");
    let (reader, _writer) = std::io::pipe().unwrap();
    let e = PoolExport::from_descriptor(b"EMMPOOL\x07\x00", reader.into()).unwrap_err();
    assert!(e.to_string().contains("format version 7"), "{e}");
    // A descriptor that is not the driver's: the import is refused by the driver.
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "async-pool-ipc");
    let ctx = rt.context(0).unwrap();
    let real = ctx.export_pool().unwrap();
    let (reader, _writer) = std::io::pipe().unwrap();
    let forged = PoolExport::from_descriptor(&real.descriptor(), reader.into()).unwrap();
    let other = Arc::new(sim.spawn_process());
    let ort = runtime_with(&other, "default");
    let e = ort.import_pool(forged).unwrap_err();
    assert!(e.to_string().contains("import_pool"), "{e}");
}

#[derive(Clone, Debug)]
enum Step {
    /// Allocate this many bytes, filled with a byte of its own.
    Alloc(usize),
    /// Export a view of live block `i % n` (start and length in 1/8ths of it).
    Export(usize, u8, u8),
    /// Open exported handle `i % n` in the other process, directly or staged.
    Open(usize, bool),
    /// Close opened handle `i % n`.
    Close(usize),
    /// Drop live block `i % n` once nothing of the other process maps it.
    Free(usize),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            2 => (1usize..(64 << 10)).prop_map(Step::Alloc),
            3 => (any::<usize>(), 0u8..8, 1u8..9).prop_map(|(i, a, b)| Step::Export(i, a, b)),
            3 => (any::<usize>(), any::<bool>()).prop_map(|(i, s)| Step::Open(i, s)),
            2 => any::<usize>().prop_map(Step::Close),
            1 => any::<usize>().prop_map(Step::Free),
        ],
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(256), failure_persistence: None, ..ProptestConfig::default() })]

    /// Random allocations, exports of views, opens (direct or staged) and closes in another
    /// process: every open sees exactly the exported bytes, a closed direct mapping is stale, a
    /// staged copy outlives its close, and both processes end holding nothing.
    #[test]
    fn exports_opens_and_closes_in_any_order(steps in steps()) {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let other = Arc::new(sim.spawn_process());
        {
            let rt = runtime_with(&sim, "async-pool-ipc");
            let ctx = rt.context(0).unwrap();
            let ort = runtime_with(&other, "default");
            ort.import_pool(ctx.export_pool().unwrap()).unwrap();
            let octx = ort.context(0).unwrap();
            // (block, fill), (exporter's handle, bytes expected, block index), opened.
            let mut blocks: Vec<(MemoryPointer, u8)> = Vec::new();
            let mut exported: Vec<(IpcHandle, Vec<u8>, usize)> = Vec::new();
            let mut opened: Vec<(IpcHandle, MemoryPointer, bool, Vec<u8>, usize)> = Vec::new();
            for step in steps {
                match step {
                    Step::Alloc(n) => {
                        let fill = (blocks.len() % 250) as u8 + 1;
                        blocks.push((ctx.to_device(&vec![fill; n]).unwrap(), fill));
                    }
                    Step::Export(i, a, b) if !blocks.is_empty() => {
                        let k = i % blocks.len();
                        let (mem, fill) = &blocks[k];
                        let n = mem.size();
                        let (start, stop) = (n * a as usize / 8, (n * b as usize / 8).max(n * a as usize / 8 + 1).min(n));
                        prop_assume!(start < stop);
                        let h = ctx.get_ipc_handle(&mem.view(start, Some(stop)).unwrap()).unwrap();
                        exported.push((h, vec![*fill; stop - start], k));
                    }
                    Step::Open(i, staged) if !exported.is_empty() => {
                        let (h, want, k) = &exported[i % exported.len()];
                        let theirs = IpcHandle::from_bytes(&h.to_bytes()).unwrap();
                        let got = if staged { theirs.open_staged(&ort, &octx) } else { theirs.open(&ort, &octx) }.unwrap();
                        let mut seen = vec![0u8; got.size()];
                        octx.copy_to_host(&mut seen, &got).unwrap();
                        prop_assert_eq!(&seen, want);
                        opened.push((theirs, got, staged, want.clone(), *k));
                    }
                    Step::Close(i) if !opened.is_empty() => {
                        let (h, got, staged, want, _) = opened.swap_remove(i % opened.len());
                        h.close().unwrap();
                        let mut seen = vec![0u8; got.size()];
                        let after = octx.copy_to_host(&mut seen, &got);
                        if staged {
                            prop_assert!(after.is_ok() && seen == want);
                        } else {
                            prop_assert!(matches!(after, Err(EmmError::Stale { .. })), "{:?}", after);
                        }
                    }
                    Step::Free(i) if !blocks.is_empty() => {
                        // The driver's rule: importers free first. Only blocks nobody maps.
                        let k = i % blocks.len();
                        if opened.iter().any(|o| o.4 == k && !o.2) {
                            continue;
                        }
                        exported.retain(|e| e.2 != k);
                        for e in &mut exported {
                            if e.2 > k {
                                e.2 -= 1;
                            }
                        }
                        // Staged copies of the block stay; they name no block any more.
                        for o in &mut opened {
                            if o.4 == k {
                                o.4 = usize::MAX;
                            } else if o.4 > k && o.4 != usize::MAX {
                                o.4 -= 1;
                            }
                        }
                        blocks.remove(k);
                    }
                    _ => {}
                }
            }
            for (h, _, _, _, _) in opened {
                h.close().unwrap();
            }
        }
        prop_assert!(other.leak_report().is_clean(), "{}", other.leak_report());
        prop_assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
    }
}

/// A staged open on another device goes through the host, in chunks, since that device has
/// no access to the imported pool (on two H200s a device-to-device copy in its context was
/// refused): the copy has every byte of a block larger than one chunk, and no access was
/// granted. A direct open from the peer is granted access and reads the memory itself.
#[test]
fn staged_opens_on_another_device_go_through_the_host() {
    let sim = two_devices(true);
    let rt = runtime_with(&sim, "async-pool-ipc");
    let ctx = rt.context(0).unwrap();
    let n = 40 << 20;
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let mem = ctx.to_device(&data).unwrap();
    let handle = ctx.get_ipc_handle(&mem.view(3, None).unwrap()).unwrap();
    let other = Arc::new(sim.spawn_process());
    {
        let ort = runtime_with(&other, "default");
        ort.import_pool(ctx.export_pool().unwrap()).unwrap();
        let on1 = ort.context(1).unwrap();
        let theirs = IpcHandle::from_bytes(&handle.to_bytes()).unwrap();
        let copy = theirs.open_staged(&ort, &on1).unwrap();
        assert!(!copy.is_ipc_mapping());
        let mut seen = vec![0u8; n - 3];
        on1.copy_to_host(&mut seen, &copy).unwrap();
        assert!(seen == data[3..], "the staged copy differs");
        assert_eq!(other.count(Op::MemPoolSetAccess), 0);
        assert!(other.count(Op::MemcpyDtoH) >= 3, "40 MiB in 16 MiB chunks");
        theirs.close().unwrap();
        // Direct: device 1 is granted access, so its context reaches the imported memory.
        let direct = IpcHandle::from_bytes(&handle.to_bytes()).unwrap();
        let view = direct.open(&ort, &on1).unwrap();
        let mut head = [0u8; 8];
        on1.copy_to_host(&mut head, &view.view(0, Some(8)).unwrap())
            .unwrap();
        assert_eq!(&head[..], &data[3..11]);
        direct.close().unwrap();
    }
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
}

/// The variables that make this binary the other process of the cross-user tests.
const PEER_SOCKET_ENV: &str = "EMM_TEST_PEER_SOCKET";
/// Set for the peer that takes exports from the exporter's user: that uid.
const PEER_ACCEPTS_ENV: &str = "EMM_TEST_PEER_ACCEPTS";

/// The other process of the cross-user tests (run by them as another user, with
/// `--ignored --exact pool_ipc::peer_receives`): connects to the socket the test names and
/// prints what `PoolExport::receive` gave.
#[test]
#[ignore = "the other process of the cross-user tests; they run it"]
fn peer_receives() {
    let path = std::env::var(PEER_SOCKET_ENV).expect("run by the cross-user tests");
    let socket = UnixStream::connect(&path).expect("connecting to the exporter");
    // The exporter's user, where the test has this side take exports from it.
    let received = match std::env::var(PEER_ACCEPTS_ENV) {
        Ok(uid) => {
            let uid = uid.parse().expect("a uid");
            PoolExport::receive_from(&socket, &emm::PeerPolicy::Uids(vec![uid]))
        }
        Err(_) => PoolExport::receive(&socket),
    };
    match received {
        Ok(export) => println!("EMM_PEER_RESULT ok {}", export.id()),
        Err(e) => println!("EMM_PEER_RESULT err {e}"),
    }
}

/// Runs [`peer_receives`] as user `uid` against a listener at a fresh path (taking exports
/// from this process's user where `accepts`, else from its own user only), has the exporter
/// send under `policy`; returns the exporter's result and the peer's line.
fn send_to_user(
    export: &PoolExport,
    uid: u32,
    policy: &emm::PeerPolicy,
    accepts: bool,
) -> (Result<(), EmmError>, String) {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = std::env::temp_dir().join(format!("emm-peer-{}-{uid}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.join("socket");
    // Open to everyone here, so that the credential check, not the file mode, is what decides.
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    if accepts {
        // SAFETY: geteuid has no preconditions.
        command.env(PEER_ACCEPTS_ENV, unsafe { libc::geteuid() }.to_string());
    }
    let child = command
        .args([
            "--ignored",
            "--exact",
            "pool_ipc::peer_receives",
            "--nocapture",
        ])
        .env(PEER_SOCKET_ENV, &path)
        .uid(uid)
        .gid(uid)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
    let sent = export.send_to(&stream, policy);
    drop(stream);
    let out = child.wait_with_output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("EMM_PEER_RESULT "))
        .unwrap_or_else(|| {
            panic!(
                "the peer printed no result: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
        .to_owned();
    (sent, line)
}

/// Who may import a pool: a process of another user is refused on both sides (the exporter's
/// error names both users and the way to allow it; the importer's says the exporter refused
/// it), and receives the pool once the exporter allows its uid and it takes exports from the
/// exporter's user; taking exports from its own user only, it refuses the exporter's. Needs root, to run the other
/// process as another user (`nobody`, uid 65534); CI runs as root. Elsewhere it fails unless
/// `EMM_SKIP_CROSS_USER` says why it is not run.
#[test]
fn a_process_of_another_user_is_refused_on_both_sides_unless_allowed() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        match std::env::var("EMM_SKIP_CROSS_USER") {
            Ok(why) if !why.trim().is_empty() => {
                eprintln!(
                    "a_process_of_another_user_is_refused_on_both_sides_unless_allowed: not \
                     run (EMM_SKIP_CROSS_USER: {why})"
                );
                return;
            }
            _ => panic!(
                "this test starts a process as another user, which needs root: run the tests \
                 as root (CI does), or set EMM_SKIP_CROSS_USER to the reason it is not run here"
            ),
        }
    }
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "async-pool-ipc");
    let ctx = rt.context(0).unwrap();
    let export = ctx.export_pool().unwrap();
    let nobody = 65534;
    let (sent, line) = send_to_user(&export, nobody, &emm::PeerPolicy::SameUser, true);
    let e = sent.unwrap_err();
    assert!(matches!(e, EmmError::PoolTransfer { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("uid 65534") && text.contains("PeerPolicy::Uids"),
        "{text}"
    );
    assert!(line.starts_with("err "), "{line}");
    assert!(
        line.contains("does not let this process (uid 65534) import its pool"),
        "{line}"
    );
    let (sent, line) = send_to_user(&export, nobody, &emm::PeerPolicy::Uids(vec![nobody]), true);
    sent.unwrap();
    assert_eq!(line, format!("ok {}", export.id()));
    // The importer refuses a sender of another user unless it names it: here the exporter
    // allows the peer, and the peer, taking exports from its own user only, reads nothing.
    let (_, line) = send_to_user(&export, nobody, &emm::PeerPolicy::Uids(vec![nobody]), false);
    assert!(
        line.starts_with("err ") && line.contains("the sending process runs as uid 0"),
        "{line}"
    );
    assert!(line.contains("receive_from"), "{line}");
}

/// A device memory resource made with `ipc_enabled`: its pool goes to another process as an
/// allocation handle over a socket, where it becomes a mapped resource (registered by the
/// pool's id, allocating nothing, exporting nothing); a buffer allocated on a stream is
/// exported (its stream synchronised first) and opens there with the exporter's bytes; a
/// resource without IPC refuses with an error that says how to make one that can.
#[test]
fn a_memory_resource_exports_its_pool_and_buffers() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "default");
    let ctx = rt.context(0).unwrap();
    let mr = ctx
        .device_memory_resource(emm::DeviceMemoryResourceOptions {
            max_size: 0,
            ipc_enabled: true,
        })
        .unwrap();
    let s = ctx.create_stream().unwrap();
    let buf = mr.allocate(8192, &s).unwrap();
    ctx.memset_async(&buf, 6, &s).unwrap().wait().unwrap();
    let handle = mr.get_ipc_handle(&buf.view(4096, None).unwrap()).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let export = mr.allocation_handle().unwrap();
    assert_eq!(Some(export.id()), mr.pool_id());
    export.send(&a).unwrap();
    let received = PoolExport::receive(&b).unwrap();
    let other = Arc::new(sim.spawn_process());
    {
        let ort = runtime_with(&other, "default");
        let id = received.id();
        assert!(
            ort.imported_memory_resource(id).is_none(),
            "not imported yet"
        );
        let mapped = ort
            .memory_resource_from_allocation_handle(received)
            .unwrap();
        assert!(mapped.is_mapped() && !mapped.is_handle_owned());
        assert_eq!(mapped.pool_id(), Some(id));
        let from_registry = ort
            .imported_memory_resource(id)
            .expect("registered by its id");
        assert_eq!(from_registry.handle(), mapped.handle());
        let octx = ort.context(0).unwrap();
        let os = octx.create_stream().unwrap();
        let e = mapped.allocate(64, &os).unwrap_err();
        assert!(e.to_string().contains("imported"), "{e}");
        let e = mapped.allocation_handle().unwrap_err();
        assert!(e.to_string().contains("made it"), "{e}");
        let theirs = IpcHandle::from_bytes(&handle.to_bytes()).unwrap();
        let view = theirs.open(&ort, &octx).unwrap();
        let mut seen = vec![0u8; 4096];
        octx.copy_to_host(&mut seen, &view).unwrap();
        assert_eq!(seen, vec![6u8; 4096]);
        theirs.close().unwrap();
        mapped.close().unwrap();
    }
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
    drop(buf);
    mr.close().unwrap();

    let plain = ctx
        .device_memory_resource(emm::DeviceMemoryResourceOptions::default())
        .unwrap();
    let mem = plain.allocate(64, &s).unwrap();
    let e = plain.get_ipc_handle(&mem).unwrap_err();
    assert!(e.to_string().contains("ipc_enabled: true"), "{e}");
    let e = plain.allocation_handle().unwrap_err();
    assert!(e.to_string().contains("not IPC-enabled"), "{e}");
    // A buffer of another resource is not this one's to export.
    let e = mr.get_ipc_handle(&mem).unwrap_err();
    assert!(
        e.to_string().contains("closed") || e.to_string().contains("not a live buffer"),
        "{e}"
    );
}

/// The pinned memory resource's choices of pool: host memory at large by default, the
/// device's host NUMA node when IPC is enabled, a NUMA node given; a device whose driver has
/// no host memory pools is refused with an error that names the legacy pinned memory; a NUMA
/// node the machine does not have is the driver's error.
#[test]
fn pinned_memory_resource_locations_and_capability() {
    use emm::PinnedMemoryResourceOptions as Options;
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "default");
    let ctx = rt.context(0).unwrap();
    let s = ctx.create_stream().unwrap();
    let plain = ctx.pinned_memory_resource(Options::default()).unwrap();
    assert_eq!(plain.numa_id(), None);
    let ipc = ctx
        .pinned_memory_resource(Options {
            ipc_enabled: true,
            ..Options::default()
        })
        .unwrap();
    assert_eq!(ipc.numa_id(), Some(0), "the device's host_numa_id");
    assert!(ipc.is_ipc_enabled());
    let buf = ipc.allocate(4096, &s).unwrap();
    buf.write(0, &[3u8; 16]).unwrap();
    ipc.deallocate(buf, &s).unwrap();
    let e = ctx
        .pinned_memory_resource(Options {
            numa_id: Some(5),
            ..Options::default()
        })
        .unwrap_err();
    assert!(matches!(e, EmmError::Driver { .. }), "{e}");
    drop((plain, ipc));

    let old = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(256 << 20).host_memory_pools(false),
    ])));
    let ort = runtime_with(&old, "default");
    let octx = ort.context(0).unwrap();
    let e = octx.pinned_memory_resource(Options::default()).unwrap_err();
    assert!(matches!(e, EmmError::DeviceCannot { .. }), "{e}");
    assert!(e.to_string().contains("memhostalloc"), "{e}");
}

/// The managed memory resource on a device without managed memory is refused with an error
/// that says so; on one with it, a preferred host NUMA node the machine does not have is the
/// driver's error, and its own node is accepted.
#[test]
fn managed_memory_resource_capability_and_locations() {
    use emm::ManagedMemoryResourceOptions as Options;
    use emm::driver_sys::MemLocation;
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "default");
    let ctx = rt.context(0).unwrap();
    let numa = ctx
        .managed_memory_resource(Options {
            preferred_location: Some(MemLocation::HostNuma(0)),
        })
        .unwrap();
    assert_eq!(numa.preferred_location(), Some(MemLocation::HostNuma(0)));
    numa.close().unwrap();
    let e = ctx
        .managed_memory_resource(Options {
            preferred_location: Some(MemLocation::HostNuma(7)),
        })
        .unwrap_err();
    assert!(matches!(e, EmmError::Driver { .. }), "{e}");

    let none = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(256 << 20).managed_memory(false),
    ])));
    let nrt = runtime_with(&none, "default");
    let nctx = nrt.context(0).unwrap();
    let e = nctx
        .managed_memory_resource(Options::default())
        .unwrap_err();
    assert!(matches!(e, EmmError::DeviceCannot { .. }), "{e}");
    assert!(e.to_string().contains("no managed memory"), "{e}");
}

/// A resource closed while a buffer is still allocated keeps its pool until that buffer is
/// freed, and destroys it then (after the free is queued); with nothing allocated, `close`
/// destroys the pool at once.
#[test]
fn a_closed_resource_destroys_its_pool_after_its_last_buffer() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "default");
    let ctx = rt.context(0).unwrap();
    let s = ctx.create_stream().unwrap();
    let pools = || sim.leak_report().pools;
    let before = pools();
    let mr = ctx
        .device_memory_resource(emm::DeviceMemoryResourceOptions::default())
        .unwrap();
    assert_eq!(pools(), before + 1);
    let (a, b) = (
        mr.allocate(4096, &s).unwrap(),
        mr.allocate(4096, &s).unwrap(),
    );
    mr.close().unwrap();
    assert_eq!(pools(), before + 1, "kept while buffers are live");
    drop(a);
    assert_eq!(pools(), before + 1, "kept while one buffer is live");
    drop(b);
    s.synchronize().unwrap();
    assert_eq!(pools(), before, "destroyed after the last buffer's free");
    mr.close().unwrap();
    let empty = ctx
        .device_memory_resource(emm::DeviceMemoryResourceOptions::default())
        .unwrap();
    empty.close().unwrap();
    assert_eq!(pools(), before, "destroyed at the close");
}
