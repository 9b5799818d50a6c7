"""A byte-level text corpus: the Python standard library's own source files.

Every Python installation carries it, so gpt-mini trains on real code with no download.
Files are read in sorted order from ``sysconfig``'s stdlib directory (tests and
site-packages excluded) until the corpus reaches its size. The bytes are the tokens
(vocabulary 256). The exact text depends on the Python version, which is recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
from workbench.datasets import Builder, save_arrays

VOCAB = 256
CONTEXT = 64  # tokens per training sequence
SHAPE = (CONTEXT,)
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def build(max_bytes: int = 2_000_000) -> dict[str, np.ndarray]:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py") or total >= max_bytes:
                continue
            data = (Path(directory) / name).read_bytes()[: max_bytes - total]
            chunks.append(data)
            total += len(data)
    if total < 10 * CONTEXT:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return {"corpus": corpus, "python_version": np.asarray(sys.version.split()[0])}


BUILDER = Builder("text", 1, build, "2 MB of Python stdlib source as bytes, for causal LM")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the .npz file")
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    args = parser.parse_args()
    save_arrays(Path(args.out), build(args.max_bytes))
