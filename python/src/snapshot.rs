//! `emm.Snapshot` (what `Context.snapshot()` returns) and `emm.tag`, the allocation tags the
//! `history` adaptor records.

use std::sync::{Arc, OnceLock};

use emm::{MemorySnapshot, Tag};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use emm::contract::BlockState;

/// The tag PyTorch's allocations through `emm.torch` get.
pub(crate) fn torch_tag() -> Tag {
    static TAG: OnceLock<Tag> = OnceLock::new();
    *TAG.get_or_init(|| Tag::named("torch"))
}

/// The tag CuPy's allocations through `emm.cupy` get.
pub(crate) fn cupy_tag() -> Tag {
    static TAG: OnceLock<Tag> = OnceLock::new();
    *TAG.get_or_init(|| Tag::named("cupy"))
}

/// Tags this thread's allocations with a framework's `tag` until the guard drops, unless a
/// tag is current already (a user's `with emm.tag(...)` block names what allocates better than
/// the framework does).
pub(crate) fn framework_scope(tag: Tag) -> Option<emm::contract::TagScope> {
    (Tag::current() == Tag::UNTAGGED).then(|| tag.scope())
}

/// The calling Python code's stack, innermost frame first, one line per frame in
/// `traceback`'s form (`File "train.py", line 12, in step`), at most 64 frames; `None` where
/// Python cannot give it.
pub(crate) fn python_stack(py: Python<'_>) -> Option<Arc<str>> {
    let mut frame = py
        .import("sys")
        .ok()?
        .call_method1("_getframe", (0,))
        .ok()?;
    let mut lines = Vec::new();
    for _ in 0..64 {
        let code = frame.getattr("f_code").ok()?;
        let file: String = code.getattr("co_filename").ok()?.extract().ok()?;
        let name: String = code.getattr("co_name").ok()?.extract().ok()?;
        let line: i64 = frame
            .getattr("f_lineno")
            .ok()
            .and_then(|l| l.extract().ok())
            .unwrap_or(0);
        lines.push(format!("File \"{file}\", line {line}, in {name}"));
        let back = frame.getattr("f_back").ok()?;
        if back.is_none() {
            break;
        }
        frame = back;
    }
    Some(Arc::from(lines.join("\n")))
}

/// Runs `f` (an allocation on `ctx`) with the calling Python code's stack passed to emm,
/// where `ctx` keeps each allocation's stack (`EMM_MEMORY_ADAPTORS=history-stacks`).
pub(crate) fn with_python_stack<T>(py: Python<'_>, ctx: &emm::Context, f: impl FnOnce() -> T) -> T {
    if ctx.records_stacks()
        && let Some(stack) = python_stack(py)
    {
        return emm::contract::with_host_stack(stack, f);
    }
    f()
}

/// A tag for the allocations made in a `with` block on this thread: `with emm.tag("loader"):
/// ...`. Snapshots, the out-of-memory report and `Snapshot.by_tag()` group live memory by tag
/// when the runtime has the `history` adaptor (`EMM_MEMORY_ADAPTORS=history`). `emm.torch`,
/// `emm.cupy` and `emm.numba` tag their allocations `torch`, `cupy` and `numba`, except inside
/// such a block, whose tag they keep (`Context.sleep` chooses by it). With `if_untagged=True`
/// the block tags only where no other block's tag is current.
#[pyclass(module = "emm", name = "tag", unsendable)]
#[derive(Debug)]
pub struct TagBlock {
    tag: Tag,
    if_untagged: bool,
    previous: Vec<Tag>,
}

#[pymethods]
impl TagBlock {
    #[new]
    #[pyo3(signature = (name, if_untagged=false))]
    fn new(name: &str, if_untagged: bool) -> PyResult<TagBlock> {
        let tag = Tag::try_named(name).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "emm.tag({name:?}): the process already has {} tag names, which it keeps for its \
                 life; name what allocates (a loader, a model), not each step or request",
                Tag::MAX_NAMES
            ))
        })?;
        Ok(TagBlock {
            tag,
            if_untagged,
            previous: Vec::new(),
        })
    }

    fn __enter__(mut slf: PyRefMut<'_, Self>) -> PyRefMut<'_, Self> {
        let current = Tag::current();
        let tag = if slf.if_untagged && current != Tag::UNTAGGED {
            current
        } else {
            slf.tag
        };
        let previous = Tag::set_current(tag);
        slf.previous.push(previous);
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&mut self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        if let Some(previous) = self.previous.pop() {
            Tag::set_current(previous);
        }
        false
    }

    /// The tag's name.
    #[getter]
    fn name(&self) -> String {
        self.tag.name().to_string()
    }

    fn __repr__(&self) -> String {
        format!("emm.tag({:?})", &*self.tag.name())
    }
}

/// Everything a context's manager held when `Context.snapshot()` was called, segment by
/// segment and block by block, with the `history` adaptor's allocations and events.
#[pyclass(module = "emm", frozen)]
#[derive(Debug)]
pub struct Snapshot {
    pub(crate) inner: MemorySnapshot,
}

#[pymethods]
impl Snapshot {
    /// The device.
    #[getter]
    fn device(&self) -> u32 {
        self.inner.device
    }

    /// The manager's registered name.
    #[getter]
    fn manager(&self) -> &str {
        &self.inner.manager
    }

    /// Whether the `history` adaptor recorded allocations (tags, streams, times, stacks).
    #[getter]
    fn history_on(&self) -> bool {
        self.inner.history_on
    }

    /// Bytes of every segment.
    #[getter]
    fn held_bytes(&self) -> usize {
        self.inner.held_bytes()
    }

    /// Bytes per block state: `in-use`, `cached`, `free`, `pending-free`.
    fn bytes_by_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for state in [
            BlockState::InUse,
            BlockState::Cached,
            BlockState::Free,
            BlockState::PendingFree,
        ] {
            d.set_item(state.name(), self.inner.bytes_in(state))?;
        }
        Ok(d)
    }

    /// Live bytes per tag, largest first: a list of dicts with `tag`, `bytes`,
    /// `allocations` and `largest`.
    fn by_tag<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for t in self.inner.by_tag() {
            let d = PyDict::new(py);
            d.set_item("tag", &t.tag)?;
            d.set_item("bytes", t.bytes)?;
            d.set_item("allocations", t.allocations)?;
            d.set_item("largest", t.largest)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// The segments: a list of dicts with `address`, `bytes`, `kind`, `stream` and `blocks`,
    /// each block a dict with `address`, `bytes`, `state`, and for a recorded allocation
    /// `requested`, `tag`, `stream`, `time_us` and `stack`.
    fn segments<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for s in &self.inner.segments {
            let d = PyDict::new(py);
            d.set_item("address", s.address)?;
            d.set_item("bytes", s.bytes)?;
            d.set_item("kind", s.kind.name())?;
            d.set_item("stream", s.stream)?;
            let blocks = PyList::empty(py);
            for b in &s.blocks {
                let bd = PyDict::new(py);
                bd.set_item("address", b.address)?;
                bd.set_item("bytes", b.bytes)?;
                bd.set_item("state", b.state.name())?;
                if let Some(a) = &b.allocation {
                    bd.set_item("requested", a.requested)?;
                    bd.set_item("tag", &*a.tag.name())?;
                    bd.set_item("stream", a.stream)?;
                    bd.set_item("time_us", a.time_us)?;
                    bd.set_item("stack", a.stack.as_deref())?;
                }
                blocks.append(bd)?;
            }
            d.set_item("blocks", blocks)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// The snapshot in PyTorch's format (`torch.cuda.memory._snapshot()`): a dict with
    /// `segments` and `device_traces`, which `torch.cuda._memory_viz` reads.
    fn to_torch<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let json = py.detach(|| self.inner.to_torch_json());
        py.import("json")?.call_method1("loads", (json,))
    }

    /// Writes the PyTorch-format snapshot to `path` as a pickle, the file PyTorch's
    /// memory_viz page (https://pytorch.org/memory_viz) and `python -m
    /// torch.cuda._memory_viz` open.
    fn dump_torch(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<()> {
        let data = self.to_torch(py)?;
        let file = py.import("builtins")?.call_method1("open", (path, "wb"))?;
        let result = py
            .import("pickle")?
            .call_method1("dump", (data, file.clone()));
        file.call_method0("close")?;
        result.map(|_| ())
    }

    /// A self-contained HTML page that draws every segment and its blocks (no server).
    fn to_html(&self, py: Python<'_>) -> String {
        py.detach(|| self.inner.to_html())
    }

    /// Writes [`to_html`](Self::to_html)'s page to `path`.
    fn save_html(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        let html = py.detach(|| self.inner.to_html());
        std::fs::write(&path, html).map_err(|e| {
            pyo3::exceptions::PyOSError::new_err(format!(
                "writing the snapshot's page to {}: {e}",
                path.display()
            ))
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "<emm.Snapshot device={} manager={:?}: {} segments, {} bytes held, {} in use, \
             history {}>",
            self.inner.device,
            self.inner.manager,
            self.inner.segments.len(),
            self.inner.held_bytes(),
            self.inner.bytes_in(BlockState::InUse),
            if self.inner.history_on { "on" } else { "off" }
        )
    }
}
