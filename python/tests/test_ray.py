"""emm on a real local Ray cluster, on emm's simulated GPU: the worker process set-up hook of one
``ray.init`` configures emm in every worker (tasks and an actor), with the limit it names, and
each worker sends its figures to Ray's metrics."""

import pytest

from conftest import DRIVER

ray = pytest.importorskip(
    "ray", reason="emm.ray's tests need ray (ci/test installs it into .venv-test)"
)
from ray import cloudpickle  # noqa: E402  (Ray's own, which pickles its tasks)

import ray_tasks  # noqa: E402

MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
    if DRIVER != "sim":
        pytest.skip("the workers run on emm's simulated GPU here; the GPU job runs its own")
    # The tasks travel by value: the workers need not import the tests' modules (which would
    # make an emm runtime of the test process's settings there).
    cloudpickle.register_pickle_by_value(ray_tasks)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": "emm.ray.setup",
            "env_vars": {
                "EMM_PYTHON_DRIVER": "sim",
                "EMM_SIM_DEVICE_MEMORY": str(1 << 30),
                "EMM_MEMORY_MANAGER": "pool",
                "EMM_RAY_MAXIMUM": "128MiB",
                "EMM_RAY_FRAMEWORKS": "torch,cupy",
                "EMM_RAY_METRICS_SECONDS": "1",
            },
        },
    )
    try:
        yield
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(ray_tasks)


def test_the_hook_sets_every_worker_up(cluster):
    state = ray.remote(ray_tasks.worker_state)
    seen = ray.get([state.remote(MIB) for _ in range(6)])
    assert len({s["pid"] for s in seen}) >= 1
    for s in seen:
        assert s["manager"] == "limit(stats(pool))", s
        assert s["settings"]["driver"] == "sim", s
        assert s["buffer"] == MIB and s["live_bytes"] == MIB, s
        # Neither framework is installed here: the hook installs emm only where it can.
        assert s["installed"] == [], s
        assert s["metrics_thread"], s


def test_an_actor_keeps_its_memory_within_the_limit(cluster):
    holder = ray.remote(ray_tasks.Holder).remote()
    figures = ray.get([holder.hold.remote(32 * MIB) for _ in range(3)])[-1]
    assert figures["manager"] == "limit(stats(pool))", figures
    assert figures["live_bytes"] == 96 * MIB, figures
    assert figures["held_bytes"] >= 96 * MIB, figures
    with pytest.raises(ray.exceptions.RayTaskError, match="limit"):
        ray.get(holder.hold.remote(64 * MIB))
    # The actor goes on, within its limit.
    assert ray.get(holder.hold.remote(16 * MIB))["live_bytes"] == 112 * MIB
    ray.kill(holder)
