"""The rule the statistical timing tests use: they can fail on a quiet machine, and only there."""

import pytest
from helpers import judged_on_a_quiet_machine


class FakeResults:
    def __init__(self, others_cores: float):
        self.load = {"others_cpu_cores_p90": others_cores, "cores": 2}


def test_two_misses_on_a_quiet_machine_fail():
    with pytest.raises(pytest.fail.Exception, match="two misses on a quiet machine"):
        judged_on_a_quiet_machine(lambda: FakeResults(0.0), lambda res: "missed")


def test_misses_on_a_busy_machine_skip_with_the_load_seen():
    with pytest.raises(pytest.skip.Exception, match=r"too busy.*1\.50 of 2 cores"):
        judged_on_a_quiet_machine(lambda: FakeResults(1.5), lambda res: "missed")


def test_a_pass_ends_the_retries():
    runs = iter([FakeResults(1.5), FakeResults(0.0)])
    verdicts = iter(["missed", ""])
    res = judged_on_a_quiet_machine(lambda: next(runs), lambda res: next(verdicts))
    assert res.load["others_cpu_cores_p90"] == 0.0
