//! When the deferred-deallocation queue flushes: Numba's two thresholds
//! (`CUDA_DEALLOCS_COUNT`, `CUDA_DEALLOCS_RATIO`), in code or from the environment.

use crate::error::EmmError;

/// `EMM_MAX_PENDING_DEALLOCS_COUNT`.
pub const ENV_MAX_PENDING_COUNT: &str = "EMM_MAX_PENDING_DEALLOCS_COUNT";
/// `EMM_MAX_PENDING_DEALLOCS_RATIO`.
pub const ENV_MAX_PENDING_RATIO: &str = "EMM_MAX_PENDING_DEALLOCS_RATIO";

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

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;
    use crate::units::tests::env;

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
}
