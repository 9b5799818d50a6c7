"""Builders for the workbench's built-in datasets, from data that ships inside packages.

Nothing is downloaded: digits come with scikit-learn, the texture photos with
scikit-image, and the text corpus is the Python standard library's own source code.
Each builder writes one ``.npz`` file (plain arrays, loaded with ``allow_pickle=False``)
into the cache directory, ``$WORKBENCH_CACHE`` or ``~/.cache/workbench``; arms load that
file instead of importing scikit-learn or scikit-image again.

This folder is installed as ``workbench.datasets``; each module also runs as a script,
e.g. ``python -m workbench.datasets.textures --out textures.npz --patches-per-class 256``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Builder:
    name: str
    version: int  # bump when the output changes, so stale caches are rebuilt
    build: Callable[[], dict[str, np.ndarray]]
    summary: str


def cache_dir() -> Path:
    root = os.environ.get("WORKBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "workbench"
    )
    return Path(root) / "datasets"


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically: concurrent builders (two test workers, two notebooks) never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
    with os.fdopen(handle, "wb") as file:
        np.savez(file, **arrays)
    os.replace(temporary, path)


def builders() -> dict[str, Builder]:
    from workbench.datasets import digits, text, textures

    return {b.name: b for b in (digits.BUILDER, textures.BUILDER, text.BUILDER)}


def ensure_built(name: str) -> Path:
    """The cached file for a built-in dataset, building it first if needed."""
    builder = builders()[name]
    path = cache_dir() / f"{name}-v{builder.version}.npz"
    if not path.exists():
        save_arrays(path, builder.build())
    return path


def load(path: Path | str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as arrays:
        return {key: arrays[key] for key in arrays.files}
