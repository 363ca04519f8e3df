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
