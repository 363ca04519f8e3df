"""emm on a real Dask cluster on the GPU: dask-cuda's ``LocalCUDACluster`` (one worker process
per GPU), set up by ``emm.dask.EmmSetup``, with CuPy and PyTorch tasks whose arrays come from
emm, their figures at the scheduler, and spilling past a worker's maximum. ``test_dask.py``
runs the same set-up on the simulator; these run where ``EMM_PYTHON_DRIVER=cuda`` and fail
under ``EMM_REQUIRE_GPU=1`` when distributed or dask-cuda is missing (the GPU job carries
their wheels)."""

import json
import os

import pytest

import emm

from conftest import DRIVER, needs_gpu, needs_module

MIB = 1 << 20


@pytest.fixture
def gpu_cluster(monkeypatch):
    needs_gpu("runs a dask-cuda cluster on the GPU")
    distributed = needs_module("distributed")
    dask_cuda = needs_module("dask_cuda")
    import dask

    monkeypatch.setenv("EMM_PYTHON_DRIVER", DRIVER)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with dask_cuda.LocalCUDACluster(
            n_workers=1,
            threads_per_worker=1,
            dashboard_address=None,
            worker_dashboard_address=None,
        ) as c, distributed.Client(c) as client:
            yield distributed, client


def test_cupy_and_torch_tasks_allocate_through_emm_on_a_dask_cuda_worker(gpu_cluster):
    distributed, client = gpu_cluster
    import emm.dask
    from dask_tasks import cupy_filled, installed_frameworks, torch_filled, total
    from test_dask import emm_metrics, wait_for

    client.register_plugin(emm.dask.EmmSetup(manager="pool", frameworks=("torch", "cupy")))
    (worker,) = client.scheduler_info()["workers"]
    assert sorted(client.submit(installed_frameworks, pure=False).result()) == ["cupy", "torch"]
    a = client.submit(cupy_filled, 48 * MIB, 3, pure=False)
    t = client.submit(torch_filled, 16 * MIB, 5, pure=False)
    assert client.submit(total, a).result() == 3 * 48 * MIB
    assert client.submit(total, t).result() == 5 * 16 * MIB
    # Both results live on the worker, in emm's pool: its figures say so at the scheduler.
    seen = wait_for(
        lambda: (f := emm_metrics(client).get(worker)) and f["live_bytes"] >= 64 * MIB and f,
        "the worker's live bytes at the scheduler",
    )
    assert seen["manager"] == "stats(pool)", seen
    assert seen["held_bytes"] >= 64 * MIB and seen["ooms"] == 0, seen
    # Dask's GPU memory panel draws its "RMM" bar from each worker's "rmm" metric: emm's
    # memory. (Its other inputs, NVML's "gpu" metric and startup information, are distributed's
    # own, present only where distributed initialised NVML before the worker started.)
    panel = client.run_on_scheduler(
        lambda dask_scheduler: {
            key: ws.metrics.get("rmm") for key, ws in dask_scheduler.workers.items()
        }
    )
    rmm = panel[worker]
    assert rmm["rmm-used"] >= 64 * MIB, rmm
    assert rmm["rmm-total"] >= rmm["rmm-used"], rmm
    del a, t
    wait_for(
        lambda: (f := emm_metrics(client).get(worker)) and f["live_bytes"] < 64 * MIB,
        "the worker's live bytes after the results went",
    )


def test_results_past_a_workers_maximum_spill_on_the_gpu(gpu_cluster, tmp_path):
    """Twelve results of 64 MiB on a worker allowed 512 MiB of device memory: the out-of-memory
    callback has the worker spill its oldest results, and every result comes back whole."""
    distributed, client = gpu_cluster
    import emm.dask
    from dask_tasks import first_and_last, make
    from test_dask import worker_after_retries

    client.register_plugin(emm.dask.EmmSetup(manager="pool", maximum="512MiB", spill=True))
    futures = [client.submit(make, 64 * MIB, k + 1, pure=False) for k in range(12)]
    distributed.wait(futures)
    back = [client.submit(first_and_last, f, pure=False).result() for f in futures]
    assert back == [(k + 1, k + 1) for k in range(12)], back
    f = worker_after_retries(client)
    assert f["ooms"] == 0, json.dumps(f)
    assert f["peak_live_bytes"] <= 512 * MIB, json.dumps(f)


def test_cupy_results_past_a_workers_maximum_move_to_host_memory(gpu_cluster):
    """Under dask-cuda, CuPy results live in the device-host file's device LRU, whose own
    ``evict()`` frees no device memory: the out-of-memory callback evicts from the device LRU,
    so that twelve arrays of 64 MiB fit a worker allowed 512 MiB, and all come back whole."""
    distributed, client = gpu_cluster
    import emm.dask
    from dask_tasks import cupy_filled, total
    from test_dask import worker_after_retries

    client.register_plugin(
        emm.dask.EmmSetup(manager="pool", maximum="512MiB", spill=True, frameworks=("cupy",))
    )
    futures = [client.submit(cupy_filled, 64 * MIB, k + 1, pure=False) for k in range(12)]
    distributed.wait(futures)
    sums = [client.submit(total, f, pure=False).result() for f in futures]
    assert sums == [(k + 1) * 64 * MIB for k in range(12)], sums
    f = worker_after_retries(client)
    assert f["ooms"] == 0 and f["peak_live_bytes"] <= 512 * MIB, json.dumps(f)


def test_each_gpu_gets_a_worker_set_up_by_emm(monkeypatch):
    """With two GPUs or more, dask-cuda starts a worker per GPU: the plugin sets each up, each
    allocates on its own GPU through emm, and the scheduler hears every worker's figures. Runs
    where the machine has two GPUs; ``EMM_REQUIRE_GPUS=2`` (the two-GPU job) makes it fail
    rather than skip elsewhere."""
    needs_gpu("runs a dask-cuda cluster over every GPU")
    distributed = needs_module("distributed")
    dask_cuda = needs_module("dask_cuda")
    cupy = needs_module("cupy")
    import emm.dask
    from dask_tasks import cupy_filled, gpu_identity, total
    from test_dask import emm_metrics, wait_for

    gpus = cupy.cuda.runtime.getDeviceCount()
    if gpus < 2:
        if os.environ.get("EMM_REQUIRE_GPUS", "1") != "1":
            pytest.fail("EMM_REQUIRE_GPUS=%s but this machine has %d GPU" % (os.environ["EMM_REQUIRE_GPUS"], gpus))
        pytest.skip("needs two GPUs, this machine has %d (the two-GPU job runs it)" % gpus)
    monkeypatch.setenv("EMM_PYTHON_DRIVER", DRIVER)
    with dask_cuda.LocalCUDACluster(
        threads_per_worker=1, dashboard_address=None, worker_dashboard_address=None
    ) as c, distributed.Client(c) as client:
        client.register_plugin(emm.dask.EmmSetup(manager="pool", frameworks=("cupy",)))
        workers = sorted(client.scheduler_info()["workers"])
        assert len(workers) == gpus, workers
        where = {w: client.submit(gpu_identity, workers=[w], pure=False).result() for w in workers}
        assert len(set(where.values())) == gpus, where
        arrays = {
            w: client.submit(cupy_filled, 32 * MIB, k + 1, workers=[w], pure=False)
            for k, w in enumerate(workers)
        }
        for k, w in enumerate(workers):
            assert client.submit(total, arrays[w], workers=[w]).result() == (k + 1) * 32 * MIB
        seen = wait_for(
            lambda: (m := emm_metrics(client))
            and all(m.get(w) and m[w]["live_bytes"] >= 32 * MIB for w in workers)
            and m,
            "every worker's live bytes at the scheduler",
        )
        assert {seen[w]["manager"] for w in workers} == {"stats(pool)"}, seen
