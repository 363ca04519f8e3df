//! The pool's tuning ([`PoolConfig`]) and `EMM_VMM_PIECE`.

use super::MAX_SMALL;
use crate::error::EmmError;

/// The pool's tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// The most bytes the pool grows by at once for requests up to this size (it grows by an
    /// eighth of what it holds, at least 2 MiB and at most this); a larger request gets a
    /// chunk of its own, its size rounded up to 2 MiB, which serves only requests above this
    /// size (under `vmm-pool`, whose chunks merge, it is served as any). At least 2 MiB (the
    /// smallest growth); default 128 MiB. Smaller chunks hold less beside memory in use, and
    /// take more driver calls: each growth is one, and a chunk freed whole goes back.
    pub chunk_size: usize,
    /// Requests up to this many bytes are served from size classes through per-thread
    /// shards; larger ones from the arena. At most [`MAX_SMALL`]; default 1 MiB.
    pub small_max: usize,
    /// Bytes of free blocks one shard keeps per size class before it hands a magazine of them
    /// on (at least 8 blocks are always kept). Default 4 MiB.
    pub cache_bytes_per_class: usize,
    /// Bytes of free blocks one shard keeps over all its classes before it hands a magazine of
    /// the class being freed on. With [`cache_bytes_per_class`](Self::cache_bytes_per_class)
    /// alone, a shard could cache 44 × that (176 MiB by default); this bounds all the shards
    /// together to shards × this, plus the depot's share. A shard also keeps the last block
    /// larger than this freed on its thread, outside the bound; the pool takes those back
    /// before it grows. Default 32 MiB.
    pub cache_bytes_per_shard: usize,
    /// Under `vmm-pool`, the bytes of every piece of physical memory the pool maps: a power
    /// of two, at least the device's granularity. `None` (the default): each growth maps
    /// pieces of the largest power of two up to a sixteenth of it, from the granularity
    /// (2 MiB) up to 64 MiB. Every piece is one `cuMemCreate` and one mapping, and goes back
    /// to the driver only when wholly free: larger pieces make a sleep, a wake and a large
    /// growth take fewer driver calls (each costs tens of microseconds, one at a time,
    /// whatever the piece's size), and may hold more where live blocks lie scattered.
    /// `EMM_VMM_PIECE` sets it for the registered `vmm-pool`.
    pub vmm_piece: Option<usize>,
}

impl PoolConfig {
    /// `vmm-pool`'s configuration: the default, with growth steps of at most 8 MiB (chunks
    /// mapped next to each other merge their free space and serve requests of every size, so
    /// the pool holds little beyond its blocks).
    pub fn vmm() -> PoolConfig {
        PoolConfig {
            chunk_size: 8 << 20,
            ..PoolConfig::default()
        }
    }

    /// The largest request served from the shared chunks: the chunk size. Larger requests get
    /// chunks of their own (the request rounded up to 2 MiB), which serve only requests above
    /// this size. Where chunks merge their free space (`merging`, `vmm-pool`), every request
    /// is served from the shared chunks: a large block spans chunks, and its chunks go back
    /// to the driver as any.
    pub(super) fn oversize_above(&self, merging: bool) -> usize {
        if merging { usize::MAX } else { self.chunk_size }
    }
}

/// `EMM_VMM_PIECE`: the registered `vmm-pool`'s [`PoolConfig::vmm_piece`], a byte size
/// (`32MiB`).
pub const ENV_VMM_PIECE: &str = "EMM_VMM_PIECE";

/// Reads `EMM_VMM_PIECE` through `lookup`: `None` when unset; a value that is not a byte size
/// or not a power of two is an error (whether it reaches the device's granularity is checked
/// when a pool is made on the device).
pub fn vmm_piece_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<usize>, EmmError> {
    let Some(value) = lookup(ENV_VMM_PIECE) else {
        return Ok(None);
    };
    let refused = |reason: String| EmmError::Config {
        variable: ENV_VMM_PIECE,
        value: value.clone(),
        reason,
    };
    let bytes = crate::units::parse_bytes(&value).map_err(refused)?;
    if !bytes.is_power_of_two() {
        return Err(refused(format!(
            "{bytes} bytes is not a power of two; give the size of vmm-pool's pieces of \
             physical memory as one, at least the device's granularity (2MiB, 32MiB, 64MiB)"
        )));
    }
    Ok(Some(bytes))
}

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig {
            chunk_size: 128 << 20,
            small_max: MAX_SMALL,
            cache_bytes_per_class: 4 << 20,
            cache_bytes_per_shard: 32 << 20,
            vmm_piece: None,
        }
    }
}
