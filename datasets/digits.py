"""scikit-learn's bundled handwritten digits: 1,797 grayscale 8x8 images, 10 classes.

Source: the UCI ML hand-written digits dataset, as shipped in ``sklearn.datasets``.
Pixels are stored as float32 in [0, 1] with shape (N, 1, 8, 8).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from workbench.datasets import Builder, save_arrays

NUM_CLASSES = 10
SHAPE = (1, 8, 8)


def build() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32).reshape(-1, *SHAPE)
    return {"inputs": images, "targets": digits.target.astype(np.int64)}


BUILDER = Builder("digits", 1, build, "scikit-learn digits: 1,797 images 1x8x8, 10 classes")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the .npz file")
    save_arrays(Path(parser.parse_args().out), build())
