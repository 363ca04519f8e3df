//! The `history` adaptor: every live device allocation (address, size, stream, tag, time, and
//! the allocating stack when asked for) and a bounded ring of the last allocation events, for
//! snapshots ([`Context::snapshot`](crate::Context::snapshot)) and out-of-memory reports.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::adaptors::{Event, Observer};
use crate::clock::unix_now_us;
use crate::contract::info::MemoryKind;
use crate::contract::manager::HistoryRecord;
use crate::contract::snapshot::{AllocationInfo, HistoryAction, HistoryEvent, Tag, host_stack};
use crate::sync::{Mutex, lock};

/// Events the ring keeps when `history` is given no number.
pub(super) const DEFAULT_HISTORY_EVENTS: usize = 100_000;

#[derive(Debug, Default)]
struct State {
    live: HashMap<u64, AllocationInfo, foldhash::fast::RandomState>,
    events: VecDeque<HistoryEvent>,
}

#[derive(Debug)]
pub(super) struct History {
    /// The most events the ring keeps (0: live allocations only).
    capacity: usize,
    /// Whether each allocation keeps its stack.
    stacks: bool,
    state: Mutex<State>,
}

impl History {
    pub(super) fn new(capacity: usize, stacks: bool) -> History {
        History {
            capacity,
            stacks,
            state: Mutex::new(State::default()),
        }
    }

    fn push(&self, state: &mut State, event: HistoryEvent) {
        if self.capacity == 0 {
            return;
        }
        if state.events.len() == self.capacity {
            state.events.pop_front();
        }
        state.events.push_back(event);
    }
}

impl Observer for History {
    fn allocated(&self, e: &Event) {
        if e.kind != MemoryKind::Device && e.kind != MemoryKind::Managed {
            return;
        }
        let stack: Option<Arc<str>> = self.stacks.then(|| {
            let rust = std::backtrace::Backtrace::force_capture().to_string();
            match host_stack() {
                Some(host) => Arc::from(format!("{host}\n{rust}")),
                None => Arc::from(rust),
            }
        });
        let info = AllocationInfo {
            requested: e.bytes,
            stream: e.stream.map(|s| s.raw()),
            tag: Tag::current(),
            time_us: unix_now_us(),
            stack,
        };
        let event = HistoryEvent {
            action: if e.addr.is_some() {
                HistoryAction::Alloc
            } else {
                HistoryAction::OutOfMemory
            },
            address: e.addr.unwrap_or(0),
            bytes: e.bytes,
            stream: info.stream,
            tag: info.tag,
            time_us: info.time_us,
            stack: info.stack.clone(),
        };
        let mut state = lock(&self.state);
        if let Some(addr) = e.addr {
            state.live.insert(addr, info);
        }
        self.push(&mut state, event);
    }

    fn freed(&self, e: &Event) {
        if e.kind != MemoryKind::Device && e.kind != MemoryKind::Managed {
            return;
        }
        let Some(addr) = e.addr else { return };
        let mut state = lock(&self.state);
        let Some(info) = state.live.remove(&addr) else {
            return;
        };
        let event = HistoryEvent {
            action: HistoryAction::Free,
            address: addr,
            bytes: info.requested,
            stream: info.stream,
            tag: info.tag,
            time_us: unix_now_us(),
            stack: None,
        };
        self.push(&mut state, event);
    }

    fn history(&self) -> Option<HistoryRecord> {
        let state = lock(&self.state);
        Some(HistoryRecord {
            live: state
                .live
                .iter()
                .map(|(&addr, info)| (addr, info.clone()))
                .collect(),
            events: state.events.iter().cloned().collect(),
            complete: true,
        })
    }

    fn stacks(&self) -> bool {
        self.stacks
    }

    fn reset(&self) {
        // The reset freed every allocation; their pointers release nothing when they drop.
        lock(&self.state).live.clear();
    }
}
