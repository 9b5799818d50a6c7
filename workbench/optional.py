"""Optional packages: each one's absence is a reason shown to the user, never a crash.

The bare install (``pip install -e .``, no extras) is a first-class user, so every optional
package is probed through :func:`missing`, or imported inside a ``try`` that turns any failure
into a reason, and every message about one gives its :func:`install_hint`. ``find_spec`` alone
is not enough: for a dotted name it imports the parent first, so ``find_spec("nvidia.dali")``
*raises* ModuleNotFoundError when no ``nvidia`` package exists at all, and a half-installed
package can raise anything while its parent imports: SystemExit too (a library that "exits" when
its shared object is missing), which would otherwise end ``workbench list`` and every run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class OptionalPackage:
    module: str  # what is imported
    purpose: str  # what workbench uses it for
    install: str  # how to get it
    # Probed by importing it, not only found: a technique or a view shown available must work, and
    # an installed package can still fail to import (a library it loads is missing). The others
    # are only found: importing them costs seconds (jupyterlab), or imports torch's own copy.
    imported: bool = False
    probe: str = ""  # the module imported to probe it, when not ``module`` itself (what workbench imports)


OPTIONAL_PACKAGES = (
    OptionalPackage(
        "nvidia.dali",
        "the dali technique",
        "pip install 'workbench[dali]'; its CPU operators need no GPU",
        imported=True,
        probe="nvidia.dali.plugin.pytorch",  # the technique's iterator: DALI can import without it
    ),
    OptionalPackage(
        "cupy",
        "cupy_fusion's raw CUDA kernels",
        "pip install 'workbench[gpu]' (cupy-cuda12x), or cupy-cuda13x to match a CUDA 13 driver",
        imported=True,
    ),
    OptionalPackage("pynvml", "GPU utilization, power and clocks", "pip install nvidia-ml-py"),
    OptionalPackage(
        "cuda.bindings", "the NVRTC compile check of kernels/", "pip install cuda-bindings nvidia-cuda-nvrtc"
    ),
    OptionalPackage("ipywidgets", "the notebook panel", "pip install 'workbench[notebook]'", imported=True),
    OptionalPackage("jupyterlab", "the teaching notebooks", "pip install 'workbench[notebook]'"),
    OptionalPackage(
        "submitit",
        "executor='slurm': blocks as Slurm jobs",
        "pip install 'workbench[cluster]', or pip install -e .[cluster] from a clone",
        imported=True,
    ),
)


# Optional packages to go without: their names, comma-separated. Each is then unavailable, with
# this as its reason, and is not imported: the way on when one hangs on import (a driver that does
# not answer, a network file system), or to see what the bare install would.
WITHOUT_ENV = "WORKBENCH_WITHOUT"
# An import probe that takes longer than this says so on stderr, naming the package and the way on.
SLOW_IMPORT_S = 20.0


def set_aside() -> set[str]:
    """The optional packages WORKBENCH_WITHOUT names; a name that is not one is refused, naming them."""
    named = {name.strip() for name in os.environ.get(WITHOUT_ENV, "").split(",") if name.strip()}
    valid = [package.module for package in OPTIONAL_PACKAGES]
    unknown = sorted(named - set(valid))
    if unknown:
        raise ValueError(
            f"{WITHOUT_ENV} names {', '.join(map(repr, unknown))}, not an optional package of "
            f"workbench; valid names: {', '.join(valid)} (comma-separated)"
        )
    return named


def install_hint(module: str) -> str:
    """How to install one of OPTIONAL_PACKAGES: every message that names it says the same."""
    return next(p.install for p in OPTIONAL_PACKAGES if p.module == module)


def missing(module: str, install: str = "") -> str | None:
    """None when ``module`` can be found, else why not, as one line for the user."""
    hint = f" ({install})" if install else ""
    if module in set_aside():
        return (
            f"{module} is set aside ({WITHOUT_ENV}={os.environ[WITHOUT_ENV]}): workbench goes on without it"
        )
    try:
        spec = importlib.util.find_spec(module)
    except ValueError:  # imported already, without a __spec__ (a stand-in module): it is there
        spec = sys.modules.get(module)
        if spec is None:
            return f"{module} could not be probed: it has no module spec{hint}"
    except ModuleNotFoundError as error:  # a parent package is missing: nvidia for nvidia.dali
        return f"{module} is not installed: no module named {error.name!r}{hint}"
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - a broken parent package; its error is the reason
        return f"{module} could not be probed: {type(error).__name__}: {error}{hint}"
    if spec is None:
        return f"{module} is not installed{hint}"
    for package in OPTIONAL_PACKAGES:
        if package.module == module and package.imported:
            return _import_fails(module, package.probe or module, hint)
    return None


@functools.cache
def _import_fails(module: str, probe: str, hint: str) -> str | None:
    """Why an installed ``module`` cannot be imported (its ``probe`` module; once per process), or None."""
    try:
        with _said_if_slow(module, probe):
            importlib.import_module(probe)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - whatever a broken install raises (SystemExit too) is the reason
        said = " ".join(str(error).split())[:300]
        part = f" ({probe})" if probe != module else ""
        return f"{module} is installed but cannot be imported{part}: {type(error).__name__}: {said}{hint}"
    return None


@contextlib.contextmanager
def _said_if_slow(module: str, probe: str) -> Iterator[None]:
    """Say on stderr when importing ``probe`` outlasts SLOW_IMPORT_S, and how to go on without it.

    An import cannot be cut short from another thread, and one that hangs would otherwise stall
    ``workbench list`` and every run without a word."""

    def say() -> None:
        print(
            f"workbench: importing {probe} to probe {module} has taken {SLOW_IMPORT_S:.0f} s so far. "
            f"If it hangs, stop with Ctrl-C and set {WITHOUT_ENV}={module} to go on without it.",
            file=sys.stderr,
            flush=True,
        )

    timer = threading.Timer(SLOW_IMPORT_S, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def needed_by(needer: str, module: str) -> Iterator[None]:
    """Around ``import module`` in ``needer``, a module of workbench's own that cannot work
    without it: an import that fails, however it fails (SystemExit too), is one ImportError that
    names the install. Imported directly, it failed with a bare ModuleNotFoundError that said
    nothing of the extra to install."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - a broken install can raise anything
        reason = missing(module, install_hint(module))
        if reason:
            raise ImportError(f"{needer} needs {module}: {reason}") from error
        raise


def report() -> list[dict]:
    """Every optional package: module, purpose, and ``unavailable`` (the reason, or None)."""
    return [
        {"package": p.module, "for": p.purpose, "unavailable": missing(p.module, p.install)}
        for p in OPTIONAL_PACKAGES
    ]
