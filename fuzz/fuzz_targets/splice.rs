//! What the handle targets share: an input written over a real handle's bytes, so that the
//! result reaches the driver instead of stopping at the first check.

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
