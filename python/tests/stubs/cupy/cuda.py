"""Stand-ins for ``cupy.cuda``'s allocator hooks (see the package docstring)."""

_allocator = None


class runtime:  # noqa: N801 - CuPy's module name
    @staticmethod
    def getDevice():  # noqa: N802 - CuPy's name
        return 0


class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


class Stream:
    """A stream by its handle: 0 is the legacy default stream, 2 the per-thread one."""

    def __init__(self, ptr):
        self.ptr = ptr


current_stream = Stream(0)


def get_current_stream():
    return current_stream


def set_allocator(allocator):
    global _allocator
    _allocator = allocator


def alloc(size):
    return _allocator(size)


# CuPy's C allocator interface: the current-stream function its ``cupy.cuda.stream`` module
# exports as a capsule named by its C signature, and ``memory.CFunctionAllocator``, which
# calls C ``malloc`` / ``free`` functions by address. As in CuPy's Cython code, a Python
# exception the malloc function sets is raised (ctypes' PYFUNCTYPE checks for one).
import ctypes as _ctypes
import types as _types

_current_stream_ptr = _ctypes.CFUNCTYPE(_ctypes.c_ssize_t)(lambda: current_stream.ptr)
_capsule_new = _ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = _ctypes.py_object
_capsule_new.argtypes = [_ctypes.c_void_p, _ctypes.c_char_p, _ctypes.c_void_p]
_capsule_name = _ctypes.create_string_buffer(b"intptr_t (void)")

stream = _types.SimpleNamespace(
    __pyx_capi__={
        "get_current_stream_ptr": _capsule_new(
            _ctypes.cast(_current_stream_ptr, _ctypes.c_void_p), _capsule_name, None
        )
    }
)

_MALLOC = _ctypes.PYFUNCTYPE(_ctypes.c_void_p, _ctypes.c_void_p, _ctypes.c_size_t, _ctypes.c_int)
_FREE = _ctypes.PYFUNCTYPE(None, _ctypes.c_void_p, _ctypes.c_void_p, _ctypes.c_int)


class _CFunctionMemory:
    def __init__(self, size, allocator, device_id):
        self.size, self.device_id, self._allocator, self.ptr = size, device_id, allocator, 0
        if size > 0:
            self.ptr = allocator._malloc(None, size, device_id) or 0

    def __del__(self):
        if self.ptr:
            self._allocator._free(None, self.ptr, self.device_id)


class _CFunctionAllocator:
    def __init__(self, param, malloc_func, free_func, owner):
        self._malloc, self._free = _MALLOC(malloc_func), _FREE(free_func)
        self._owner = owner

    def malloc(self, size):
        return MemoryPointer(_CFunctionMemory(size, self, runtime.getDevice()), 0)


memory = _types.SimpleNamespace(CFunctionAllocator=_CFunctionAllocator)
