//! Byte sizes written by people: `256MiB`, `8G`, `4096`.

/// Parses a byte size: a number with an optional unit (`B`, `KiB`, `MiB`, `GiB`, `TiB`, or
/// `K`, `M`, `G`, `T`; powers of 1024).
pub fn parse_bytes(value: &str) -> Result<usize, String> {
    let v = value.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (digits, unit) = v.split_at(split);
    if digits.is_empty() {
        return Err(format!("{value:?} does not start with a number of bytes"));
    }
    let n: usize = digits
        .parse()
        .map_err(|e| format!("{digits:?} is not a byte count: {e}"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?}; use B, KiB, MiB, GiB or TiB"
            ));
        }
    };
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("{value:?} does not fit in {} bits", usize::BITS))
}

#[cfg(all(test, not(emm_loom)))]
pub(crate) mod tests {
    /// An environment of `pairs`, as the configuration readers' `lookup` takes it.
    pub(crate) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }
}
