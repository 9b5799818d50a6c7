"""The warm template (workbench.template): workers forked from it are fresh processes that
measure what spawned ones measure, it is kept warm for the next run a while and then ends, and
without it the run still goes on."""

import os
import tempfile
import threading
import time

import psutil
import pytest
from helpers import is_workbench_process, left_behind

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
    # started. A block adds an untimed re-warm step before each window when steps are short, and
    # on a loaded machine one block may cross that limit and the other not: each arm then trains
    # the same sequence of steps, one of them a few steps longer, so its shorter list is a prefix.
    losses = {
        start: {(u["arm"], u["block"]): u["result"]["losses"] for u in res.record["units"]}
        for start, res in (("forked", forked), ("spawned", spawned))
    }
    assert losses["forked"].keys() == losses["spawned"].keys()
    for unit, forked_losses in losses["forked"].items():
        common = min(len(forked_losses), len(losses["spawned"][unit]))
        assert common >= 1 + 6, unit  # the warm-up and every timed step, at least
        assert forked_losses[:common] == losses["spawned"][unit][:common], unit
    # Each block is a process of its own, not the template and not this one.
    pids = {b["pid"] for b in forked.record["blocks"]}
    assert len(pids) == 2 and os.getpid() not in pids
    # Nothing of workbench's is left under this process but the template kept for the next run,
    # and closing that leaves nothing at all.
    assert not left_behind()
    workbench.template.close_kept_template()
    assert not [p for p in psutil.Process().children(recursive=True) if is_workbench_process(p.cmdline())]


def test_a_template_that_cannot_start_falls_back_to_spawn_and_says_so(monkeypatch):
    monkeypatch.setenv("WORKBENCH_TEST_TEMPLATE_ENV", "set-by-the-test")

    def broken(log_path):
        raise RuntimeError("no fork today")

    workbench.template.close_kept_template()  # else the next run forks from the one kept warm
    monkeypatch.setattr(workbench.template, "WarmTemplate", broken)
    made = []
    monkeypatch.setattr(
        workbench.template, "_new_log_dir", lambda: made.append(tempfile.mkdtemp()) or made[-1]
    )
    res = _ablate()
    assert set(res.table.status) == {"ok"}
    assert res.record["worker_start"] == "plain spawn: the warm template did not start (no fork today)"
    assert made and not os.path.exists(made[0]), "its empty log folder was left: the reason is in the results"


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


def _one_block(**settings) -> wb.Results:
    return wb.ablate(model="mlp", techniques={}, steps=4, warmup=1, blocks=1, rounds=2, control=False,
                     out=False, progress=False, **settings)  # fmt: skip


def test_the_next_run_forks_from_the_template_kept_warm_even_after_its_thread_ended():
    """The panel runs each ablation in a thread that ends with it; the template must outlive that
    thread (it dies with the thread that started it), so the next run finds it warm."""
    workbench.template.close_kept_template()
    first: list[wb.Results] = []
    thread = threading.Thread(target=lambda: first.append(_one_block()))
    thread.start()
    thread.join(timeout=300)
    assert first and first[0].record["worker_start"].startswith("forked from a warm template (ready in")
    kept = workbench.template.kept_template()
    assert kept is not None and kept.alive()
    second = _one_block()
    assert second.record["worker_start"] == (
        "forked from a warm template kept from an earlier run in this Python process"
    )
    assert workbench.template.kept_template() is kept and set(second.table.status) == {"ok"}


def test_another_environment_gets_a_fresh_template_and_the_kept_one_ends_when_idle(monkeypatch):
    _one_block()
    before = workbench.template.kept_template()
    assert before is not None
    # Another environment could change what the template imported: a fresh one replaces it.
    monkeypatch.setenv("WORKBENCH_KEEP_WARM_S", "0.5")
    res = _one_block()
    assert res.record["worker_start"].startswith("forked from a warm template (ready in")
    assert not before.alive(), "the template of the earlier environment was not closed"
    kept = workbench.template.kept_template()
    assert kept is not None
    log_dir = kept.log_path.parent
    deadline = time.monotonic() + 30  # idle for WORKBENCH_KEEP_WARM_S: it closes by itself
    while time.monotonic() < deadline and kept.alive():
        time.sleep(0.1)
    assert not kept.alive() and workbench.template.kept_template() is None
    assert not log_dir.exists(), "the template's log folder (workbench's own) was left behind"
    # 0: none is kept at all.
    monkeypatch.setenv("WORKBENCH_KEEP_WARM_S", "0")
    _one_block()
    assert workbench.template.kept_template() is None and not left_behind()


def test_the_run_forks_from_the_template_the_command_started_unless_its_environment_changed(monkeypatch):
    """The command line starts the template before it imports torch (template.prewarm); the run
    takes that one, and closes it instead where the environment changed in between."""
    workbench.template.close_kept_template()
    workbench.template.prewarm()
    started = workbench.template._starting.started.result()
    res = _one_block()
    assert res.record["worker_start"].endswith(", started before the run was set up")
    assert workbench.template.kept_template() is started and started.alive()

    workbench.template.close_kept_template()
    assert not started.alive()
    workbench.template.prewarm()
    stale = workbench.template._starting.started.result()
    monkeypatch.setenv("WORKBENCH_TEST_TEMPLATE_ENV", "changed after the template started")
    res = _one_block()
    assert res.record["worker_start"].startswith("forked from a warm template (ready in")
    assert "started before" not in res.record["worker_start"]
    assert not stale.alive(), "a template started for another environment was used or left running"
    assert workbench.template.kept_template() not in (None, stale)

    # No run comes (the command's input was refused): closing ends it without waiting for its
    # imports, so that the command's error does not wait on them either.
    workbench.template.close_kept_template()
    workbench.template.prewarm()
    unused = workbench.template._starting.started.result()
    workbench.template.close_kept_template()
    assert unused.process.poll() is not None and workbench.template._starting is None


def test_the_command_line_starts_the_template_only_for_a_run_here(monkeypatch):
    from workbench.cli import main

    calls = []
    monkeypatch.setattr(workbench.template, "prewarm", lambda: calls.append(True))
    assert main(["ablate", "--dry-run", "--model", "mlp"]) == 0 and calls == []
    assert main(["ablate", "--executor", "slurm", "--steps", "0"]) == 2 and calls == []
    assert main(["ablate", "--steps", "0"]) == 2 and calls == [True]


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_keep_warm_setting_is_refused_before_anything_runs(monkeypatch, value):
    monkeypatch.setenv("WORKBENCH_KEEP_WARM_S", value)
    with pytest.raises(ValueError, match=r"WORKBENCH_KEEP_WARM_S must be a number of seconds >= 0 .*got '"):
        wb.plan(model="mlp")
    monkeypatch.setenv("WORKBENCH_KEEP_WARM_S", " 30 ")
    assert workbench.template.keep_warm_s() == 30.0


def test_the_fork_safety_check_leaves_cuda_untouched(monkeypatch):
    # Counting CUDA devices (is_available, device_count) in the template marks it so that no
    # forked worker can use CUDA: on an H200 every worker failed with "Cannot re-initialize CUDA
    # in forked subprocess" while the check called is_available().
    import torch

    def touched(*_args, **_kwargs):
        raise AssertionError("the template counted CUDA devices before forking")

    monkeypatch.setattr(torch.cuda, "is_available", touched)
    monkeypatch.setattr(torch.cuda, "device_count", touched)
    assert workbench.template._check_fork_safe() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA was initialized" in workbench.template._check_fork_safe()


@pytest.mark.parametrize("killed", ["process", "process group"])
def test_log_folders_that_killed_runs_left_are_swept_and_nothing_else(tmp_path, killed):
    """A run killed outright (SIGKILL: no atexit) cannot remove its template's log folder: the
    template, which ends with it, does; also where the whole process group is killed, as Jupyter
    ends a kernel shut down "now" (nbval did, leaving a folder per notebook). What a template
    killed outright itself leaves, a later run removes, and only such folders: workbench's name
    and log, untouched for an hour, and the template gone (the log's lock, which the template
    holds, is free)."""
    import signal
    import subprocess
    import sys
    import textwrap

    from workbench.template import LOG_DIR_PREFIX, LOG_NAME, _sweep_abandoned_log_dirs

    def log_dir(name: str, files=(LOG_NAME,), age_s=7200.0):
        folder = tmp_path / (LOG_DIR_PREFIX + name)
        folder.mkdir()
        for file in files:
            (folder / file).write_text("")
        for path in [*folder.iterdir(), folder]:
            os.utime(path, (time.time() - age_s, time.time() - age_s))
        return folder

    # A parent that starts a real template, then is killed while the template is still running.
    live_dir = tmp_path / (LOG_DIR_PREFIX + "live")
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from workbench.template import start_template
            template, how = start_template(Path({str(live_dir)!r}) / {LOG_NAME!r})
            print(template.process.pid if template else how, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,  # a group of its own, as a kernel has
    )  # fmt: skip
    template_pid = int(parent.stdout.readline())
    for path in [*live_dir.iterdir(), live_dir]:
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    abandoned, empty = log_dir("abandoned"), log_dir("empty", files=())
    recent, users = log_dir("recent", age_s=60), log_dir("users", files=(LOG_NAME, "notes.txt"))
    try:
        assert set(_sweep_abandoned_log_dirs(tmp_path)) == {abandoned, empty}
        assert live_dir.exists(), "the log folder of a running template was removed"
    finally:
        if killed == "process group":
            os.killpg(parent.pid, signal.SIGKILL)
        else:
            parent.kill()
        parent.wait()
    psutil.Process(template_pid).wait(timeout=30)  # it ends with the parent that started it
    assert not live_dir.exists(), "the template left its log folder, which its killed parent could not remove"
    assert _sweep_abandoned_log_dirs(tmp_path) == []
    assert recent.exists() and (users / "notes.txt").exists()


def _placement_reader():
    """A model factory that writes down the CPUs, niceness, file limit and torch threads it runs under."""
    import json
    import resource

    import torch

    seen = {
        "cpus": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "threads": torch.get_num_threads(),
    }
    with open(os.environ["WORKBENCH_TEST_PLACEMENT"], "w") as file:
        json.dump(seen, file)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs, to pin the run to one")
def test_a_forked_worker_runs_on_the_cpus_niceness_and_limits_of_the_runs_thread(tmp_path, monkeypatch):
    """Pinned to one core (taskset), niced and with a lower file limit, a run's forked workers ran on
    every core, with a thread per core, at priority 0 and the template's limits; spawned ones did not."""
    import json
    import resource

    seen = tmp_path / "seen.json"
    monkeypatch.setenv("WORKBENCH_TEST_PLACEMENT", str(seen))
    workbench.template.close_kept_template()
    _one_block()  # a template started, and kept, on every CPU
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ran: list[wb.Results] = []

    def pinned_run():  # CPUs and niceness are the calling thread's on Linux: this thread's alone
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 3)
        ran.append(wb.ablate(model=_placement_reader, data=_batches(), techniques={}, steps=4, warmup=1, blocks=1,
                             rounds=2, control=False, out=False, progress=False))  # fmt: skip

    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
    try:
        thread = threading.Thread(target=pinned_run)
        thread.start()
        thread.join(timeout=300)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert ran and ran[0].record["worker_start"].startswith("forked from a warm template kept")
    worker = json.loads(seen.read_text())
    assert worker["cpus"] == [min(os.sched_getaffinity(0))] and worker["threads"] == 1
    assert worker["nice"] == os.getpriority(os.PRIO_PROCESS, 0) + 3
    assert worker["nofile"] == [min(soft, 512), hard]


@pytest.mark.parametrize("when", ["start", "phase"])  # before its worker is forked, and while it runs
def test_a_template_that_dies_during_a_run_is_no_arms_doing_and_the_run_says_so(when):
    """Killed mid-run (the OOM killer, a user), it took its worker with it: the arm in flight was
    moved to a process of its own as if it had been killed, and the results still said "forked"."""
    workbench.template.close_kept_template()

    def kill_the_template(event):
        kept = workbench.template.kept_template()
        if event["type"] == when and kept is not None and kept.alive():
            os.kill(kept.process.pid, 9)
            kept.process.wait(timeout=60)

    results = wb.ablate(model="mlp", techniques={"amp": True}, steps=4, warmup=1, blocks=1, rounds=2,
                        control=False, out=False, progress=False, on_event=kill_the_template)  # fmt: skip
    assert set(results.table.status) == {"ok"}
    assert [arm["name"] for arm in results.record["arms"]] == ["baseline", "amp"]  # none moved
    assert results.record["worker_start"].endswith(
        "; the template ended during the run, and the processes after that were plain spawns"
    )


def test_ctrl_c_while_a_prewarmed_template_finishes_starting_leaves_neither_it_nor_its_folder():
    """Interrupted while the run took the template the command line had started, it left the
    template running until Python exited, and its log folder for good."""
    workbench.template.close_kept_template()
    workbench.template.prewarm()
    starting = workbench.template._starting
    assert starting is not None
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), 2))
    timer.start()
    acquired = []
    with pytest.raises(KeyboardInterrupt):
        acquired.append(workbench.template.acquire_template())
        time.sleep(5)  # where the template was ready within half a second: the interrupt lands here
    timer.join()
    if acquired:
        workbench.template.release_template(acquired[0][0])
        pytest.skip("the template was ready before the interrupt: nothing was interrupted")
    deadline = time.monotonic() + 120  # it is ended once its start finishes
    while time.monotonic() < deadline and os.path.exists(starting.log_dir):
        time.sleep(0.2)
    assert not os.path.exists(starting.log_dir)
    assert not [child for child in psutil.Process().children() if is_workbench_process(child.cmdline())]
