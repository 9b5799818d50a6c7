"""The bare install (no extras) is a first-class user: optional packages that are missing are
reported as unavailable, with the reason, and never crash a command.

The test environment has the extras installed, so each check runs in a subprocess whose
import system hides them: a meta-path finder that raises ModuleNotFoundError, exactly as a
bare install does (``find_spec("nvidia.dali")`` raises there, because ``nvidia`` is absent).
``.ci/bare-install`` checks the same with a real fresh virtual environment; the last test runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workbench import optional

HIDDEN = ("nvidia", "cupy", "pynvml", "cuda", "ipywidgets", "jupyterlab", "submitit")

HIDE = f"""
import sys
HIDDEN = {HIDDEN!r}

class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name.split('.')[0]!r}}", name=name.split(".")[0])
        return None

sys.meta_path.insert(0, Hide())
"""


def run_bare(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "bare.py"
    script.write_text(HIDE + textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_the_hiding_works(tmp_path):
    """The negative control: without the fix, the bare checks below would see this error."""
    done = run_bare(
        """
        import importlib.util
        try:
            importlib.util.find_spec("nvidia.dali")
        except ModuleNotFoundError as error:
            print("raised", error.name)
        """,
        tmp_path,
    )
    assert done.stdout.strip() == "raised nvidia", done.stderr


def test_list_env_and_dry_run_report_missing_packages(tmp_path):
    done = run_bare(
        """
        from workbench.cli import main
        for argv in (["list"], ["env"], ["ablate", "--dry-run"]):
            print("exit", main(argv))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("exit 0") == 3, done.stdout + done.stderr
    words = " ".join(done.stdout.split())  # tables wrap long reasons inside their columns
    assert "no module named 'nvidia'" in words  # dali's reason, in list, env and the plan
    assert "pip install 'workbench[notebook]'" in words  # the panel's packages, in list
    for package in ("nvidia.dali", "cupy", "pynvml", "ipywidgets", "jupyterlab", "submitit"):
        assert f"{package}" in words


@pytest.mark.slow  # a real ablation in fresh processes
def test_plan_and_a_small_ablation_run_without_the_extras(tmp_path):
    done = run_bare(
        """
        import json
        import workbench as wb
        plan = wb.plan(model="mlp")  # every technique, the optional ones among them
        dali = plan.set_index("name").loc["dali", "unavailable"]
        res = wb.ablate(model="mlp", techniques={"amp": True}, steps=10, warmup=2, blocks=1,
                        progress=False, out=False)
        from workbench import *  # noqa: F403 (it raised ImportError for panel, as did help(wb))

        help(wb)
        try:
            wb.panel(model="mlp")
            panel = "opened"
        except ImportError as error:
            panel = str(error)
        print(json.dumps({"dali": dali, "status": list(res.table.status), "panel": panel}))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert "not installed" in answer["dali"]
    assert answer["status"] == ["ok", "ok", "ok"]
    assert "pip install 'workbench[notebook]'" in answer["panel"]


BROKEN = {  # installed, and broken in the ways a half-installed package is
    "cupy/__init__.py": "raise SystemExit('cupy: fatal: libcudart.so.12 not found')",
    "submitit/__init__.py": "raise RuntimeError('submitit broken')",
    "ipywidgets/__init__.py": "raise ImportError('cannot import name Widget')",
    "nvidia/__init__.py": "",
    "nvidia/dali/__init__.py": "",
    "nvidia/dali/plugin/__init__.py": "",
    "nvidia/dali/plugin/pytorch.py": "raise ImportError('DALI pytorch plugin: libdali_torch.so not found')",
}


def test_installed_packages_that_fail_to_import_are_reasons_in_list_env_and_the_panel(tmp_path):
    """A CuPy that raised SystemExit as it imported ended `workbench list`, `env` and every run; a
    broken ipywidgets or submitit was only found, so shown available, and failed later with a bare
    traceback; DALI was shown available when its PyTorch plugin, which the technique uses, failed."""
    for name, text in BROKEN.items():
        (tmp_path / "broken" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "broken" / name).write_text(text + "\n")
    script = tmp_path / "broken.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path / "broken")!r})
            from workbench.cli import main
            for argv in (["list"], ["env"]):
                print("exit", main(argv))
            import workbench as wb
            for call in (lambda: wb.panel(model="mlp"), lambda: __import__("workbench.widgets")):
                try:
                    call()
                except ImportError as error:
                    print("panel:", error)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("exit 0") == 2, done.stdout + done.stderr
    words = " ".join(done.stdout.split())
    for said in (
        "cupy is installed but cannot be imported: SystemExit: cupy: fatal",
        "submitit is installed but cannot be imported: RuntimeError: submitit broken",
        "nvidia.dali is installed but cannot be imported (nvidia.dali.plugin.pytorch): ImportError",
        "panel: workbench.panel needs ipywidgets: ipywidgets is installed but cannot be imported",
        "panel: workbench.widgets needs ipywidgets: ipywidgets is installed but cannot be imported",
    ):
        assert said in words, said + "\n" + done.stdout


def test_a_package_that_hangs_on_import_is_named_and_can_be_set_aside(tmp_path):
    """A CuPy whose import hangs (a driver that does not answer) stalled `workbench list` without
    a word. It cannot be cut short, so after a while the probe says which package it waits on and
    how to go on without it; WORKBENCH_WITHOUT then lists it as set aside, never importing it."""
    (tmp_path / "hanging" / "cupy").mkdir(parents=True)
    (tmp_path / "hanging" / "cupy" / "__init__.py").write_text("import time\ntime.sleep(600)\n")
    script = tmp_path / "hanging.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path / "hanging")!r})
            from workbench import optional
            optional.SLOW_IMPORT_S = 1.0
            from workbench.cli import main
            sys.exit(main(["list"]))
            """
        )
    )
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as sink:
        hanging = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=sink)
        try:
            # Up to two minutes for torch's import and the probes before cupy's; on a loaded machine
            # DALI's real import can pass the 1 s too, and is said first: wait for cupy's line.
            for _ in range(1200):
                if "to probe cupy has taken" in stderr.read_text() or hanging.poll() is not None:
                    break
                time.sleep(0.1)
        finally:
            hanging.kill()
            hanging.wait()
    said = " ".join(stderr.read_text().split())
    assert "importing cupy to probe cupy has taken 1 s so far" in said, said
    assert "set WORKBENCH_WITHOUT=cupy to go on without it" in said, said

    environment = {**os.environ, "WORKBENCH_WITHOUT": "cupy, pynvml"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=environment
    )
    assert done.returncode == 0, done.stdout + done.stderr
    words = " ".join(done.stdout.split())
    assert "cupy is set aside (WORKBENCH_WITHOUT=cupy, pynvml): workbench goes on without it" in words, words
    assert "pynvml is set aside" in words, words

    environment["WORKBENCH_WITHOUT"] = "cuppy"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=environment
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "WORKBENCH_WITHOUT names 'cuppy', not an optional package of workbench; valid names: nvidia.dali, cupy"
        in (" ".join(done.stderr.split()))
    )


def test_a_probe_never_raises(monkeypatch):
    def broken(name, package=None):
        raise RuntimeError("a half-installed package")

    monkeypatch.setattr(optional.importlib.util, "find_spec", broken)
    for package in optional.OPTIONAL_PACKAGES:  # every one is probed through missing()
        reason = optional.missing(package.module, package.install)
        assert "half-installed" in reason and package.install in reason


def test_an_installed_package_that_cannot_be_imported_is_unavailable(monkeypatch):
    """A DALI whose library fails to load was found, so shown available, and its arm then failed."""
    import sys
    import types

    monkeypatch.setattr(optional.importlib.util, "find_spec", lambda name: types.SimpleNamespace(name=name))
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import raises ImportError, as a broken wheel
    monkeypatch.setitem(
        sys.modules, "nvidia.dali.plugin.pytorch", None
    )  # what the probe imports (a test may have)
    optional._import_fails.cache_clear()
    try:
        reason = optional.missing("nvidia.dali", optional.install_hint("nvidia.dali"))
        assert (
            reason.startswith("nvidia.dali is installed but cannot be imported")
            and "ModuleNotFoundError" in reason
        )
        assert optional.missing("jupyterlab") is None  # found is enough for what no arm depends on
    finally:
        optional._import_fails.cache_clear()


@pytest.mark.slow  # pip installs torch into a fresh virtual environment: about 40 s here
def test_a_real_install_without_extras_runs_a_newcomers_first_commands():
    """``.ci/bare-install``: ``pip install -e .`` into a fresh venv, then list, env, the dry runs,
    an ablation and show, with every optional part reported unavailable. Run as a test, not before
    the suite, so that it waits on pip beside the other worker's tests instead of before them all."""
    script = Path(__file__).resolve().parent.parent / ".ci" / "bare-install"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("bare install: ok"), (
        done.stdout[-4000:] + done.stderr[-4000:]
    )
