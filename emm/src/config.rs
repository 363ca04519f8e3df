//! Configuration from the environment, with Numba's names under an `EMM_` prefix.
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `EMM_MEMORY_MANAGER` | the registered manager every context uses | `default` |
//! | `EMM_MAX_PENDING_DEALLOCS_COUNT` | flush when more than this many frees are pending | `10` |
//! | `EMM_MAX_PENDING_DEALLOCS_RATIO` | flush when pending bytes exceed this share of the device's total memory | `0.2` |
//! | `EMM_MEMORY_ADAPTORS` | adaptors wrapped around the manager, innermost first: `stats`, `limit=<bytes>`, `log=<path>`, `trace`, comma-separated | none |
//! | `EMM_PINNED_HOST_POOL` | `on`, `off`, or the most bytes of free pinned blocks to keep (`256MiB`) | `off` |
//!
//! Byte sizes are a number with an optional unit: `B`, `KiB`, `MiB`, `GiB`, `TiB` (or `K`,
//! `M`, `G`, `T`, the same powers of 1024).
//!
//! A malformed value is an error at start-up ([`EmmError::Config`]), never a silent fallback
//! to the default (Numba warns and falls back; emm refuses).

use crate::EmmError;

/// `EMM_MEMORY_MANAGER`.
pub const ENV_MEMORY_MANAGER: &str = "EMM_MEMORY_MANAGER";
/// `EMM_MAX_PENDING_DEALLOCS_COUNT`.
pub const ENV_MAX_PENDING_COUNT: &str = "EMM_MAX_PENDING_DEALLOCS_COUNT";
/// `EMM_MAX_PENDING_DEALLOCS_RATIO`.
pub const ENV_MAX_PENDING_RATIO: &str = "EMM_MAX_PENDING_DEALLOCS_RATIO";

/// `EMM_MEMORY_ADAPTORS`.
pub const ENV_MEMORY_ADAPTORS: &str = "EMM_MEMORY_ADAPTORS";
/// `EMM_PINNED_HOST_POOL`.
pub const ENV_PINNED_HOST_POOL: &str = "EMM_PINNED_HOST_POOL";

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

/// Reads `EMM_PINNED_HOST_POOL` through `lookup`: `None` when unset or `off`.
pub fn pinned_pool_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<crate::PinnedPoolConfig>, EmmError> {
    let Some(value) = lookup(ENV_PINNED_HOST_POOL) else {
        return Ok(None);
    };
    let bad = |reason: String| EmmError::Config {
        variable: ENV_PINNED_HOST_POOL,
        value: value.clone(),
        reason,
    };
    match value.trim().to_ascii_lowercase().as_str() {
        "off" | "0" | "no" | "false" => Ok(None),
        "on" | "1" | "yes" | "true" => Ok(Some(crate::PinnedPoolConfig::default())),
        _ => {
            let max_cached = parse_bytes(&value).map_err(|e| {
                bad(format!(
                    "{e}; use on, off, or the bytes to keep cached (256MiB)"
                ))
            })?;
            Ok(Some(crate::PinnedPoolConfig {
                max_cached,
                ..crate::PinnedPoolConfig::default()
            }))
        }
    }
}

/// Reads `EMM_MEMORY_ADAPTORS` through `lookup`: the adaptors, innermost first.
pub fn adaptors_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<crate::Adaptor>, EmmError> {
    let Some(value) = lookup(ENV_MEMORY_ADAPTORS) else {
        return Ok(Vec::new());
    };
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            crate::Adaptor::parse(item).map_err(|reason| EmmError::Config {
                variable: ENV_MEMORY_ADAPTORS,
                value: value.clone(),
                reason,
            })
        })
        .collect()
}

/// The deferred-deallocation thresholds (Numba's `CUDA_DEALLOCS_COUNT` / `_RATIO`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeallocConfig {
    /// Flush when the number of pending frees is **greater than** this.
    pub max_count: usize,
    /// Flush when pending bytes are **greater than** `floor(capacity * max_ratio)`, where the
    /// capacity is the device's total memory captured at the manager's first `initialize`.
    pub max_ratio: f64,
}

impl Default for DeallocConfig {
    /// Numba's defaults: 10 and 0.2.
    fn default() -> Self {
        DeallocConfig {
            max_count: 10,
            max_ratio: 0.2,
        }
    }
}

impl DeallocConfig {
    /// Reads both thresholds from the environment.
    pub fn from_env() -> Result<DeallocConfig, EmmError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads both thresholds through `lookup` (a variable's value, or `None` when unset).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<DeallocConfig, EmmError> {
        let mut config = DeallocConfig::default();
        if let Some(value) = lookup(ENV_MAX_PENDING_COUNT) {
            config.max_count = parse_count(&value)?;
        }
        if let Some(value) = lookup(ENV_MAX_PENDING_RATIO) {
            config.max_ratio = parse_ratio(&value)?;
        }
        Ok(config)
    }

    /// `floor(capacity * max_ratio)`, saturating; 0 when the capacity is unknown (0).
    pub fn max_pending_bytes(&self, capacity: usize) -> usize {
        let bytes = (capacity as f64 * self.max_ratio).floor();
        if bytes >= usize::MAX as f64 {
            usize::MAX
        } else {
            bytes as usize
        }
    }
}

fn parse_count(value: &str) -> Result<usize, EmmError> {
    value.trim().parse::<usize>().map_err(|e| EmmError::Config {
        variable: ENV_MAX_PENDING_COUNT,
        value: value.to_owned(),
        reason: format!(
            "{e}; set it to a whole number of pending deallocations (0 or more, default 10), \
             or unset it"
        ),
    })
}

fn parse_ratio(value: &str) -> Result<f64, EmmError> {
    let bad = |why: String| EmmError::Config {
        variable: ENV_MAX_PENDING_RATIO,
        value: value.to_owned(),
        reason: format!(
            "{why}; set it to a finite number of 0 or more (a share of the device's total \
             memory, default 0.2), or unset it"
        ),
    };
    let ratio = value
        .trim()
        .parse::<f64>()
        .map_err(|e| bad(e.to_string()))?;
    if !ratio.is_finite() {
        return Err(bad("not a finite number".into()));
    }
    if ratio < 0.0 {
        return Err(bad("negative".into()));
    }
    Ok(ratio)
}

/// Reads `EMM_MEMORY_MANAGER`: `Ok(None)` when unset; an empty value is an error.
pub fn manager_name_from_env() -> Result<Option<String>, EmmError> {
    manager_name_from_lookup(|name| std::env::var(name).ok())
}

/// [`manager_name_from_env`] through `lookup`.
pub fn manager_name_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, EmmError> {
    match lookup(ENV_MEMORY_MANAGER) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Err(EmmError::Config {
            variable: ENV_MEMORY_MANAGER,
            value: v,
            reason: "empty; set it to a registered manager's name (such as 'default') or \
                     unset it"
                .into(),
        }),
        Some(v) => Ok(Some(v.trim().to_owned())),
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
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

    #[test]
    fn defaults_are_numbas() {
        let c = DeallocConfig::from_lookup(env(&[])).unwrap();
        assert_eq!(
            c,
            DeallocConfig {
                max_count: 10,
                max_ratio: 0.2
            }
        );
    }

    #[test]
    fn values_are_read() {
        let c = DeallocConfig::from_lookup(env(&[
            (ENV_MAX_PENDING_COUNT, "3"),
            (ENV_MAX_PENDING_RATIO, " 0.5 "),
        ]))
        .unwrap();
        assert_eq!(
            c,
            DeallocConfig {
                max_count: 3,
                max_ratio: 0.5
            }
        );
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        for (var, value) in [
            (ENV_MAX_PENDING_COUNT, "-1"),
            (ENV_MAX_PENDING_COUNT, ""),
            (ENV_MAX_PENDING_COUNT, "ten"),
            (ENV_MAX_PENDING_COUNT, "99999999999999999999999"),
            (ENV_MAX_PENDING_RATIO, "NaN"),
            (ENV_MAX_PENDING_RATIO, "inf"),
            (ENV_MAX_PENDING_RATIO, "-0.1"),
            (ENV_MAX_PENDING_RATIO, ""),
        ] {
            let err = DeallocConfig::from_lookup(env(&[(var, value)])).unwrap_err();
            let text = err.to_string();
            assert!(text.starts_with(var), "{text}");
            assert!(text.contains("or unset it"), "{text}");
        }
    }

    #[test]
    fn max_pending_bytes_floors_and_saturates() {
        let c = DeallocConfig {
            max_count: 10,
            max_ratio: 0.2,
        };
        assert_eq!(c.max_pending_bytes(0), 0);
        assert_eq!(c.max_pending_bytes(1000), 200);
        assert_eq!(c.max_pending_bytes(1001), 200);
        let huge = DeallocConfig {
            max_count: 10,
            max_ratio: 1e300,
        };
        assert_eq!(huge.max_pending_bytes(10), usize::MAX);
    }

    #[test]
    fn manager_name() {
        assert_eq!(manager_name_from_lookup(env(&[])).unwrap(), None);
        assert_eq!(
            manager_name_from_lookup(env(&[(ENV_MEMORY_MANAGER, "pool")])).unwrap(),
            Some("pool".into())
        );
        assert!(manager_name_from_lookup(env(&[(ENV_MEMORY_MANAGER, " ")])).is_err());
    }
}
