"""The warm template (workbench.template): workers forked from it are fresh processes that
measure what spawned ones measure, it ends with its run, and without it the run still goes on."""

import os

import psutil
import pytest
from helpers import is_workbench_process

import workbench as wb
import workbench.template

pytestmark = pytest.mark.slow  # real ablations in fresh processes


def _env_reader():
    """A model factory that fails unless the worker sees the environment of the run's process."""
    import torch

    if os.environ.get("WORKBENCH_TEST_TEMPLATE_ENV") != "set-by-the-test":
        raise RuntimeError("the worker did not get the parent's current environment")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


def _batches():
    import torch

    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator))] * 4


def _ablate(**settings) -> wb.Results:
    return wb.ablate(
        model=_env_reader, data=_batches(), techniques={"amp": True}, steps=6, warmup=1, blocks=2, rounds=2,
        out=False, progress=False, **settings,
    )  # fmt: skip


def test_forked_workers_train_exactly_as_spawned_ones(monkeypatch):
    monkeypatch.setenv("WORKBENCH_TEST_TEMPLATE_ENV", "set-by-the-test")
    forked, spawned = _ablate(), _ablate(start="spawn")
    assert forked.record["worker_start"].startswith("forked from a warm template")
    assert spawned.record["worker_start"] == "plain spawn, as asked (start='spawn')"
    for res in (forked, spawned):
        assert set(res.table.status) == {"ok"}, res.table[["arm", "reason"]]
    # Same seeds, same arms, same windows: the losses match to the bit, whichever way the process
    # started. (The re-warm steps follow the step time; this model's step is far below their limit.)
    losses = {
        start: {(u["arm"], u["block"]): u["result"]["losses"] for u in res.record["units"]}
        for start, res in (("forked", forked), ("spawned", spawned))
    }
    assert losses["forked"] == losses["spawned"]
    # Each block is a process of its own, not the template and not this one.
    pids = {b["pid"] for b in forked.record["blocks"]}
    assert len(pids) == 2 and os.getpid() not in pids
    # The template ended with its run: nothing of workbench's is left under this process.
    assert not [p for p in psutil.Process().children(recursive=True) if is_workbench_process(p.cmdline())]


def test_a_template_that_cannot_start_falls_back_to_spawn_and_says_so(monkeypatch):
    monkeypatch.setenv("WORKBENCH_TEST_TEMPLATE_ENV", "set-by-the-test")

    def broken(log_path):
        raise RuntimeError("no fork today")

    monkeypatch.setattr(workbench.template, "WarmTemplate", broken)
    res = _ablate()
    assert set(res.table.status) == {"ok"}
    assert res.record["worker_start"] == "plain spawn: the warm template did not start (no fork today)"


def test_a_forked_worker_that_dies_is_reported_like_a_spawned_one(tmp_path):
    """Its exit code travels back through the template: a kill is still named a kill."""
    from workbench.template import start_template

    template, how = start_template(tmp_path / "template.log")
    assert template is not None, how
    try:
        worker = template.spawn(dict(os.environ), tmp_path / "worker.log")
        worker.stdin.close()  # no BlockSpec: the worker cannot read its header, and fails
        assert worker.wait(timeout=60) == 1
        assert '"type": "error"' in worker.stdout.read().decode()
        worker = template.spawn(dict(os.environ), tmp_path / "killed.log")
        assert psutil.Process(worker.pid).ppid() == template.process.pid
        # A session of its own before spawn() returns, as a spawned worker has: ending its process
        # group (a Stop, a timeout) reaches it and its DataLoader workers from the first moment.
        assert os.getsid(worker.pid) == worker.pid
        os.kill(worker.pid, 9)
        assert worker.wait(timeout=60) == -9
    finally:
        template.close()
    assert template.process.poll() is not None
