//! Putting a context's memory to sleep: what [`Context::sleep`](crate::Context::sleep) is
//! asked ([`SleepOptions`]), what it hands the manager ([`SleepBlock`]), and what sleep and
//! wake report ([`SleepReport`], [`WakeReport`]).
//!
//! A sleeping context keeps every address it handed out while the physical memory behind
//! them goes back to the driver; each live allocation is kept mapped, offloaded (its
//! contents copied to page-locked host memory and back at the wake) or discarded (its
//! contents are not needed: after the wake it holds whatever the new memory holds).

use std::time::Duration;

use crate::contract::snapshot::Tag;

/// What happens to a live allocation while its context sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SleepChoice {
    /// Its memory stays mapped (and held): usable during the sleep, as before.
    Keep,
    /// Its contents go to page-locked host memory before its memory is released, and come
    /// back, bit for bit, at the wake.
    Offload,
    /// Its memory is released with no copy: after the wake its address is mapped again, to
    /// memory whose contents are undefined (activations, a KV cache to be refilled).
    Discard,
}

impl SleepChoice {
    /// The choice's name: `keep`, `offload` or `discard`.
    pub fn name(self) -> &'static str {
        match self {
            SleepChoice::Keep => "keep",
            SleepChoice::Offload => "offload",
            SleepChoice::Discard => "discard",
        }
    }
}

/// What [`Context::sleep`](crate::Context::sleep) does with each live allocation: a choice
/// per [`Tag`], and one for the rest. The default offloads everything, so that nothing is
/// lost unless asked.
///
/// ```
/// use emm::contract::{SleepChoice, SleepOptions, Tag};
/// let options = SleepOptions::new(SleepChoice::Discard)
///     .with_tag(Tag::named("weights"), SleepChoice::Offload);
/// assert_eq!(options.choice_for(Some(Tag::named("weights"))), SleepChoice::Offload);
/// assert_eq!(options.choice_for(None), SleepChoice::Discard);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SleepOptions {
    default: SleepChoice,
    by_tag: Vec<(Tag, SleepChoice)>,
    keep_host_buffer: bool,
}

impl Default for SleepOptions {
    fn default() -> SleepOptions {
        SleepOptions::new(SleepChoice::Offload)
    }
}

impl SleepOptions {
    /// `default` for every allocation, until [`with_tag`](Self::with_tag) names others.
    pub fn new(default: SleepChoice) -> SleepOptions {
        SleepOptions {
            default,
            by_tag: Vec::new(),
            keep_host_buffer: false,
        }
    }

    /// `choice` for the allocations made under `tag` (a later choice for the same tag
    /// replaces an earlier one).
    pub fn with_tag(mut self, tag: Tag, choice: SleepChoice) -> SleepOptions {
        self.by_tag.retain(|&(t, _)| t != tag);
        self.by_tag.push((tag, choice));
        self
    }

    /// The choice for an allocation of `tag` (`None`: its tag is not known).
    pub fn choice_for(&self, tag: Option<Tag>) -> SleepChoice {
        tag.and_then(|tag| {
            self.by_tag
                .iter()
                .find(|&&(t, _)| t == tag)
                .map(|&(_, c)| c)
        })
        .unwrap_or(self.default)
    }

    /// Keeps the page-locked host buffer the offloaded allocations go to after the wake, for
    /// the next sleep to copy into again: a process that sleeps often pins host memory once
    /// (pinning costs far more than the copies). A later sleep that offloads more than the
    /// buffer holds replaces it; a sleep without this option uses it too and frees it at its
    /// wake (or at once, offloading nothing); [`Context::trim`](crate::Context::trim), a reset and the
    /// context's end free it. Off by default: the buffer is host memory the process holds
    /// while awake.
    pub fn with_host_buffer_kept(mut self, keep: bool) -> SleepOptions {
        self.keep_host_buffer = keep;
        self
    }

    /// Whether the host buffer stays after the wake ([`with_host_buffer_kept`](Self::with_host_buffer_kept)).
    pub fn keeps_host_buffer(&self) -> bool {
        self.keep_host_buffer
    }

    /// The choice for allocations no tag names.
    pub fn default_choice(&self) -> SleepChoice {
        self.default
    }

    /// Whether any choice depends on an allocation's tag (one that differs from the default):
    /// then every live allocation's tag must be known.
    pub fn depends_on_tags(&self) -> bool {
        self.by_tag.iter().any(|&(_, c)| c != self.default)
    }
}

/// One live allocation a sleep must handle, as the context hands it to the manager
/// ([`Sleeper::sleep`](crate::contract::Sleeper::sleep)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SleepBlock {
    /// Its device address.
    pub address: u64,
    /// Its size in bytes.
    pub bytes: usize,
    /// What to do with it.
    pub choice: SleepChoice,
}

/// What a sleep did ([`Context::sleep`](crate::Context::sleep)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Bytes of device memory the manager held (mapped) before the sleep.
    pub held_before: usize,
    /// Bytes of device memory it still holds while asleep: the memory of the allocations
    /// kept, and whatever else lies in the same pieces of physical memory.
    pub held_asleep: usize,
    /// Bytes of live allocations kept mapped.
    pub kept_bytes: usize,
    /// Bytes of live allocations copied to host memory.
    pub offloaded_bytes: usize,
    /// Bytes of live allocations released with no copy.
    pub discarded_bytes: usize,
    /// How long the sleep took, the wait for the device's work included (measured by
    /// [`Context::sleep`](crate::Context::sleep); a manager leaves it zero).
    pub elapsed: Duration,
    /// How long the copies of the offloaded allocations took (the host buffer's allocation
    /// left out).
    pub offload_elapsed: Duration,
    /// The offloaded allocations went to a host buffer an earlier sleep kept
    /// ([`SleepOptions::with_host_buffer_kept`]), with no new allocation of host memory.
    pub host_buffer_reused: bool,
}

/// What a wake did ([`Context::wake`](crate::Context::wake)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WakeReport {
    /// Bytes of device memory mapped again.
    pub mapped_bytes: usize,
    /// Bytes copied back from host memory (the allocations offloaded).
    pub restored_bytes: usize,
    /// Bytes of device memory the manager holds after the wake.
    pub held_after: usize,
    /// How long the wake took (measured by [`Context::wake`](crate::Context::wake); a manager
    /// leaves it zero).
    pub elapsed: Duration,
    /// How long the copies back took.
    pub restore_elapsed: Duration,
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_tag_choice_overrides_the_default_and_a_later_one_replaces_it() {
        let (w, kv) = (
            Tag::named("sleep-test-weights"),
            Tag::named("sleep-test-kv"),
        );
        let options = SleepOptions::new(SleepChoice::Offload)
            .with_tag(kv, SleepChoice::Keep)
            .with_tag(kv, SleepChoice::Discard)
            .with_tag(w, SleepChoice::Offload);
        assert_eq!(options.choice_for(Some(kv)), SleepChoice::Discard);
        assert_eq!(options.choice_for(Some(w)), SleepChoice::Offload);
        assert_eq!(
            options.choice_for(Some(Tag::UNTAGGED)),
            SleepChoice::Offload
        );
        assert_eq!(options.choice_for(None), SleepChoice::Offload);
        assert!(options.depends_on_tags(), "kv differs from the default");
        let same = SleepOptions::new(SleepChoice::Offload).with_tag(w, SleepChoice::Offload);
        assert!(
            !same.depends_on_tags(),
            "no choice differs from the default"
        );
        assert_eq!(
            SleepOptions::default().default_choice(),
            SleepChoice::Offload
        );
    }
}
