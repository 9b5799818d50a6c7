import fcntl
import json
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager
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


@pytest.fixture(autouse=True)
def _compile_cache_shared_by_the_tests(request):
    """The ablations' worker processes use inductor's own compiled-code cache, as a smoke test's
    do, and as the tests that compile in this process and the notebooks' kernels do.

    A run gives each process a cold cache of its own, so that startup_s says what a new job pays
    (workbench.ablation, _Runner._compile_cache_dir). Most of a cold compile on the CPU is common
    to every graph (about 20 s of the 25 s it takes for a small mlp on 2 cores, against 8 s for
    another graph after it), and the tests check what torch.compile does, not what it costs to
    start: so they share one. A test of the cold cache itself is marked cold_compile.

    Patched by hand, not with monkeypatch: a test's own monkeypatch would then be set up before
    _reset_compiler_state and undone after it, whose dynamo reset would meet the test's patches
    (test_template's torch.cuda.is_available that raises).
    """
    if request.node.get_closest_marker("cold_compile"):
        yield
        return
    from workbench.ablation import _Runner

    original = _Runner.__dict__["_compile_cache_dir"]
    _Runner._compile_cache_dir = staticmethod(lambda *_: None)
    try:
        yield
    finally:
        _Runner._compile_cache_dir = original


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


# Notebooks whose cells check a wall-clock budget (a search must finish a round within its 30 s
# under WORKBENCH_SMOKE=1): like a test marked timing, they run alone under xdist.
TIMED_NOTEBOOKS = {"13_advise_and_tune.ipynb"}


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


class TimingTestsHaveTheMachineToThemselves:
    """Under pytest-xdist (``-n 3``, as .ci/run runs the suite on two cores): the workers share the
    cores, and a timing test waits until it has the machine alone.

    Most of the suite waits on fresh processes, compilers, Slurm, pip and a browser: a third
    worker fills the cores' idle time, and cut a CI run from 20.3 to 16.5 minutes (four workers,
    no further). But two torch processes that each start a thread per core oversubscribe
    the machine, and OpenMP's spinning threads then slow both far more than sharing would: each
    worker (and every process it starts, through OMP_NUM_THREADS) gets its share of the cores
    instead, at least one thread.

    A test marked ``timing`` checks the clock or the load against a known answer, and another
    worker's test on the next core would move that answer. So the workers share a readers-writer
    lock: two files in a folder that the xdist controller makes before it starts them and removes
    after they end (``LOCKS`` names it in their environment). Every test holds the lock shared; a
    timing test holds it alone, and runs with every core's threads, as it would without xdist. A
    turnstile in front of the lock lets a waiting timing test in before the next shared holder,
    so it is not starved.

    A timing test that is followed by another keeps the machine for it. Each time the lock is let
    go, the other worker starts its next test, and the next timing test waits for that test to end
    while this worker idles: per test, that wait was up to 45 s (a notebook's cells are tests each),
    and over a CI run it came to 210 s, a quarter of the run.
    """

    LOCKS = "WORKBENCH_TEST_LOCKS"  # the folder of the lock files, made by the xdist controller
    FILES = ("turnstile.lock", "machine.lock")  # the files in it

    def __init__(self, workers: int, folder: Path):
        self.cores = len(os.sched_getaffinity(0))
        self.share = max(1, self.cores // workers)
        # The turnstile is held only while a test queues; the machine while it runs.
        self.turnstile, self.machine = (open(folder / name, "a+") for name in self.FILES)
        self.own_setting = os.environ.get("OMP_NUM_THREADS")
        self.alone = False  # whether this worker holds the machine alone, kept from the last test
        self.threads(self.share)

    def threads(self, count: int | None) -> None:
        """``count`` threads here and in the processes a test starts; None: as without xdist."""
        import torch

        if count is not None:
            os.environ["OMP_NUM_THREADS"] = str(count)
        elif self.own_setting is None:
            os.environ.pop("OMP_NUM_THREADS", None)  # DDP ranks then split the cores themselves
        else:
            os.environ["OMP_NUM_THREADS"] = self.own_setting
        torch.set_num_threads(count or int(self.own_setting or self.cores))

    def take(self, alone: bool) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        if alone:
            self.threads(None)
        self.alone = alone

    def let_go(self) -> None:
        if self.alone:
            self.threads(self.share)
            self.alone = False
        fcntl.flock(self.machine, fcntl.LOCK_UN)

    @contextmanager
    def holding(self, alone: bool):
        self.take(alone)
        try:
            yield
        finally:
            self.let_go()

    @staticmethod
    def is_timing(item) -> bool:
        return item is not None and item.get_closest_marker("timing") is not None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        alone = self.is_timing(item)
        if not (alone and self.alone):  # else kept from the timing test before
            self.take(alone)
        try:
            yield
        finally:
            if not (alone and self.is_timing(nextitem)):
                self.let_go()


# Only the controller that made the folder removes it: a pytest that a test starts (the GPU suite's
# tests stage) inherits the variable, not the folder.
LOCK_FOLDER = pytest.StashKey[str]()


def pytest_configure(config):
    config.pluginmanager.register(NotebooksAtSmokeBudget(), "workbench-notebooks-at-smoke-budget")
    Workers = TimingTestsHaveTheMachineToThemselves
    if hasattr(config, "workerinput"):  # an xdist worker
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if workers > 1 and Workers.LOCKS in os.environ:
            plugin = Workers(workers, Path(os.environ[Workers.LOCKS]))
            config.pluginmanager.register(plugin, "workbench-timing-tests-alone")
    elif getattr(config.option, "numprocesses", None):  # the xdist controller: workers inherit the folder
        config.option.loadscopereorder = False  # the files in collection order: longest first
        config.stash[LOCK_FOLDER] = os.environ[Workers.LOCKS] = tempfile.mkdtemp(
            prefix="workbench-test-locks-"
        )


def pytest_unconfigure(config):
    folder = config.stash.get(LOCK_FOLDER, None)
    if folder:  # the controller, after its workers ended
        for name in TimingTestsHaveTheMachineToThemselves.FILES:
            Path(folder, name).unlink(missing_ok=True)
        Path(folder).rmdir()


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebooks)
            if path.name in TIMED_NOTEBOOKS:
                item.add_marker(pytest.mark.timing)
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
    _timing_tests_last_in_their_file(items)
    _longest_files_first(items)


# Each test file's seconds in a full run (.ci/file-seconds refreshes them from a JUnit XML).
FILE_SECONDS = Path(__file__).resolve().parent / "file_seconds.json"


def _longest_files_first(items: list) -> None:
    """The files in the order xdist hands them out (--dist loadfile): the longest first.

    xdist gives a free worker the next file in collection order (its own reordering, by number
    of tests, is turned off in pytest_configure). By number of tests, test_slurm (10 tests, over
    two minutes) came among the last files, and one worker ran it while the other idled. Longest
    first, the short files at the end even out the workers. A file not in FILE_SECONDS
    counts as a median one. The order within each file is kept.
    """
    root = FILE_SECONDS.parent.parent
    known = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    typical = statistics.median(known.values()) if known else 0.0

    def seconds(item) -> float:
        path = Path(str(item.fspath))
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        return known.get(name, typical)

    items.sort(key=lambda item: -seconds(item))  # stable: each file's own order stays


def _timing_tests_last_in_their_file(items: list) -> None:
    """Each test file's timing tests one after another, after its other tests (a notebook's cells
    keep their order: they are one kernel's session).

    Under xdist a file runs on one worker, and a timing test waits for the other worker's test
    to end before it has the machine alone (TimingTestsHaveTheMachineToThemselves); a timing test
    followed by another keeps it. Scattered through their files, the timing tests made 15 such
    waits in a CI run; together, one per file.
    """
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(str(item.fspath), index)

    def place(pair: tuple[int, object]) -> tuple[int, bool, int]:
        index, item = pair
        path = str(item.fspath)
        timing = path.endswith(".py") and item.get_closest_marker("timing") is not None
        return first_seen[path], timing, index

    items[:] = [item for _, item in sorted(enumerate(items), key=place)]
