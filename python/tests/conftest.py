"""The package's tests run on emm's simulated GPU unless EMM_PYTHON_DRIVER=cuda says otherwise.

EMM_REQUIRE_GPU=1 (the GPU job) makes every test that needs the GPU or a framework fail
where it would skip.
"""

import os

import pytest

import emm

DRIVER = os.environ.get("EMM_PYTHON_DRIVER", "sim")
REQUIRE_GPU = os.environ.get("EMM_REQUIRE_GPU") == "1"

emm.configure(driver=DRIVER)


def needs_gpu(reason):
    """Skips (or, under EMM_REQUIRE_GPU=1, fails) a test that needs the GPU."""
    if DRIVER != "cuda":
        if REQUIRE_GPU:
            pytest.fail("EMM_REQUIRE_GPU=1 but the tests run on the simulator: set EMM_PYTHON_DRIVER=cuda")
        pytest.skip("needs a GPU (EMM_PYTHON_DRIVER=cuda): " + reason)


def needs_module(name):
    """The module, or a skip (a failure under EMM_REQUIRE_GPU=1) saying it is missing."""
    try:
        return __import__(name)
    except Exception as e:  # noqa: BLE001 - any import failure means the framework is unusable
        if REQUIRE_GPU:
            pytest.fail("EMM_REQUIRE_GPU=1 but %s does not import: %s" % (name, e))
        pytest.skip("%s is not installed here: %s" % (name, e))
