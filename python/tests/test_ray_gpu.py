"""emm on a real local Ray cluster on the GPU: PyTorch in a Ray actor that holds the GPU, its
tensors allocated through emm (installed by the worker set-up hook), and the worker's figures.
``test_ray.py`` runs the hook on the simulator; this runs where ``EMM_PYTHON_DRIVER=cuda`` and
fails under ``EMM_REQUIRE_GPU=1`` when ray or PyTorch is missing (the GPU job carries ray's
wheels)."""

import pytest

from conftest import needs_gpu, needs_module

MIB = 1 << 20


def test_pytorch_in_a_ray_actor_allocates_through_emm():
    needs_gpu("runs a Ray actor on the GPU")
    ray = needs_module("ray")
    needs_module("torch")
    from ray import cloudpickle

    import ray_tasks

    cloudpickle.register_pickle_by_value(ray_tasks)
    ray.init(
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": "emm.ray.setup",
            "env_vars": {
                "EMM_PYTHON_DRIVER": "cuda",
                "EMM_MEMORY_MANAGER": "pool",
                "EMM_RAY_FRAMEWORKS": "torch",
                "EMM_RAY_METRICS_SECONDS": "1",
            },
        },
    )
    try:
        trainer = ray.remote(num_gpus=1)(ray_tasks.TorchTrainer).remote(0)
        first = ray.get(trainer.steps.remote(1))
        last = ray.get(trainer.steps.remote(20))
        assert first["installed"] == ["torch"], first
        assert first["manager"] == "stats(pool)", first
        # The model and its gradients (two copies of the weights at least) live on the GPU,
        # through emm.
        weights = 2 * (1024 * 4096 + 4096) * 4
        for seen in (first, last):
            assert seen["live_bytes"] >= 2 * weights, seen
            assert seen["held_bytes"] >= seen["live_bytes"], seen
            assert seen["ooms"] == 0, seen
        assert last["loss"] < first["loss"], (first["loss"], last["loss"])
        ray.kill(trainer)
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(ray_tasks)
