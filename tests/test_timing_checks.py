"""The rule the statistical timing tests use: they can fail on a quiet machine, and only there."""

import pandas as pd
import pytest
from helpers import judged_on_a_quiet_machine


class FakeResults:
    def __init__(self, others_cores: float, control: tuple[float, float, float] = (1.0, 0.98, 1.02)):
        self.load = {"others_cpu_cores_p90": others_cores, "cores": 2}
        speedup, low, high = control
        self.table = pd.DataFrame(
            {
                "arm": ["baseline", "baseline (control)"],
                "speedup": [1.0, speedup],
                "speedup_low": [1.0, low],
                "speedup_high": [1.0, high],
            }
        )


def test_two_misses_on_a_quiet_machine_fail():
    with pytest.raises(pytest.fail.Exception, match="two misses on a quiet machine"):
        judged_on_a_quiet_machine(lambda: FakeResults(0.0), lambda res: "missed")


def test_misses_on_a_busy_machine_skip_with_the_load_seen():
    with pytest.raises(pytest.skip.Exception, match=r"too busy.*1\.50 of 2 cores"):
        judged_on_a_quiet_machine(lambda: FakeResults(1.5), lambda res: "missed")


def test_misses_while_the_control_itself_is_noisy_skip():
    """No load visible, but the run's own A/A interval is +/-15% wide: it could not show anything."""
    with pytest.raises(pytest.skip.Exception, match=r"control's own interval \[1\.05, 1\.35\]"):
        judged_on_a_quiet_machine(lambda: FakeResults(0.0, control=(1.2, 1.05, 1.35)), lambda res: "missed")


def test_a_control_that_misses_one_with_a_tight_interval_still_fails():
    """A shifted but tight control is what contamination looks like: that must fail, not skip."""
    with pytest.raises(pytest.fail.Exception, match="two misses on a quiet machine"):
        judged_on_a_quiet_machine(lambda: FakeResults(0.0, control=(1.06, 1.03, 1.09)), lambda res: "missed")


def test_a_pass_ends_the_retries():
    runs = iter([FakeResults(1.5), FakeResults(0.0)])
    verdicts = iter(["missed", ""])
    res = judged_on_a_quiet_machine(lambda: next(runs), lambda res: next(verdicts))
    assert res.load["others_cpu_cores_p90"] == 0.0


def test_under_xdist_a_timing_test_waits_for_the_machine_alone_and_is_not_starved(tmp_path, monkeypatch):
    """Three workers' locks, in threads of this process (flock locks belong to each open file, so
    they exclude each other here as across processes): a timing test waits for a shared holder to
    finish, and a test that arrives while it waits goes after it, not before."""
    import threading
    import time

    import torch
    from conftest import TimingTestsHaveTheMachineToThemselves as Workers

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored after the test
    threads = torch.get_num_threads()
    try:
        first, timed, later = (Workers(workers=2, folder=tmp_path) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    order: list[str] = []

    def run(worker, name: str, alone: bool, hold_s: float) -> threading.Thread:
        def body():
            with worker.holding(alone=alone):
                order.append(f"{name} in")
                time.sleep(hold_s)
                order.append(f"{name} out")

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    try:
        running = [run(first, "shared", alone=False, hold_s=0.5)]
        while not order:
            time.sleep(0.01)
        running.append(run(timed, "timing", alone=True, hold_s=0.3))
        time.sleep(0.1)  # the timing test is now waiting in the turnstile
        running.append(run(later, "later", alone=False, hold_s=0.0))
        for thread in running:
            thread.join(timeout=10)
    finally:
        torch.set_num_threads(threads)
    assert order == ["shared in", "shared out", "timing in", "timing out", "later in", "later out"]


def test_a_timing_test_followed_by_another_keeps_the_machine_for_it(tmp_path, monkeypatch):
    """Let go between two timing tests, the machine goes to the other worker's next test, and the
    second timing test waits for all of it while its own worker idles."""
    import fcntl

    import torch
    from conftest import TimingTestsHaveTheMachineToThemselves as Workers

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored after the test
    threads = torch.get_num_threads()

    class Item:
        def __init__(self, timing: bool):
            self.timing = timing

        def get_closest_marker(self, name):
            return object() if name == "timing" and self.timing else None

    def run_test(worker, item, nextitem) -> None:  # as pytest runs a hook wrapper around a test
        protocol = worker.pytest_runtest_protocol(item, nextitem)
        next(protocol)
        with pytest.raises(StopIteration):
            next(protocol)

    def other_worker_can_start() -> bool:
        try:
            fcntl.flock(other.machine, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(other.machine, fcntl.LOCK_UN)
        return True

    try:
        worker, other = Workers(workers=2, folder=tmp_path), Workers(workers=2, folder=tmp_path)
        first, second, shared = Item(timing=True), Item(timing=True), Item(timing=False)
        run_test(worker, first, nextitem=second)
        assert not other_worker_can_start() and worker.alone
        run_test(worker, second, nextitem=shared)
        assert other_worker_can_start() and not worker.alone
        run_test(worker, shared, nextitem=first)  # a shared test never keeps the machine
        assert other_worker_can_start()
    finally:
        torch.set_num_threads(threads)
