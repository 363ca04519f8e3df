//! Configuration from the environment, with Numba's names under an `EMM_` prefix.
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `EMM_MEMORY_MANAGER` | the registered manager every context uses | `default` |
//! | `EMM_MAX_PENDING_DEALLOCS_COUNT` | flush when more than this many frees are pending | `10` |
//! | `EMM_MAX_PENDING_DEALLOCS_RATIO` | flush when pending bytes exceed this share of the device's total memory | `0.2` |
//! | `EMM_MEMORY_ADAPTORS` | adaptors wrapped around the manager, innermost first: `stats`, `limit=<bytes>`, `log=<path>`, `trace`, comma-separated | none |
//! | `EMM_PINNED_HOST_POOL` | `on`, `off`, or the most bytes of free pinned blocks to keep (`256MiB`) | `off` |
//! | `EMM_VMM_PIECE` | `vmm-pool`'s piece of physical memory, a power of two of at least the granularity (`32MiB`: a sleep, a wake and a large growth in 16 × fewer driver calls) | the granularity, 2 MiB |
//!
//! Byte sizes are a number with an optional unit: `B`, `KiB`, `MiB`, `GiB`, `TiB` (or `K`,
//! `M`, `G`, `T`, the same powers of 1024).
//!
//! A malformed value is an error at start-up ([`EmmError::Config`]), never a silent fallback
//! to the default (Numba warns and falls back; emm refuses).

use crate::adaptors::Adaptor;
use crate::contract::info::PinnedPoolConfig;
use crate::error::EmmError;
pub use crate::managers::pool::{ENV_VMM_PIECE, vmm_piece_from_lookup};
pub use crate::memory::policy::{DeallocConfig, ENV_MAX_PENDING_COUNT, ENV_MAX_PENDING_RATIO};
pub use crate::units::parse_bytes;

/// `EMM_MEMORY_MANAGER`.
pub const ENV_MEMORY_MANAGER: &str = "EMM_MEMORY_MANAGER";

/// `EMM_MEMORY_ADAPTORS`.
pub const ENV_MEMORY_ADAPTORS: &str = "EMM_MEMORY_ADAPTORS";
/// `EMM_PINNED_HOST_POOL`.
pub const ENV_PINNED_HOST_POOL: &str = "EMM_PINNED_HOST_POOL";

/// `EMM_HOST_MEMORY_POOL`.
pub const ENV_HOST_MEMORY_POOL: &str = "EMM_HOST_MEMORY_POOL";

/// Reads `EMM_HOST_MEMORY_POOL` through `lookup`: whether `memhostalloc` takes its memory
/// from the driver's pool in host memory (`on`) or from `cuMemHostAlloc` (`off`, unset).
pub fn host_memory_pool_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<bool, EmmError> {
    let Some(value) = lookup(ENV_HOST_MEMORY_POOL) else {
        return Ok(false);
    };
    match value.trim().to_ascii_lowercase().as_str() {
        "off" | "0" | "no" | "false" | "" => Ok(false),
        "on" | "1" | "yes" | "true" => Ok(true),
        _ => Err(EmmError::Config {
            variable: ENV_HOST_MEMORY_POOL,
            value,
            reason: "use on (memhostalloc from the driver's host memory pool, CUDA 12.6 on) or \
                     off (cuMemHostAlloc)"
                .into(),
        }),
    }
}

/// Reads `EMM_PINNED_HOST_POOL` through `lookup`: `None` when unset or `off`.
pub fn pinned_pool_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<PinnedPoolConfig>, EmmError> {
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
        "on" | "1" | "yes" | "true" => Ok(Some(PinnedPoolConfig::default())),
        _ => {
            let max_cached = parse_bytes(&value).map_err(|e| {
                bad(format!(
                    "{e}; use on, off, or the bytes to keep cached (256MiB)"
                ))
            })?;
            Ok(Some(PinnedPoolConfig {
                max_cached,
                ..PinnedPoolConfig::default()
            }))
        }
    }
}

/// Reads `EMM_MEMORY_ADAPTORS` through `lookup`: the adaptors, innermost first.
pub fn adaptors_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<Adaptor>, EmmError> {
    let Some(value) = lookup(ENV_MEMORY_ADAPTORS) else {
        return Ok(Vec::new());
    };
    let bad = |reason: String| EmmError::Config {
        variable: ENV_MEMORY_ADAPTORS,
        value: value.clone(),
        reason,
    };
    let mut adaptors: Vec<Adaptor> = Vec::new();
    for (n, item) in value.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            return Err(bad(format!(
                "item {} is empty; list adaptors separated by single commas (such as \
                 'limit=8GiB,stats'), or unset it",
                n + 1
            )));
        }
        let adaptor = Adaptor::parse(item).map_err(&bad)?;
        if let Some(same) = adaptors.iter().find(|a| a.name() == adaptor.name()) {
            return Err(bad(format!(
                "'{}' appears twice (as {same:?} and as {adaptor:?}); name each adaptor once",
                adaptor.name()
            )));
        }
        adaptors.push(adaptor);
    }
    Ok(adaptors)
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
    use crate::units::tests::env;

    #[test]
    fn adaptor_lists_without_empty_items_or_repeats() {
        let read = |v: &str| adaptors_from_lookup(env(&[(ENV_MEMORY_ADAPTORS, v)]));
        assert_eq!(read(" limit=1GiB , stats ").unwrap().len(), 2);
        for (value, says) in [
            ("", "item 1 is empty"),
            ("stats,,stats", "item 2 is empty"),
            ("stats,", "item 2 is empty"),
            ("stats,stats", "'stats' appears twice"),
            ("log=a.csv,trace,log=b.csv", "'log' appears twice"),
        ] {
            let text = read(value).unwrap_err().to_string();
            assert!(text.starts_with(ENV_MEMORY_ADAPTORS), "{text}");
            assert!(text.contains(says), "{value:?}: {text}");
        }
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
