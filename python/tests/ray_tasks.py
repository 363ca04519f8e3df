"""What ``test_ray.py`` runs in Ray's workers: a module that imports only emm and the standard
library (the test pickles its functions by value, so the workers need not import it)."""

import os
import threading

import emm


def worker_state(nbytes):
    """Allocates ``nbytes`` through emm (freed on return) and says how the worker was set up."""
    import emm.ray

    buf = emm.context(0).memalloc(nbytes)
    return {
        "pid": os.getpid(),
        "settings": emm.settings(),
        "manager": emm.context(0).manager,
        "installed": list(emm.ray.installed),
        "live_bytes": emm.ray.figures()["live_bytes"],
        "buffer": buf.size,
        "metrics_thread": any(t.name == "emm-ray-metrics" for t in threading.enumerate()),
    }


class Holder:
    """An actor that keeps what it allocates through emm."""

    def __init__(self):
        self.buffers = []

    def hold(self, nbytes):
        """Allocates ``nbytes`` and keeps it; returns this worker's figures."""
        import emm.ray

        self.buffers.append(emm.context(0).memalloc(nbytes))
        return emm.ray.figures()


class TorchTrainer:
    """An actor that trains a small PyTorch model on the GPU, its tensors from emm."""

    def __init__(self, seed):
        import torch

        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
        ).cuda()
        self.optimiser = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def steps(self, n):
        """Runs ``n`` training steps; returns the last loss and this worker's figures."""
        import torch

        import emm.ray

        for _ in range(n):
            x = torch.randn(256, 1024, device="cuda")
            loss = (self.model(x) - x).pow(2).mean()
            self.optimiser.zero_grad()
            loss.backward()
            self.optimiser.step()
        torch.cuda.synchronize()
        return {
            "loss": float(loss),
            "installed": list(emm.ray.installed),
            **emm.ray.figures(),
        }
