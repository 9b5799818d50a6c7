"""The notebooks tier (nbval) runs every cell at a smoke test's budget.

WORKBENCH_SMOKE=1 (workbench.config) cuts every ablation to a few steps and two blocks, and a
search to half a minute: the tier checks that each teaching notebook runs from top to bottom and
that its checked cells still print what they should, not its figures, which the committed outputs
show at the notebook's own budget. The kernel takes the variable from this process when nbval
starts it, at the notebook's first cell. Set WORKBENCH_SMOKE=0 to run the notebooks' own budgets.
A command printed to rerun a run shows the steps that ran, so smoke_sanitize.cfg masks its step
counts before nbval compares it with the committed output.
"""

import os
from pathlib import Path

import pytest

_SET_BY_US = "WORKBENCH_SMOKE" not in os.environ


def pytest_configure(config):
    if config.option.nbval_sanitize_with is None:
        config.option.nbval_sanitize_with = str(Path(__file__).with_name("smoke_sanitize.cfg"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _SET_BY_US:
        os.environ["WORKBENCH_SMOKE"] = "1"


def pytest_runtest_teardown(item, nextitem):
    if _SET_BY_US:  # the tests that run after the notebooks measure at their own budgets
        os.environ.pop("WORKBENCH_SMOKE", None)
