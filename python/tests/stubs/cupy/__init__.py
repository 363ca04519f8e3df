"""A stand-in for the few parts of CuPy that emm.cupy uses, so that its allocator runs on the
simulator in CI (the real CuPy runs in the GPU tests). Not CuPy: only the names and the
ownership rule (``UnownedMemory`` holds its owner)."""

from . import cuda  # noqa: F401
