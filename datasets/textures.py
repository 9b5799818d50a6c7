"""Texture patches cut from photos that ship with scikit-image: one class per photo.

Classes: brick, grass, gravel (scikit-image's texture samples), moon (lunar surface),
cell (microscopy) and coins. Each sample is a random 32x32 grayscale crop, stored as
uint8 with shape (N, 1, 32, 32); the loader converts and normalises per sample, as a
real image pipeline would.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from workbench.datasets import Builder, save_arrays

CLASSES = ("brick", "grass", "gravel", "moon", "cell", "coins")
PATCH = 32
SHAPE = (1, PATCH, PATCH)
NUM_CLASSES = len(CLASSES)


def build(patches_per_class: int = 512, patch: int = PATCH, seed: int = 0) -> dict[str, np.ndarray]:
    import skimage.data

    rng = np.random.default_rng(seed)
    inputs, targets = [], []
    for label, name in enumerate(CLASSES):
        photo = getattr(skimage.data, name)()
        if photo.ndim == 3:  # keep every class grayscale so colour alone cannot give the answer
            photo = photo.mean(axis=2).astype(np.uint8)
        rows = rng.integers(0, photo.shape[0] - patch, patches_per_class)
        cols = rng.integers(0, photo.shape[1] - patch, patches_per_class)
        inputs.extend(photo[r : r + patch, c : c + patch] for r, c in zip(rows, cols, strict=True))
        targets.extend([label] * patches_per_class)
    return {
        "inputs": np.stack(inputs)[:, None].astype(np.uint8),
        "targets": np.asarray(targets, dtype=np.int64),
        "classes": np.asarray(CLASSES),
    }


BUILDER = Builder(
    "textures", 1, build, "6 texture classes cropped from scikit-image photos: 3,072 patches 1x32x32"
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the .npz file")
    parser.add_argument("--patches-per-class", type=int, default=512)
    parser.add_argument("--patch", type=int, default=PATCH, help="side of each square crop, in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    save_arrays(Path(args.out), build(args.patches_per_class, args.patch, args.seed))
