//! What the handle targets share: an input written over a real handle's bytes, so that the
//! result reaches the driver instead of stopping at the first check, and the one way each
//! spliced handle is tried.

use driver_mock::SimDriver;
use emm::{IpcHandle, Runtime};

/// Checks that bytes which decode as a handle re-encode to the same bytes.
pub fn check_round_trip(data: &[u8]) {
    if let Ok(h) = IpcHandle::from_bytes(data) {
        assert_eq!(h.to_bytes(), data);
    }
}

/// Splices `data` over `base` and, when that decodes, opens the handle in `importer` (whose
/// process is `sim`), reads some of what it maps and closes it: the open maps live memory or
/// fails with a typed error, and nothing the open mapped outlives the close.
pub fn open_spliced(importer: &Runtime, sim: &SimDriver, base: &[u8], data: &[u8]) {
    let bytes = splice(base, data);
    let Ok(h) = IpcHandle::from_bytes(&bytes) else {
        return;
    };
    let ctx = importer.context(0).unwrap();
    if let Ok(mem) = h.open(importer, &ctx) {
        let mut back = vec![0u8; mem.size().min(64)];
        let _ = ctx.copy_to_host(&mut back, &mem);
        h.close().unwrap();
    }
    let leaks = sim.leak_report();
    assert!(
        leaks.ipc_mappings.is_empty(),
        "an imported pointer outlived its close: {leaks}"
    );
}

/// `base` with `data[1..]` written over it from the offset `data[0]` names, wrapping around.
pub fn splice(base: &[u8], data: &[u8]) -> Vec<u8> {
    let mut bytes = base.to_vec();
    let skip = data.first().map_or(0, |b| *b as usize % bytes.len());
    for (i, b) in data.iter().skip(1).enumerate() {
        let at = (skip + i) % bytes.len();
        bytes[at] = *b;
    }
    bytes
}
