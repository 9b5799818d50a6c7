import os
import sys
from pathlib import Path

import pytest

# Built-in datasets are built once per test session into a private cache; the arms'
# processes inherit the variable, so no test touches the user's ~/.cache.
_CACHE = Path(
    os.environ.get(
        "WORKBENCH_TEST_CACHE", Path(__file__).resolve().parent.parent / ".pytest_cache" / "workbench"
    )
)
os.environ.setdefault("WORKBENCH_CACHE", str(_CACHE))

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device; this machine has none")


@pytest.fixture(autouse=True)
def _reset_compiler_state():
    """In-process tests share one interpreter: drop compiled graphs between tests."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


# Tiers: pytest -m fast | slow | notebooks | browser | thirdparty | slurm | gpu (README, "Test tiers").
# Apart from the tiers, `timing` marks the tests that check the wall clock or the machine's load
# against a known answer: other work on the machine skews them (they allow for a busy machine).
# Whole modules that run real ablations in fresh processes are slow; a test elsewhere that
# takes more than a few seconds carries @pytest.mark.slow itself.
SLOW_MODULES = {
    "test_ablate.py",
    "test_blocks.py",
    "test_ddp.py",
    "test_readme.py",
    "test_user_code_from_a_notebook.py",
}


class NotebooksAtSmokeBudget:
    """The notebooks tier (nbval) runs every cell at a smoke test's budget.

    WORKBENCH_SMOKE=1 (workbench.config) cuts every ablation to a few steps and a search to half
    a minute: the tier checks that each teaching notebook runs from top to bottom and that its
    checked cells still print what they should, not its figures, which the committed outputs show
    at the notebook's own budget. The kernel takes the variable from this process when nbval
    starts it, at the notebook's first cell; the tests that follow measure at their own budgets.
    Set WORKBENCH_SMOKE=0 to run the notebooks' own budgets. A command printed to rerun a run
    shows the steps that ran, so notebooks/smoke_sanitize.cfg masks its step counts before nbval
    compares it with the committed output.

    A plugin registered here, not a notebooks/conftest.py: a second module named conftest would
    shadow this one for ``from conftest import ...`` in the tests.
    """

    set_by_us = "WORKBENCH_SMOKE" not in os.environ

    def pytest_configure(self, config):
        if getattr(config.option, "nbval_sanitize_with", "unset") is None:
            sanitizer = Path(__file__).resolve().parent.parent / "notebooks" / "smoke_sanitize.cfg"
            config.option.nbval_sanitize_with = str(sanitizer)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        if self.set_by_us:
            if Path(str(item.fspath)).suffix == ".ipynb":
                os.environ["WORKBENCH_SMOKE"] = "1"
            else:
                os.environ.pop("WORKBENCH_SMOKE", None)


def pytest_configure(config):
    config.pluginmanager.register(NotebooksAtSmokeBudget(), "workbench-notebooks-at-smoke-budget")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebooks)
        elif path.name == "test_browser.py":
            item.add_marker(pytest.mark.browser)
        elif path.name == "test_thirdparty.py":
            item.add_marker(pytest.mark.thirdparty)
        elif path.name == "test_slurm.py":
            item.add_marker(pytest.mark.slurm)
        elif path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        tiers = ("slow", "notebooks", "browser", "thirdparty", "slurm")
        if not any(item.get_closest_marker(tier) for tier in tiers):
            item.add_marker(pytest.mark.fast)
