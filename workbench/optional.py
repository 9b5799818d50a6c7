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


def install_hint(module: str) -> str:
    """How to install one of OPTIONAL_PACKAGES: every message that names it says the same."""
    return next(p.install for p in OPTIONAL_PACKAGES if p.module == module)


def missing(module: str, install: str = "") -> str | None:
    """None when ``module`` can be found, else why not, as one line for the user."""
    hint = f" ({install})" if install else ""
    try:
        spec = importlib.util.find_spec(module)
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
        importlib.import_module(probe)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - whatever a broken install raises (SystemExit too) is the reason
        said = " ".join(str(error).split())[:300]
        part = f" ({probe})" if probe != module else ""
        return f"{module} is installed but cannot be imported{part}: {type(error).__name__}: {said}{hint}"
    return None


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
