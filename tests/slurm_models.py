"""A model for tests/test_slurm.py that runs slower in exactly one Slurm job: the first job to
build it claims a flag file (``WORKBENCH_TEST_SLOW_FLAG``), and every forward in that job's
processes sleeps. Imported by name in the jobs, so tests/ must be on their PYTHONPATH."""

import os
import time
from pathlib import Path

from torch import nn

DELAY_S = 0.01  # a step of the digits MLP takes about 2 ms here: the slowed block is several times slower


def _slow_here() -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:  # the submitting process checks the model too: it never claims the flag
        return False
    flag = Path(os.environ["WORKBENCH_TEST_SLOW_FLAG"])
    try:
        handle = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return flag.read_text() == job
    os.write(handle, job.encode())
    os.close(handle)
    return True


class Sleepy(nn.Module):
    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, inputs):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.net(inputs.flatten(1))


def slowed_in_one_job() -> nn.Module:
    return Sleepy(DELAY_S if _slow_here() else 0.0)


def dataset():
    """Digits-sized random data (64 features, 10 classes): a user's own model takes the user's own data."""
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(512, 64, generator=generator), torch.randint(0, 10, (512,), generator=generator)
    )
