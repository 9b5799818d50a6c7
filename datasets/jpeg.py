"""An ImageFolder of real JPEG files, cut from the colour photos that ship with scikit-image.

One class per photo: astronaut, coffee, chelsea (a cat), rocket, immunohistochemistry
(stained tissue) and hubble_deep_field (galaxies). Each image is a random crop (between
a fifth and three fifths of the photo's shorter side), resized to ``size`` x ``size`` and
saved as a baseline JPEG, so decoding it costs what decoding a real dataset's files costs.

Layout: ``<root>/<class>/<class>_<index>.jpg``, the ImageFolder convention that both the
DataLoader pipeline and DALI's file reader read. ``data="jpeg"`` builds the default set
(64 images per class, 128 px) once into the cache and trains on 64 px random resized crops
of it; build a bigger one for your own measurements and pass ``data="jpeg-folder:PATH"``:

    python -m workbench.datasets.jpeg --out /tmp/jpeg --images-per-class 500 --size 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

CLASSES = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")
VERSION = 1
IMAGES_PER_CLASS = 64
SIZE = 128  # side of the stored JPEG files
CROP = 32  # side of the random resized crops the model sees (CIFAR-sized: quick to train on CPU)
SUMMARY = (
    f"6 classes of crops of scikit-image's colour photos: {len(CLASSES) * IMAGES_PER_CLASS} JPEG files "
    f"{SIZE}x{SIZE}, read as 3x{CROP}x{CROP} random resized crops"
)


def build(
    root: Path | str,
    images_per_class: int = IMAGES_PER_CLASS,
    size: int = SIZE,
    quality: int = 90,
    seed: int = 0,
) -> Path:
    """Write the ImageFolder at ``root`` (which must not exist yet); return it."""
    import skimage.data
    from PIL import Image

    if images_per_class < 1 or size < 16:
        raise ValueError(
            f"jpeg dataset: need images_per_class >= 1 and size >= 16; got {images_per_class}, {size}"
        )
    root = Path(root)
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        photo = getattr(skimage.data, name)()[..., :3]
        folder = root / name
        folder.mkdir(parents=True)
        short = min(photo.shape[:2])
        for index in range(images_per_class):
            side = int(rng.integers(short // 5, 3 * short // 5))
            top = int(rng.integers(0, photo.shape[0] - side))
            left = int(rng.integers(0, photo.shape[1] - side))
            crop = Image.fromarray(photo[top : top + side, left : left + side])
            crop = crop.resize((size, size), Image.Resampling.BILINEAR)
            crop.save(folder / f"{name}_{index:05d}.jpg", format="JPEG", quality=quality)
    return root


def default_root(images_per_class: int = IMAGES_PER_CLASS, size: int = SIZE) -> Path:
    from workbench.datasets import cache_dir

    return cache_dir() / f"jpeg-v{VERSION}-{images_per_class}x{size}px"


def ensure_built(images_per_class: int = IMAGES_PER_CLASS, size: int = SIZE) -> Path:
    """The cached ImageFolder, built once (into a temporary folder, then renamed into place)."""
    target = default_root(images_per_class, size)
    cache = target.parent
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".jpeg-building-"))
    try:
        build(staging / "images", images_per_class, size)
        os.replace(staging / "images", target)
    except OSError:
        if not target.is_dir():  # not simply a concurrent builder that finished first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m workbench.datasets.jpeg", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, help="folder to create (must not exist)")
    parser.add_argument("--images-per-class", type=int, default=IMAGES_PER_CLASS)
    parser.add_argument("--size", type=int, default=SIZE, help="side of each square image, in pixels")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = build(args.out, args.images_per_class, args.size, args.quality, args.seed)
    print(
        f"wrote {len(CLASSES)} classes x {args.images_per_class} JPEG files of {args.size} px in {root}; "
        f"train on them with --data jpeg-folder:{root} (or data='jpeg-folder:{root}')"
    )
