"""Numba's EMM plugin over emm.

Select it with ``NUMBA_CUDA_MEMORY_MANAGER=emm.numba`` (Numba imports this module and uses its
``_numba_memory_manager``), or in code, before Numba creates a context::

    from numba import cuda
    import emm.numba
    cuda.set_memory_manager(emm.numba.EmmNumbaManager)

Every member of Numba's ``BaseCUDAMemoryManager`` is implemented over the process's emm
runtime, on the context of Numba's device: device, pinned, mapped and managed memory, pins,
IPC handles, memory info, ``reset`` and ``defer_cleanup``. Numba's own deferred frees are not
used: emm's queue defers the frees (``defer_cleanup`` is emm's guard).

``get_ipc_handle`` returns Numba's ``IpcHandle`` built from the driver's handle of the
allocation's base and the offset into it, so a Numba process without emm opens it. Under
``async-pool-ipc`` the memory comes from a stream-ordered pool, which the driver exports only
with the pool itself: ``get_ipc_handle`` raises, naming the managers whose handles Numba opens.
"""

import contextlib
import weakref

from numba import cuda
from numba.cuda.cudadrv import driver as _drv

from . import context as _emm_context
from . import tag as _tag

# Numba's allocations carry this tag in snapshots and out-of-memory reports, unless a user's
# ``with emm.tag(...)`` block names them.
_NUMBA = _tag("numba", if_untagged=True)

try:
    from cuda.bindings import driver as _binding
except ImportError:  # pragma: no cover - numba-cuda always has it
    _binding = None


def _device_ptr(address):
    """The pointer type Numba's memory objects take."""
    return _binding.CUdeviceptr(address)


def _device_ordinal(device):
    """The ordinal of a Numba context's device: a Numba ``Device``, or (for a context Numba
    attached to an existing primary context) the driver's ``CUdevice``."""
    return device.id if hasattr(device, "id") else int(device)


def _ipc_mem_handle(data):
    handle = _binding.CUipcMemHandle()
    handle.reserved = data
    return handle


class EmmNumbaManager(cuda.BaseCUDAMemoryManager):
    """Numba's EMM plugin over the process's emm runtime."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Numba builds one instance with context=None to read interface_version: nothing is
        # touched until initialize().
        self._ctx = None
        # Device buffers handed to Numba, by address, for get_ipc_handle.
        self._buffers = {}
        # Numba's mapped and managed memory objects hand out owners that refer to them weakly
        # (``mem.own()``): they are kept here until their finalizer runs (Numba keeps them in
        # its ``allocations`` table the same way).
        self._owned = {}

    def _emm(self):
        if self._ctx is None:
            if self.context is None:
                raise RuntimeError(
                    "emm.numba: the memory manager has no Numba context; Numba creates one per "
                    "device (use numba.cuda.current_context())"
                )
            self._ctx = _emm_context(_device_ordinal(self.context.device))
        return self._ctx

    def initialize(self):
        # emm initializes its manager on every use of the context.
        self._emm()

    def memalloc(self, size):
        ctx = weakref.proxy(self.context)
        if size == 0:
            return _drv.MemoryPointer(ctx, _device_ptr(0), 0)
        with _NUMBA:
            buf = self._emm().memalloc(size)
        address = buf.ptr
        self._buffers[address] = buf
        buffers = self._buffers

        def release():
            buffers.pop(address, None)
            buf.release()

        return _drv.MemoryPointer(ctx, _device_ptr(address), size, finalizer=release)

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        buf = self._emm().memhostalloc(size, mapped=mapped, portable=portable, wc=wc)
        ctx = weakref.proxy(self.context)
        if mapped:
            mem = _drv.MappedMemory(
                ctx, buf.host_ptr, size, finalizer=self._releaser(buf.host_ptr, buf)
            )
            return self._keep(buf.host_ptr, mem).own()
        return _drv.PinnedMemory(ctx, buf.host_ptr, size, finalizer=buf.release)

    def mempin(self, owner, pointer, size, mapped=False):
        address = int(pointer.value) if hasattr(pointer, "value") else int(pointer)
        buf = self._emm().mempin(owner, address, size, mapped=mapped)
        ctx = weakref.proxy(self.context)
        if mapped:
            mem = _drv.MappedMemory(
                ctx, address, size, owner=owner, finalizer=self._releaser(address, buf)
            )
            return self._keep(address, mem).own()
        return _drv.PinnedMemory(ctx, address, size, owner=owner, finalizer=buf.release)

    def memallocmanaged(self, size, attach_global=True):
        with _NUMBA:
            buf = self._emm().memallocmanaged(size, attach_global=attach_global)
        ctx = weakref.proxy(self.context)
        mem = _drv.ManagedMemory(
            ctx, _device_ptr(buf.ptr), size, finalizer=self._releaser(buf.ptr, buf)
        )
        return self._keep(buf.ptr, mem).own()

    def _keep(self, address, mem):
        self._owned[address] = mem
        return mem

    def _releaser(self, address, buf):
        owned = self._owned

        def release():
            owned.pop(address, None)
            buf.release()

        return release

    def get_ipc_handle(self, memory):
        # The buffer the memory lies in: `memory` may be a view, or wrap a foreign object
        # (`__cuda_array_interface__`) over emm memory, so it is found by address.
        address = int(memory.device_pointer)
        buf = next(
            (b for b in self._buffers.values() if b.ptr <= address < b.ptr + b.size), None
        )
        if buf is None:
            raise RuntimeError(
                "emm.numba: get_ipc_handle of memory emm did not allocate; export memory from "
                "cuda.device_array or cuda.to_device while emm.numba is the memory manager"
            )
        ipc = self._emm().get_ipc_handle(buf, offset=address - buf.ptr, size=memory.size)
        if not ipc.is_driver_handle:
            raise RuntimeError(
                "emm.numba: the manager %r exports stream-ordered pool memory, which Numba's "
                "IpcHandle cannot open; use the 'default' or 'pool' manager for Numba IPC"
                % self._emm().manager
            )
        source_info = self.context.device.get_device_identity()
        return _drv.IpcHandle(
            memory, _ipc_mem_handle(ipc.handle), memory.size, source_info, offset=ipc.offset
        )

    def get_memory_info(self):
        free, total = self._emm().get_memory_info()
        return _drv.MemoryInfo(free=free, total=total)

    def reset(self):
        self._emm().reset()
        self._buffers.clear()
        self._owned.clear()

    @contextlib.contextmanager
    def defer_cleanup(self):
        with self._emm().defer_cleanup():
            yield

    @property
    def interface_version(self):
        return 1


_numba_memory_manager = EmmNumbaManager
