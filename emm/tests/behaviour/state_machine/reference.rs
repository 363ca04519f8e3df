//! The reference model: as simple as possible, sharing no code with emm. If it has a bug, the
//! test cannot catch the same bug in emm, so every rule here is written from Numba's
//! behaviour (numba-emm-spec §1–2), not from emm's code.

use proptest::prelude::*;
use proptest::sample::Index;
use proptest_state_machine::ReferenceStateMachine;

/// The byte budget, `floor(capacity * ratio)` with the runtime's settings (small, to be reached).
pub const MAX_PENDING_BYTES: usize = 4 << 20;
/// The count threshold (Numba: 10; smaller here so that sequences reach it often).
pub const MAX_PENDING_COUNT: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Device,
    Mapped,
    Pinned,
    MappedPin,
    Pin,
    /// Managed memory (`memallocmanaged`): freed by `cuMemFree`, counted by size, like device
    /// memory.
    Managed,
}

impl Kind {
    /// Whether a reset frees it (Numba's `allocations` holds it).
    pub fn tracked(self) -> bool {
        matches!(
            self,
            Kind::Device | Kind::Mapped | Kind::MappedPin | Kind::Managed
        )
    }

    /// Whether its handle can be cloned.
    pub fn shareable(self) -> bool {
        matches!(
            self,
            Kind::Device | Kind::Mapped | Kind::MappedPin | Kind::Managed
        )
    }

    /// Whether it has a device pointer a view can be taken of.
    pub fn viewable(self) -> bool {
        matches!(self, Kind::Device | Kind::Managed)
    }
}

#[derive(Clone, Debug)]
pub struct Alloc {
    pub kind: Kind,
    pub bytes: usize,
    pub refs: usize,
    /// Released by its last handle or by a reset.
    pub released: bool,
}

/// A free the queue holds: which allocation, and the bytes it counts for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pending {
    Device { alloc: usize, bytes: usize },
    Host { alloc: usize, bytes: usize },
    Managed { alloc: usize, bytes: usize },
}

#[derive(Clone, Debug)]
pub struct Export {
    pub alloc: usize,
    pub open: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Model {
    pub allocs: Vec<Alloc>,
    /// Each handle is the index of its allocation.
    pub handles: Vec<usize>,
    pub exports: Vec<Export>,
    pub pending: Vec<Pending>,
    pub pending_bytes: usize,
    pub defer: usize,
    /// What the driver still holds for this process.
    pub device_live: usize,
    pub managed_live: usize,
    pub host_live: usize,
    pub pins_live: usize,
    /// Allocations that queued work holds (one entry per piece of work).
    pub in_flight: Vec<usize>,
}

#[derive(Clone, Debug)]
pub enum Transition {
    Alloc(Kind, usize),
    Clone(Index),
    View(Index),
    Drop(Index),
    EnterDefer,
    LeaveDefer,
    Flush,
    Initialize,
    Reset,
    IpcExport(Index),
    IpcOpen(Index),
    IpcClose(Index),
    DropExport(Index),
    /// A set of a device pointer's bytes to its own fill, queued on a stream: the work holds
    /// the memory until it is settled.
    AsyncSet(Index),
    /// Waits for every queued set.
    Settle,
}

impl Model {
    /// The allocations whose memory the driver still holds: not released, or released with
    /// their free still queued. Each with its kind.
    pub fn held(&self) -> Vec<(usize, Kind)> {
        self.allocs
            .iter()
            .enumerate()
            .filter(|(i, a)| {
                !a.released
                    || self.pending.iter().any(|p| match p {
                        Pending::Device { alloc, .. }
                        | Pending::Host { alloc, .. }
                        | Pending::Managed { alloc, .. } => alloc == i,
                    })
            })
            .map(|(i, a)| (i, a.kind))
            .collect()
    }

    fn flush(&mut self) {
        if self.defer > 0 {
            return;
        }
        for p in self.pending.drain(..) {
            match p {
                Pending::Device { .. } => self.device_live -= 1,
                Pending::Host { .. } => self.host_live -= 1,
                Pending::Managed { .. } => self.managed_live -= 1,
            }
        }
        self.pending_bytes = 0;
    }

    fn queue(&mut self, p: Pending) {
        self.pending_bytes += match p {
            Pending::Device { bytes, .. }
            | Pending::Host { bytes, .. }
            | Pending::Managed { bytes, .. } => bytes,
        };
        self.pending.push(p);
    }

    fn push(&mut self, p: Pending) {
        self.queue(p);
        if self.pending.len() > MAX_PENDING_COUNT || self.pending_bytes > MAX_PENDING_BYTES {
            self.flush();
        }
    }

    /// The last handle of `id` went away.
    fn release(&mut self, id: usize) {
        let a = &mut self.allocs[id];
        if a.released {
            return;
        }
        a.released = true;
        let (kind, bytes) = (a.kind, a.bytes);
        match kind {
            Kind::Device => self.push(Pending::Device { alloc: id, bytes }),
            Kind::Managed => self.push(Pending::Managed { alloc: id, bytes }),
            Kind::Mapped => self.push(Pending::Host { alloc: id, bytes }),
            // Numba counts unmapped pinned memory as 0 bytes.
            Kind::Pinned => self.push(Pending::Host {
                alloc: id,
                bytes: 0,
            }),
            // Unpins happen at once.
            Kind::MappedPin | Kind::Pin => self.pins_live -= 1,
        }
    }

    fn unref(&mut self, id: usize) {
        self.allocs[id].refs -= 1;
        if self.allocs[id].refs == 0 {
            self.release(id);
        }
    }

    /// Allocations the other process has mapped: repeated opens of one allocation share a
    /// mapping (the driver reference-counts them).
    pub fn mapped_allocations(&self) -> usize {
        let open: std::collections::BTreeSet<usize> = self
            .exports
            .iter()
            .filter(|e| e.open)
            .map(|e| e.alloc)
            .collect();
        open.len()
    }
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        4 => Just(Kind::Device),
        1 => Just(Kind::Mapped),
        1 => Just(Kind::Pinned),
        1 => Just(Kind::MappedPin),
        1 => Just(Kind::Pin),
        1 => Just(Kind::Managed),
    ]
}

/// Mostly small, sometimes large: the count threshold and the byte threshold both fire.
#[cfg(not(miri))]
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 1usize..=65536, 1 => (1usize << 20)..=(3 << 20)]
}

/// Under Miri, small only: every byte of the simulator's memory is interpreted, and megabytes
/// take minutes (the byte threshold is then reached by the other runs, not these).
#[cfg(miri)]
fn size() -> impl Strategy<Value = usize> {
    1usize..=4096
}

impl ReferenceStateMachine for Model {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_state: &Model) -> BoxedStrategy<Transition> {
        let index = any::<Index>;
        prop_oneof![
            6 => (kind(), size()).prop_map(|(k, b)| Transition::Alloc(k, b)),
            2 => index().prop_map(Transition::Clone),
            2 => index().prop_map(Transition::View),
            7 => index().prop_map(Transition::Drop),
            1 => Just(Transition::EnterDefer),
            1 => Just(Transition::LeaveDefer),
            1 => Just(Transition::Flush),
            1 => Just(Transition::Initialize),
            1 => Just(Transition::Reset),
            1 => index().prop_map(Transition::IpcExport),
            1 => index().prop_map(Transition::IpcOpen),
            1 => index().prop_map(Transition::IpcClose),
            1 => index().prop_map(Transition::DropExport),
            2 => index().prop_map(Transition::AsyncSet),
            1 => Just(Transition::Settle),
        ]
        .boxed()
    }

    fn preconditions(state: &Model, t: &Transition) -> bool {
        let handle = |i: &Index| {
            (!state.handles.is_empty())
                .then(|| &state.allocs[state.handles[i.index(state.handles.len())]])
        };
        let export = |i: &Index| {
            (!state.exports.is_empty()).then(|| &state.exports[i.index(state.exports.len())])
        };
        match t {
            Transition::Clone(i) => handle(i).is_some_and(|a| a.kind.shareable()),
            Transition::View(i) => handle(i).is_some_and(|a| a.kind.viewable()),
            Transition::Drop(i) => handle(i).is_some(),
            Transition::LeaveDefer => state.defer > 0,
            Transition::IpcExport(i) => {
                handle(i).is_some_and(|a| a.kind == Kind::Device && !a.released)
            }
            Transition::IpcOpen(i) => {
                export(i).is_some_and(|e| !e.open && !state.allocs[e.alloc].released)
            }
            Transition::IpcClose(i) => export(i).is_some_and(|e| e.open),
            Transition::DropExport(i) => export(i).is_some(),
            Transition::AsyncSet(i) => handle(i).is_some_and(|a| a.kind.viewable() && !a.released),
            // A reset frees what queued work still writes: the work is settled first.
            Transition::Reset => state.in_flight.is_empty(),
            _ => true,
        }
    }

    fn apply(mut s: Model, t: &Transition) -> Model {
        match t {
            Transition::Alloc(kind, bytes) => {
                s.allocs.push(Alloc {
                    kind: *kind,
                    bytes: *bytes,
                    refs: 1,
                    released: false,
                });
                s.handles.push(s.allocs.len() - 1);
                match kind {
                    Kind::Device => s.device_live += 1,
                    Kind::Managed => s.managed_live += 1,
                    Kind::Mapped | Kind::Pinned => s.host_live += 1,
                    Kind::MappedPin | Kind::Pin => s.pins_live += 1,
                }
            }
            Transition::Clone(i) | Transition::View(i) => {
                let id = s.handles[i.index(s.handles.len())];
                s.allocs[id].refs += 1;
                s.handles.push(id);
            }
            Transition::Drop(i) => {
                let id = s.handles.swap_remove(i.index(s.handles.len()));
                s.unref(id);
            }
            Transition::EnterDefer => s.defer += 1,
            Transition::LeaveDefer => s.defer -= 1,
            Transition::Flush => s.flush(),
            Transition::Initialize => {}
            Transition::Reset => {
                for id in 0..s.allocs.len() {
                    let a = &s.allocs[id];
                    if a.kind.tracked() && !a.released {
                        let (kind, bytes) = (a.kind, a.bytes);
                        s.allocs[id].released = true;
                        match kind {
                            Kind::Device => s.queue(Pending::Device { alloc: id, bytes }),
                            Kind::Managed => s.queue(Pending::Managed { alloc: id, bytes }),
                            Kind::Mapped => s.queue(Pending::Host { alloc: id, bytes }),
                            _ => s.pins_live -= 1,
                        }
                    }
                }
                s.flush();
            }
            Transition::IpcExport(i) => {
                let id = s.handles[i.index(s.handles.len())];
                s.allocs[id].refs += 1;
                s.exports.push(Export {
                    alloc: id,
                    open: false,
                });
            }
            Transition::IpcOpen(i) => {
                let n = s.exports.len();
                s.exports[i.index(n)].open = true;
            }
            Transition::IpcClose(i) => {
                let n = s.exports.len();
                s.exports[i.index(n)].open = false;
            }
            Transition::AsyncSet(i) => {
                let id = s.handles[i.index(s.handles.len())];
                s.allocs[id].refs += 1;
                s.in_flight.push(id);
            }
            Transition::Settle => {
                for id in std::mem::take(&mut s.in_flight) {
                    s.unref(id);
                }
            }
            Transition::DropExport(i) => {
                let e = s.exports.swap_remove(i.index(s.exports.len()));
                s.unref(e.alloc);
            }
        }
        s
    }
}
