//! The chunks of `vmm-pool`: physical memory mapped into one address reservation per pool
//! (the driver's virtual memory management), where the plain pool takes `cuMemAlloc` chunks.
//!
//! - The reservation is made at the first growth (four times the device's memory, so that
//!   freed ranges leave room) and queued for `cuMemAddressFree` by a reset, after the frees of
//!   its mappings; the next growth reserves anew.
//! - A growth maps a multiple of the smallest piece as pieces of physical memory side by side
//!   (a `cuMemCreate` and a `cuMemMap` each), then makes the whole range accessible to the
//!   device and its peers with one `cuMemSetAccess` each. Its new pieces are of the largest
//!   power of two up to a sixteenth of it, between the driver's granularity (2 MiB) and
//!   [`MAX_PIECE`] (the last one shorter where the growth is not a multiple), unless
//!   `PoolConfig::vmm_piece` sets one size for every piece. The driver's cost of giving a
//!   piece back (unmapping and releasing it) is per piece, whatever its size, so a large
//!   growth in large pieces makes a sleep, a wake and a trim of it take few calls, while a
//!   small growth keeps pieces small, so that holes between live blocks can go back. The
//!   arenas record each piece as a chunk of its own size. Chunks mapped next to each other
//!   merge their free space in the arenas, which serve every size from one address range,
//!   and a piece that the blocks around it leave wholly free can go back on its own, so that
//!   holes between live blocks hold no memory once the pool sheds them. A growth maps just
//!   past the arena's largest free block that ends at a chunk's end, so that block grows in
//!   place by what the request lacks (`grow_in_place`); where the range after it is taken,
//!   the growth goes at the lowest free range of the reservation that holds it.
//! - A growth that sheds free pieces keeps their physical memory: they are unmapped and mapped
//!   again, each at its own size, first in the range the growth maps (`release_or_spare`,
//!   `growth_layout`), and only the rest is made new; what a growth leaves of them is released
//!   when it ends (`release_spares`).
//! - A chunk goes back by `cuMemUnmap` then `cuMemRelease`, made by the pool itself (the
//!   deferred-deallocation queue holds `cuMemAlloc` memory's frees): at once, or inside
//!   `defer_cleanup` (the queue suspended) at the first release or growth after it (a reset
//!   unmaps at once, guard or not). Its range is
//!   free for a new mapping once unmapped; a range whose unmapping failed is not used again, and
//!   leaves the reservation to the context's destruction.
//! - **Sleep** ([`PoolShared::sleep`]) gives back the physical memory of every piece that no
//!   kept allocation lies in, and keeps the reservation, so every address the pool handed out
//!   stays valid: the pieces it unmapped are recorded (`VmmInner::asleep`) and the arena still
//!   owns their ranges. Allocations to offload are copied first, into one page-locked host
//!   buffer; a failure there leaves the pool as it was. The wake makes and maps a new piece at
//!   each recorded address, grants access once per run of them, and copies the offloaded
//!   allocations back. A piece that goes back while asleep (a trim, a reset) is only
//!   forgotten: it is unmapped already. Allocations are refused while asleep (the context
//!   refuses them before the pool is reached), so no block of an unmapped piece is handed out.
//! - Memory to share with other processes (`memalloc_shared`) is not the pool's: each such
//!   allocation is physical memory of its own (its size rounded up to the granularity, one
//!   `cuMemCreate`), mapped in an address reservation of its own, and unmapped and released
//!   when its last pointer drops, never handed to another allocation. Where the driver shares
//!   physical memory as POSIX file descriptors
//!   (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`), it is exported as
//!   that one piece ([`MappedExport`]): the other process reaches this allocation and nothing
//!   else, and keeps it past the exporter's free without seeing anyone's later data. The
//!   pool's own blocks are refused for export: their pieces hold other allocations, and the
//!   pool reuses them after a free. A reset leaves shared allocations alone (another process
//!   may map them); they go at their last pointer's drop.

use std::collections::BTreeMap;

use driver_sys::{
    DeviceAttribute, DeviceOrdinal, DevicePtr, DriverError, ErrorKind, HostPtr, PhysHandle,
};

use super::PoolShared;
use super::arena::Chunk;
use crate::contract::factory::ManagerContext;
use crate::contract::mapped_export::MappedExport;
use crate::error::EmmError;
use crate::memory::pending::Free;
use crate::sync::{Mutex, Ordering, lock};

mod sleep;

use sleep::Stash;

/// The reservation is this many times the device's memory.
const RESERVE_FACTOR: usize = 4;

/// Runs of mapped pieces of one size side by side, as (base, bytes, piece), in address order.
pub(super) type Runs = Vec<(u64, usize, usize)>;

/// The largest piece a growth maps (unless the smallest piece is larger).
pub(super) const MAX_PIECE: usize = 64 << 20;

/// A growth maps pieces of the largest power of two up to this fraction of it.
const PIECES_PER_GROWTH: usize = 16;

/// A pool's address reservation and what is mapped in it.
pub(super) struct VmmSpace {
    /// The unit of every size and address (`cuMemGetAllocationGranularity`).
    granularity: usize,
    /// The size of the smallest piece of physical memory the pool maps, a power of two and a
    /// multiple of the granularity: the configured piece
    /// ([`PoolConfig::vmm_piece`](super::PoolConfig::vmm_piece)), else the granularity. Every
    /// piece is a multiple of it and lies at a multiple of it in the reservation.
    pub(super) piece: usize,
    /// The largest piece a growth maps: the configured piece where one is set (every piece
    /// is of that size), else [`MAX_PIECE`] (or the granularity if larger).
    max_piece: usize,
    /// The devices granted access to every chunk: this one and its peers.
    access: Vec<DeviceOrdinal>,
    /// Chunks are made exportable as POSIX file descriptors.
    shareable: bool,
    reserve_bytes: usize,
    inner: Mutex<VmmInner>,
    /// Allocations to share (`memalloc_shared`), each its own physical memory mapped at its
    /// own reservation: (size, physical handle) by base. Apart from `inner`, which a reset
    /// clears: they outlive resets.
    shared: Mutex<BTreeMap<u64, (usize, PhysHandle)>>,
    /// While asleep, the offloaded allocations' contents. Taken after `inner`, never before.
    stash: Mutex<Option<Stash>>,
    /// A page-locked host buffer a wake kept for the next sleep's offload
    /// ([`SleepOptions::with_host_buffer_kept`](crate::contract::SleepOptions::with_host_buffer_kept)):
    /// (address, bytes). Taken after `stash`, never before.
    kept_buffer: Mutex<Option<(HostPtr, usize)>>,
}

#[derive(Default)]
struct VmmInner {
    /// (base, size) of the reservation, once made.
    reservation: Option<(u64, usize)>,
    /// Ranges of the reservation with nothing mapped: start → size.
    free: BTreeMap<u64, usize>,
    /// Chunks given back inside `defer_cleanup`: unmapped and released after it.
    deferred: Vec<(u64, usize, PhysHandle)>,
    /// The size of each chunk and the physical allocation behind it, by the chunk's base.
    handles: BTreeMap<u64, (usize, PhysHandle)>,
    /// A failed growth could not unmap what it mapped: the reservation cannot be freed.
    stranded: bool,
    /// Growths between taking a range and recording (or giving back) what they mapped there:
    /// a reset does not free the reservation under them.
    growing: usize,
    /// Pieces of physical memory a growth's shedding unmapped, as (size, handle), for the
    /// growth to map where it needs pieces of their size instead of making new ones
    /// ([`PoolShared::release_spares`] releases what it leaves).
    spare: Vec<(usize, PhysHandle)>,
    /// The pool is asleep ([`PoolShared::sleep`]).
    sleeping: bool,
    /// Pieces a sleep unmapped and released, their ranges still the arena's: size by base.
    /// The wake maps a new piece at each; one that goes back meanwhile is only forgotten.
    asleep: BTreeMap<u64, usize>,
    /// Pieces a failed wake mapped and could not unmap again, without their access grant:
    /// the next wake grants it.
    ungranted: std::collections::BTreeSet<u64>,
}

impl VmmInner {
    /// Bytes of physical memory mapped in the reservation now.
    fn mapped_bytes(&self) -> usize {
        self.handles.values().map(|&(size, _)| size).sum::<usize>()
            + self
                .deferred
                .iter()
                .map(|&(_, size, _)| size)
                .sum::<usize>()
    }
}

impl VmmSpace {
    /// The space of a pool on `cx`'s device, refused with an error that names the managers
    /// that work where the device or its driver lacks virtual memory management.
    /// Pieces are of `piece` bytes (`None`: chosen per growth, from the granularity up to
    /// [`MAX_PIECE`]); one that is not a power of two and a multiple of the granularity is
    /// refused.
    pub(super) fn new(
        cx: &ManagerContext,
        manager: &str,
        piece: Option<usize>,
    ) -> Result<VmmSpace, EmmError> {
        let refused = |reason: String| EmmError::NoVirtualMemory {
            manager: manager.to_owned(),
            device: cx.device,
            reason,
        };
        let supported = cx
            .driver
            .device_attribute(cx.device, DeviceAttribute::VirtualMemoryManagement)
            .map_err(|e| refused(format!("reading the attribute failed: {e}")))?;
        if supported == 0 {
            return Err(refused(
                "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0".into(),
            ));
        }
        let granularity = cx
            .driver
            .mem_vmm_granularity(cx.device)
            .map_err(|e| refused(format!("reading its granularity failed: {e}")))?;
        let configured = piece.is_some();
        let piece = piece.unwrap_or(granularity);
        if !piece.is_power_of_two() || !piece.is_multiple_of(granularity) {
            return Err(EmmError::InvalidArgument {
                what: "PoolConfig::vmm_piece",
                reason: format!(
                    "{piece} bytes is not a power of two that is a multiple of device {}'s \
                     granularity ({granularity} bytes); give one (EMM_VMM_PIECE=32MiB) or \
                     leave it unset for pieces sized to each growth",
                    cx.device
                ),
            });
        }
        let total = cx
            .driver
            .device_total_mem(cx.device)
            .map_err(|e| EmmError::driver("cuDeviceTotalMem", cx.device, e))?;
        let reserve_bytes = (total.saturating_mul(RESERVE_FACTOR)).div_ceil(piece) * piece;
        let count = cx
            .driver
            .device_count()
            .map_err(|e| EmmError::driver("cuDeviceGetCount", cx.device, e))?;
        let mut access = vec![cx.device];
        for d in (0..count).map(DeviceOrdinal).filter(|&d| d != cx.device) {
            match cx.driver.device_can_access_peer(d, cx.device) {
                Ok(true) => access.push(d),
                Ok(false) => {}
                // Left out: its copies of this pool's memory stage through the host.
                Err(e) => {
                    tracing::warn!(device = %cx.device, peer = %d, error = %e, "cannot tell whether a device reaches vmm-pool's memory as a peer; it is not granted access")
                }
            }
        }
        let shareable = cfg!(unix)
            && cx
                .driver
                .device_attribute(cx.device, DeviceAttribute::HandleTypePosixFileDescriptor)
                .map_err(|e| EmmError::driver("cuDeviceGetAttribute", cx.device, e))?
                == 1;
        Ok(VmmSpace {
            granularity,
            piece,
            max_piece: if configured {
                piece
            } else {
                piece.max(MAX_PIECE)
            },
            access,
            shareable,
            reserve_bytes,
            inner: Mutex::new(VmmInner::default()),
            shared: Mutex::new(BTreeMap::new()),
            stash: Mutex::new(None),
            kept_buffer: Mutex::new(None),
        })
    }

    /// `bytes` rounded up to the granularity.
    fn round(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.granularity) * self.granularity
    }

    /// `bytes` rounded up to the smallest piece.
    fn round_to_piece(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.piece) * self.piece
    }

    /// The piece a growth of `bytes` (a multiple of the smallest piece) maps: the largest
    /// power of two up to a sixteenth of it, between the smallest piece and the largest.
    fn piece_for(&self, bytes: usize) -> usize {
        growth_piece(bytes, self.piece, self.max_piece)
    }
}

impl VmmInner {
    /// Takes the lowest free range of at least `size` bytes.
    fn place(&mut self, size: usize) -> Option<u64> {
        let (&start, &got) = self.free.iter().find(|&(_, &got)| got >= size)?;
        self.free.remove(&start);
        if got > size {
            self.free.insert(start + size as u64, got - size);
        }
        Some(start)
    }

    /// The free range (start, size) that holds all of `size` bytes at `at`, if one does.
    fn free_range_holding(&self, at: u64, size: usize) -> Option<(u64, usize)> {
        let (&start, &got) = self.free.range(..=at).next_back()?;
        (at + size as u64 <= start + got as u64).then_some((start, got))
    }

    /// Takes `size` bytes at `at`, when all of them are free.
    fn place_at(&mut self, at: u64, size: usize) -> bool {
        let Some((start, got)) = self.free_range_holding(at, size) else {
            return false;
        };
        let (end, taken_end) = (start + got as u64, at + size as u64);
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, (at - start) as usize);
        }
        if end > taken_end {
            self.free.insert(taken_end, (end - taken_end) as usize);
        }
        true
    }

    /// Gives a range back to the free ones, merged with its neighbours.
    fn give(&mut self, start: u64, size: usize) {
        let (mut start, mut size) = (start, size);
        if let Some((&before, &len)) = self.free.range(..start).next_back()
            && before + len as u64 == start
        {
            self.free.remove(&before);
            start = before;
            size += len;
        }
        let end = start + size as u64;
        if let Some(len) = self.free.remove(&end) {
            size += len;
        }
        self.free.insert(start, size);
    }
}

impl PoolShared {
    /// New memory of at least `bytes` bytes from the pool's source, side by side, as runs of
    /// pieces of one size, (base, bytes, piece) in address order: `cuMemAlloc` (one run of one
    /// piece), or physical memory mapped into the pool's reservation (its size rounded up to
    /// the smallest piece; [`map_placed`](Self::map_placed)).
    pub(super) fn allocate_chunk(&self, bytes: usize) -> Result<Runs, DriverError> {
        let Some(vmm) = &self.vmm else {
            let base = self.cx.driver.mem_alloc(self.cx.context, bytes)?;
            self.totals
                .driver_allocations
                .fetch_add(1, Ordering::Relaxed);
            return Ok(vec![(base.0, bytes, bytes)]);
        };
        let (cx, bytes) = (&self.cx, vmm.round_to_piece(bytes));
        // Chunks given back inside a defer_cleanup that has since ended go first.
        self.release_chunks(Vec::new(), false);
        let at = {
            let mut inner = lock(&vmm.inner);
            if inner.reservation.is_none() {
                // The driver aligns a reservation to the granularity: a piece less the
                // granularity more leaves room to start the pool's range at a multiple of the
                // smallest piece.
                let extra = vmm.piece - vmm.granularity;
                let size = vmm.reserve_bytes + extra;
                let base = cx.driver.mem_address_reserve(cx.context, size)?;
                inner.reservation = Some((base.0, size));
                inner
                    .free
                    .insert(base.0.next_multiple_of(vmm.piece as u64), vmm.reserve_bytes);
            }
            let at = inner.place(bytes).ok_or_else(|| {
                DriverError::from_kind("cuMemAddressReserve", ErrorKind::OutOfMemory)
            })?;
            inner.growing += 1;
            at
        };
        self.map_placed(vmm, at, bytes, vmm.piece_for(bytes))
    }

    /// `vmm-pool`: memory to share with other processes, of at least `bytes` bytes: physical
    /// memory of its own (`bytes` rounded up to the granularity), mapped in a reservation of
    /// its own and made accessible to the device and its peers, as (base, size). Nothing else
    /// ever lies in it; [`release_shared`](Self::release_shared) gives it back.
    #[allow(unsafe_code)]
    pub(super) fn allocate_shared(&self, bytes: usize) -> Result<(u64, usize), DriverError> {
        let vmm = self
            .vmm
            .as_ref()
            .expect("only vmm-pool allocates shared memory");
        let (cx, size) = (&self.cx, vmm.round(bytes.max(1)));
        let handle = cx
            .driver
            .mem_create(cx.context, cx.device, size, vmm.shareable)?;
        self.totals
            .driver_allocations
            .fetch_add(1, Ordering::Relaxed);
        let undo_create = |e: DriverError| {
            self.release_piece(handle);
            e
        };
        let base = cx
            .driver
            .mem_address_reserve(cx.context, size)
            .map_err(undo_create)?;
        let undo_reserve = |e: DriverError| {
            // SAFETY: reserved just above, with nothing mapped in it (or its mapping undone).
            if let Err(undo) = unsafe { cx.driver.mem_address_free(cx.context, base, size) } {
                tracing::error!(device = %cx.device, error = %undo, ptr = base.0, "freeing the reservation of a failed shared allocation failed");
            }
            undo_create(e)
        };
        // SAFETY: `base .. base + size` is the reservation made above, with nothing mapped.
        unsafe { cx.driver.mem_map(cx.context, base, size, handle) }.map_err(undo_reserve)?;
        let accessible = vmm
            .access
            .iter()
            .try_for_each(|&d| cx.driver.mem_set_access(cx.context, base, size, d));
        if let Err(e) = accessible {
            let unmapped = self.unmap_only(base.0, size);
            if !unmapped {
                // The range stays mapped: its reservation is left to the context's end.
                self.release_piece(handle);
                return Err(e);
            }
            return Err(undo_reserve(e));
        }
        lock(&vmm.shared).insert(base.0, (size, handle));
        tracing::debug!(device = %cx.device, bytes = size, ptr = base.0, "vmm-pool memory to share allocated");
        Ok((base.0, size))
    }

    /// Gives back the shared allocation at `base` ([`allocate_shared`](Self::allocate_shared)),
    /// whose last pointer dropped: unmapped, its reservation freed and its physical memory
    /// released (another process that opened it keeps that memory until it unmaps it). Once
    /// the context is gone there is nothing to do.
    #[allow(unsafe_code)]
    pub(super) fn release_shared(&self, base: u64) {
        let Some(vmm) = self.vmm.as_ref() else {
            return;
        };
        let Some((size, handle)) = lock(&vmm.shared).remove(&base) else {
            return;
        };
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        if !self.unmap_chunk(base, size, handle) {
            // Freeing a reservation with a mapping in it is refused: the context's end takes it.
            return;
        }
        // SAFETY: the allocation's own reservation, unmapped above, freed once here (its
        // record was taken above).
        if let Err(e) = unsafe {
            self.cx
                .driver
                .mem_address_free(self.cx.context, DevicePtr(base), size)
        } {
            tracing::error!(device = %self.cx.device, error = %e, ptr = base, "freeing a shared allocation's reservation failed");
            self.queue
                .record_error(EmmError::driver("cuMemAddressFree", self.cx.device, e));
        }
    }

    /// `vmm-pool`: whether `bytes` (rounded up to the piece) at `at` are free in the
    /// reservation now, so that a growth may map there (a racing growth may still take them
    /// first: [`allocate_chunk_at`](Self::allocate_chunk_at) checks again).
    pub(super) fn can_map_at(&self, at: u64, bytes: usize) -> bool {
        let Some(vmm) = &self.vmm else {
            return false;
        };
        let bytes = vmm.round_to_piece(bytes);
        lock(&vmm.inner).free_range_holding(at, bytes).is_some()
    }

    /// `vmm-pool`: at least `bytes` bytes mapped at `at` exactly (just past a chunk, so that
    /// free space runs on into it), as runs of pieces of one size ([`map_placed`](Self::map_placed));
    /// `None` where that range of the reservation is not free, or the pool has no reservation.
    pub(super) fn allocate_chunk_at(
        &self,
        at: u64,
        bytes: usize,
    ) -> Result<Option<Runs>, DriverError> {
        let Some(vmm) = &self.vmm else {
            return Ok(None);
        };
        let bytes = vmm.round_to_piece(bytes);
        // Chunks given back inside a defer_cleanup that has since ended go first.
        self.release_chunks(Vec::new(), false);
        {
            let mut inner = lock(&vmm.inner);
            if inner.reservation.is_none() || !inner.place_at(at, bytes) {
                return Ok(None);
            }
            inner.growing += 1;
        }
        self.map_placed(vmm, at, bytes, vmm.piece_for(bytes))
            .map(Some)
    }

    /// Maps `bytes` at `at`, a range taken from the reservation's free ones by a growth
    /// (counted in `growing`): the spares a shedding left first, then new pieces of `piece`
    /// bytes ([`growth_layout`]); records them and returns them as runs of pieces of one size,
    /// (base, bytes, piece) in address order. On failure the range is free again unless a
    /// mapping could not be undone.
    fn map_placed(
        &self,
        vmm: &VmmSpace,
        at: u64,
        bytes: usize,
        piece: usize,
    ) -> Result<Runs, DriverError> {
        let layout = growth_layout(at, bytes, piece, &mut lock(&vmm.inner).spare);
        let mut pieces = Vec::with_capacity(layout.len());
        let Err(failed) = self.map_pieces(vmm, &layout, &mut pieces) else {
            let mut inner = lock(&vmm.inner);
            inner.growing -= 1;
            for &(base, size, handle) in &pieces {
                inner.handles.insert(base, (size, handle));
            }
            return Ok(runs_of(&pieces));
        };
        // Undone piece by piece: a piece left mapped strands the range. The spares past the
        // piece that failed go back to the growth's spares (released when it ends).
        let mut free_again = true;
        for &(base, size, handle) in &pieces {
            free_again &= self.unmap_chunk(base, size, handle);
        }
        let mut inner = lock(&vmm.inner);
        inner.spare.extend(
            layout[(pieces.len() + 1).min(layout.len())..]
                .iter()
                .filter_map(|&(_, size, spare)| Some((size, spare?))),
        );
        inner.growing -= 1;
        if free_again {
            inner.give(at, bytes);
        } else {
            inner.stranded = true;
        }
        Err(failed)
    }

    /// Maps the pieces `layout`, (base, size, spare) side by side in a range of the
    /// reservation with nothing mapped: each the spare given, or physical memory made for it,
    /// adding each mapped one to `pieces` as (base, size, handle); then makes the whole range
    /// accessible to the device and its peers with one call each. On failure the caller
    /// undoes `pieces`; the piece that failed is released, the spares after it are the
    /// caller's.
    #[allow(unsafe_code)]
    fn map_pieces(
        &self,
        vmm: &VmmSpace,
        layout: &[(u64, usize, Option<PhysHandle>)],
        pieces: &mut Vec<(u64, usize, PhysHandle)>,
    ) -> Result<(), DriverError> {
        let cx = &self.cx;
        let (Some(&(at, _, _)), Some(&(last, last_size, _))) = (layout.first(), layout.last())
        else {
            return Ok(());
        };
        for &(base, size, spare) in layout {
            let handle = match spare {
                Some(handle) => handle,
                None => {
                    let handle =
                        cx.driver
                            .mem_create(cx.context, cx.device, size, vmm.shareable)?;
                    self.totals
                        .driver_allocations
                        .fetch_add(1, Ordering::Relaxed);
                    handle
                }
            };
            // SAFETY: `base .. base + size` lies in a range taken from the
            // reservation's free ones, with nothing mapped there.
            let mapped = unsafe { cx.driver.mem_map(cx.context, DevicePtr(base), size, handle) };
            if let Err(e) = mapped {
                // SAFETY: made above, or a spare its shedding unmapped; mapped nowhere.
                if let Err(undo) = unsafe { cx.driver.mem_release(cx.context, handle) } {
                    tracing::error!(device = %cx.device, error = %undo, ptr = base, "cuMemRelease failed while undoing a growth of the pool");
                    self.queue
                        .record_error(EmmError::driver("cuMemRelease", cx.device, undo));
                }
                return Err(e);
            }
            pieces.push((base, size, handle));
        }
        // The device itself, and every device that can reach its memory as a peer (as it can
        // `cuMemAlloc` memory once peer access is on): one call covers every piece.
        let bytes = (last - at) as usize + last_size;
        vmm.access.iter().try_for_each(|&d| {
            cx.driver
                .mem_set_access(cx.context, DevicePtr(at), bytes, d)
        })
    }

    /// Gives `chunks` back to their source: `cuMemAlloc` chunks through the deferred queue
    /// (the caller flushes), mapped ones unmapped and released here. Inside `defer_cleanup`
    /// mapped chunks wait, unless `now` (a reset, which gives up every block of them), for the
    /// first release or growth after it; each call also takes those left before. A failure is
    /// logged and recorded for the next flush to return.
    ///
    /// With `spare` (a growth sheds them), mapped chunks are unmapped and their physical pieces
    /// kept for the growth to map again where it needs them: memory moves in the reservation
    /// instead of going back to the driver and coming again. The growth's caller releases what
    /// it left ([`release_spares`](Self::release_spares)).
    pub(super) fn release_chunks(&self, chunks: Vec<Chunk>, now: bool) {
        self.release_or_spare(chunks, now, false);
    }

    /// [`release_chunks`](Self::release_chunks), keeping the pieces as spares with `spare`.
    pub(super) fn release_or_spare(&self, chunks: Vec<Chunk>, now: bool, spare: bool) {
        let Some(vmm) = &self.vmm else {
            self.totals
                .driver_frees
                .fetch_add(chunks.len() as u64, Ordering::Relaxed);
            self.queue
                .push_all_without_flush(chunks.into_iter().map(|c| Free::Device {
                    ptr: DevicePtr(c.base),
                    bytes: c.size,
                }));
            return;
        };
        // Read before the space's lock, which is taken after every other.
        let wait = !now && self.queue.is_disabled();
        let mut inner = lock(&vmm.inner);
        for c in chunks {
            match inner.handles.remove(&c.base) {
                Some((_, handle)) => inner.deferred.push((c.base, c.size, handle)),
                // Unmapped and released by a sleep: its range is free again, with no call.
                None if inner.asleep.remove(&c.base).is_some() => inner.give(c.base, c.size),
                None => {
                    tracing::warn!(device = %self.cx.device, ptr = c.base, "a chunk of a reservation given up by a reset is not unmapped again")
                }
            }
        }
        if inner.deferred.is_empty() || wait {
            return;
        }
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        for (base, size, handle) in std::mem::take(&mut inner.deferred) {
            let unmapped = if spare {
                self.unmap_only(base, size)
                    .then(|| inner.spare.push((size, handle)))
                    .is_some()
            } else {
                self.unmap_chunk(base, size, handle)
            };
            if unmapped {
                inner.give(base, size);
            } else {
                inner.stranded = true;
            }
        }
    }

    /// `vmm-pool`: releases the physical pieces a growth's shedding left unmapped and did not
    /// map again (`cuMemRelease`). Called when a growth is over, whether it succeeded or not.
    pub(super) fn release_spares(&self) {
        let Some(vmm) = &self.vmm else {
            return;
        };
        let spare = std::mem::take(&mut lock(&vmm.inner).spare);
        if spare.is_empty() {
            return;
        }
        let Some(_live) = self.cx.liveness.enter() else {
            // The context's destruction released them.
            return;
        };
        tracing::debug!(device = %self.cx.device, pieces = spare.len(), "pieces a growth moved and did not map went back to the driver");
        // Unmapped by the shedding that kept them, and mapped nowhere since.
        for (_, handle) in spare {
            self.release_piece(handle);
        }
    }

    /// `vmm-pool`: exports `len` bytes at `ptr`, which must lie in one shared allocation
    /// ([`allocate_shared`](Self::allocate_shared)), as its physical memory: one file
    /// descriptor for the allocation's one piece, and where the bytes lie in it. The pool's
    /// own blocks are refused: their pieces hold other allocations and are reused after a free,
    /// which another process that mapped them would see.
    #[cfg(unix)]
    pub(super) fn export_mapped(&self, ptr: u64, len: usize) -> Result<MappedExport, EmmError> {
        let cx = &self.cx;
        let Some(vmm) = &self.vmm else {
            return Err(EmmError::no_mapped_export(super::POOL_MANAGER));
        };
        if !vmm.shareable {
            return Err(EmmError::NotSupported {
                operation: "export_mapped",
                manager: super::VMM_POOL_MANAGER.into(),
                advice: "the driver does not share this device's physical memory as POSIX file \
                         descriptors (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED \
                         is 0); allocate memory to share between processes under 'pool' or \
                         'async-pool-ipc'",
            });
        }
        let source = cx.device_identity()?;
        let _live = cx.enter("export_mapped")?;
        // Under the lock: the allocation is not released while its descriptor is made.
        let shared = lock(&vmm.shared);
        let end = ptr.saturating_add(len as u64);
        let found = shared
            .range(..=ptr)
            .next_back()
            .filter(|(base, (size, _))| len > 0 && end <= **base + *size as u64);
        let Some((&base, &(size, handle))) = found else {
            return Err(EmmError::InvalidArgument {
                what: "memory to export",
                reason: format!(
                    "{len} bytes at {ptr:#x} are not memory allocated to share: vmm-pool's own \
                     blocks lie in physical memory with other allocations, which the other \
                     process would reach, and which the pool hands out again after a free; \
                     allocate memory to share with Context::memalloc_shared and export that"
                ),
            });
        };
        let fd = cx
            .driver
            .mem_export_fd(cx.context, handle)
            .map_err(|e| EmmError::driver("cuMemExportToShareableHandle", cx.device, e))?;
        tracing::debug!(device = %cx.device, ptr, len, "vmm-pool shared memory exported as a file descriptor");
        Ok(MappedExport::new(
            source,
            (ptr - base) as usize,
            len,
            vec![(size, fd)],
        ))
    }

    /// Off Unix there are no file descriptors to export memory as: refused.
    #[cfg(not(unix))]
    pub(super) fn export_mapped(&self, _ptr: u64, _len: usize) -> Result<MappedExport, EmmError> {
        Err(EmmError::no_mapped_export(super::VMM_POOL_MANAGER))
    }

    /// Unmaps one chunk, keeping its physical memory; whether it was unmapped (a failure is
    /// logged and recorded for the next flush to return).
    #[allow(unsafe_code)]
    fn unmap_only(&self, base: u64, size: usize) -> bool {
        let cx = &self.cx;
        // SAFETY: a chunk of this pool with nothing in use (the stream work that used it is
        // done: the shed and trim rules), or one a reset gave up, whose blocks the reset's
        // contract says are no longer used; the mapping is this pool's, unmapped once here.
        match unsafe { cx.driver.mem_unmap(cx.context, DevicePtr(base), size) } {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(device = %cx.device, error = %e, ptr = base, "cuMemUnmap of a pool chunk failed");
                self.queue
                    .record_error(EmmError::driver("cuMemUnmap", cx.device, e));
                false
            }
        }
    }

    /// Releases one piece of physical memory, mapped nowhere now (or whose mapping is being
    /// given up with it); a failure is logged and recorded for the next flush to return.
    #[allow(unsafe_code)]
    fn release_piece(&self, handle: PhysHandle) {
        let cx = &self.cx;
        self.totals.driver_frees.fetch_add(1, Ordering::Relaxed);
        // SAFETY: made by this pool and released once, here; its memory goes once its mapping
        // does.
        if let Err(e) = unsafe { cx.driver.mem_release(cx.context, handle) } {
            tracing::error!(device = %cx.device, error = %e, "cuMemRelease of a pool piece failed");
            self.queue
                .record_error(EmmError::driver("cuMemRelease", cx.device, e));
        }
    }

    /// Unmaps and releases one chunk; whether its range is free again.
    fn unmap_chunk(&self, base: u64, size: usize, handle: PhysHandle) -> bool {
        let unmapped = self.unmap_only(base, size);
        self.release_piece(handle);
        unmapped
    }

    /// A reset, after its chunks were given back: the reservation is freed, once
    /// (a failure is logged and recorded for the next flush to return; the context's
    /// destruction takes the reservation then), and the next growth makes a new one. Where an
    /// unmapping failed, the reservation is left to the context's destruction: freeing it with
    /// a mapping in it would be refused.
    #[allow(unsafe_code)]
    pub(super) fn free_reservation(&self) {
        let Some(vmm) = self.vmm.as_ref() else {
            return;
        };
        let (base, size) = {
            let mut inner = lock(&vmm.inner);
            let Some((base, size)) = inner.reservation else {
                return;
            };
            // A growth that raced the reset mapped (or is mapping) a chunk the reset did not
            // see, or chunks given back inside defer_cleanup are still mapped: the reservation
            // stays, with them, for the first release after defer_cleanup and the next reset.
            if !inner.handles.is_empty() || inner.growing > 0 || !inner.deferred.is_empty() {
                tracing::info!(device = %self.cx.device, chunks = inner.handles.len(), deferred = inner.deferred.len(), "the pool's reservation stays after a reset: chunks are still mapped in it");
                return;
            }
            let stranded = inner.stranded;
            *inner = VmmInner::default();
            if stranded {
                // Forgotten: the context's destruction takes it (freeing it with a mapping in
                // it would be refused).
                tracing::warn!(device = %self.cx.device, ptr = base, "a reset left a mapping in the pool's reservation; the context's destruction takes the reservation");
                return;
            }
            (base, size)
        };
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        // SAFETY: the pool's own reservation, given up here once (its record was taken above),
        // with no mapping left in it: every unmapping was issued and none failed.
        let freed = unsafe {
            self.cx
                .driver
                .mem_address_free(self.cx.context, DevicePtr(base), size)
        };
        if let Err(e) = freed {
            tracing::error!(device = %self.cx.device, error = %e, ptr = base, "freeing the pool's address reservation failed; the context's destruction takes it");
            self.queue
                .record_error(EmmError::driver("cuMemAddressFree", self.cx.device, e));
        }
    }
}

/// The piece a growth of `bytes` maps: the largest power of two up to a sixteenth of it,
/// between `smallest` and `largest` (both powers of two).
fn growth_piece(bytes: usize, smallest: usize, largest: usize) -> usize {
    match bytes / PIECES_PER_GROWTH {
        0 => smallest,
        share => (1 << share.ilog2()).clamp(smallest, largest),
    }
}

/// The pieces a growth of `bytes` at `at` maps, as (base, size, spare) side by side: first
/// spares taken from `spares` (the largest that fits what is left, while one does), then new
/// pieces of `piece` bytes (the last one shorter where what is left is not a multiple).
fn growth_layout<H: Copy>(
    at: u64,
    bytes: usize,
    piece: usize,
    spares: &mut Vec<(usize, H)>,
) -> Vec<(u64, usize, Option<H>)> {
    let mut layout = Vec::new();
    let mut off = 0;
    spares.sort_unstable_by_key(|&(size, _)| std::cmp::Reverse(size));
    spares.retain(|&(size, handle)| {
        let fits = size <= bytes - off;
        if fits {
            layout.push((at + off as u64, size, Some(handle)));
            off += size;
        }
        !fits
    });
    while off < bytes {
        let size = piece.min(bytes - off);
        layout.push((at + off as u64, size, None));
        off += size;
    }
    layout
}

/// Mapped pieces (base, size, handle), side by side in address order, as runs of pieces of
/// one size, (base, bytes, piece).
fn runs_of<H>(pieces: &[(u64, usize, H)]) -> Runs {
    let mut runs: Runs = Vec::new();
    for &(base, size, _) in pieces {
        match runs.last_mut() {
            Some((_, bytes, piece)) if *piece == size => *bytes += size,
            _ => runs.push((base, size, size)),
        }
    }
    runs
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::{MAX_PIECE, VmmInner, growth_layout, growth_piece, runs_of};

    #[test]
    fn a_growth_maps_pieces_of_a_sixteenth_of_it_within_the_bounds() {
        const MIB: usize = 1 << 20;
        let piece = |bytes| growth_piece(bytes, 2 * MIB, MAX_PIECE);
        assert_eq!(piece(2 * MIB), 2 * MIB, "the smallest piece below 32 MiB");
        assert_eq!(piece(8 * MIB), 2 * MIB);
        assert_eq!(piece(64 * MIB), 4 * MIB);
        assert_eq!(piece(100 * MIB), 4 * MIB, "the power of two below 6.25 MiB");
        assert_eq!(piece(1024 * MIB), 64 * MIB);
        assert_eq!(piece(40 << 30), MAX_PIECE, "never above the largest");
        assert_eq!(
            growth_piece(64 * MIB, 32 * MIB, 32 * MIB),
            32 * MIB,
            "a configured piece"
        );
    }

    #[test]
    fn a_growth_maps_the_spares_that_fit_first_then_new_pieces_the_last_one_shorter() {
        const MIB: usize = 1 << 20;
        let h = |k: u32| k;
        let mut spares = vec![
            (2 * MIB, h(1)),
            (8 * MIB, h(2)),
            (4 * MIB, h(3)),
            (16 * MIB, h(4)),
        ];
        assert_eq!(
            growth_layout(0x1000_0000, 22 * MIB, 4 * MIB, &mut spares),
            vec![
                (0x1000_0000, 16 * MIB, Some(h(4))),
                (0x1100_0000, 4 * MIB, Some(h(3))),
                (0x1140_0000, 2 * MIB, Some(h(1))),
            ],
            "the largest spare that fits what is left, while one does"
        );
        assert_eq!(spares, vec![(8 * MIB, h(2))], "what did not fit stays");
        let layout = growth_layout(0x1000_0000, 18 * MIB, 4 * MIB, &mut spares);
        assert_eq!(
            layout,
            vec![
                (0x1000_0000, 8 * MIB, Some(h(2))),
                (0x1080_0000, 4 * MIB, None),
                (0x10c0_0000, 4 * MIB, None),
                (0x1100_0000, 2 * MIB, None),
            ],
            "new pieces for the rest, the last one shorter"
        );
        assert!(spares.is_empty());
        let pieces: Vec<_> = layout.iter().map(|&(b, s, _)| (b, s, h(0))).collect();
        assert_eq!(
            runs_of(&pieces),
            vec![
                (0x1000_0000, 8 * MIB, 8 * MIB),
                (0x1080_0000, 8 * MIB, 4 * MIB),
                (0x1100_0000, 2 * MIB, 2 * MIB),
            ],
            "runs of pieces of one size"
        );
        let mut none: Vec<(usize, u32)> = Vec::new();
        assert_eq!(
            runs_of(
                &growth_layout(0, 12 * MIB, 4 * MIB, &mut none)
                    .iter()
                    .map(|&(b, s, _)| (b, s, h(0)))
                    .collect::<Vec<_>>()
            ),
            vec![(0, 12 * MIB, 4 * MIB)],
            "new pieces of one size make one run"
        );
    }

    #[test]
    fn a_range_is_placed_at_an_address_only_where_all_of_it_is_free() {
        let mut inner = VmmInner::default();
        inner.free.insert(0x1000, 0x8000);
        assert!(
            !inner.place_at(0x800, 0x1000),
            "starts before the free range"
        );
        assert!(!inner.place_at(0x8000, 0x2000), "runs past its end");
        assert!(inner.place_at(0x3000, 0x2000));
        let left: Vec<(u64, usize)> = inner.free.iter().map(|(&a, &s)| (a, s)).collect();
        assert_eq!(left, vec![(0x1000, 0x2000), (0x5000, 0x4000)]);
        assert!(!inner.place_at(0x4000, 0x1000), "already taken");
        assert!(inner.place_at(0x1000, 0x2000), "the whole of a range");
        assert_eq!(inner.place(0x4000), Some(0x5000));
        assert!(inner.free.is_empty());
        inner.give(0x3000, 0x2000);
        inner.give(0x1000, 0x2000);
        assert_eq!(inner.free.iter().next(), Some((&0x1000, &0x4000)), "merged");
    }
}
