"""A folder of JPEG files, ImageFolder style, and the DataLoader pipeline that reads it.

``root/<class>/<image>.jpg``: one subfolder per class, labels numbered in sorted folder
order (torchvision's ImageFolder convention, which DALI's file reader also follows).

The folder is scanned once, in the process that plans the ablation. The scan fixes the
file list and the label of every file, and decodes each file once (at reduced scale, which
still reads the whole compressed stream) so that a corrupt JPEG is found before any arm
starts: it is either left out and counted (``on_corrupt="skip"``) or reported by name
(``on_corrupt="raise"``). Both pipelines, the DataLoader baseline here and DALI
(workbench.techniques.dali), then read exactly the same files with the same labels.

The baseline's transforms are those of the DALI pipeline, so the comparison is like for
like: decode to RGB, random resized crop (area 8-100%, aspect ratio 3/4-4/3, bilinear,
the Inception-style crop both torchvision and DALI default to), horizontal flip with
probability 1/2, normalisation by the ImageNet channel statistics, CHW float32.
"""

from __future__ import annotations

import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from workbench.config import check_choice, check_int

EXTENSIONS = (".jpg", ".jpeg")
ON_CORRUPT = ("skip", "raise")
# ImageNet channel statistics, the usual choice for photos (0-1 scale; DALI takes them x255).
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
CROP_AREA = (0.08, 1.0)
CROP_ASPECT = (3 / 4, 4 / 3)
SCAN_PROGRESS_FROM = 2000  # files; smaller folders scan in well under a second


@dataclass(frozen=True)
class JpegFolder:
    """Your own ImageFolder of JPEG files, as ``data`` for ``ablate``.

    ``data="jpeg-folder:PATH"`` is the same with every default.

    root        the folder holding one subfolder per class
    size        side of the square crops fed to the model, in pixels
    on_corrupt  ``"skip"``: leave corrupt files out, with a warning that counts them;
                ``"raise"``: stop with an error that names the first one
    classes     the class folder names you expect (e.g. to check a validation split
                against its training split); None accepts whatever is there
    """

    root: str
    size: int = 64
    on_corrupt: str = "skip"
    classes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root).strip():
            raise ValueError(f"jpeg-folder: root must be a folder path; got {self.root!r}")
        object.__setattr__(self, "root", str(self.root))
        check_int("jpeg-folder", "size", self.size, 8)
        check_choice("jpeg-folder", "on_corrupt", self.on_corrupt, ON_CORRUPT)
        if self.classes is not None:
            if isinstance(self.classes, str) or not all(isinstance(c, str) for c in self.classes):
                raise ValueError(f"jpeg-folder: classes must be a list of folder names; got {self.classes!r}")
            object.__setattr__(self, "classes", tuple(self.classes))


@dataclass
class ImageFiles:
    """The outcome of a scan: what every arm reads, in this order, with these labels."""

    root: str
    files: list[str]
    labels: list[int]
    classes: list[str]
    size: int
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, why) left out as corrupt

    def note(self) -> str:
        if not self.skipped:
            return ""
        first, why = self.skipped[0]
        return f"{len(self.skipped)} corrupt JPEG file(s) left out (first: {first}: {why})"


def _is_jpeg_name(path: Path) -> bool:
    return path.suffix.lower() in EXTENSIONS and not path.name.startswith(".")


def _corruption(path: str, size: int) -> str | None:
    """None when the file decodes as a JPEG, else a one-line reason."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            # MPO: a JPEG holding more pictures after the first (phone cameras write them),
            # which every decoder here reads as that first picture
            if image.format not in ("JPEG", "MPO"):
                return f"not a JPEG but {image.format}"
            # Draft mode decodes at 1/2..1/8 scale: much cheaper, yet it still reads every
            # compressed byte, so truncation and bad markers still fail here.
            image.draft("RGB", (size, size))
            image.load()
    except Exception as error:  # PIL raises OSError, SyntaxError, ValueError... for bad files
        text = " ".join(str(error).split()) or type(error).__name__
        return text[:200]
    return None


def scan(folder: JpegFolder, progress: bool = True) -> ImageFiles:
    """List and check the folder. Raises ValueError with a clear message for a bad layout."""
    root = Path(folder.root).expanduser()
    where = f"jpeg-folder {str(root)!r}"
    class_dirs = _class_folders(root, where)
    classes = [p.name for p in class_dirs]
    _check_expected_classes(folder.classes, classes, where)
    files, labels = _list_jpegs(class_dirs, where)
    reasons = _corruption_reasons(files, folder.size, root.name, progress)
    bad = [(f, why) for f, why in zip(files, reasons, strict=True) if why]
    if bad and folder.on_corrupt == "raise":
        raise ValueError(
            f"{where}: corrupt JPEG {bad[0][0]} ({bad[0][1]})"
            + (f", and {len(bad) - 1} more" if len(bad) > 1 else "")
            + "; pass on_corrupt='skip' to leave such files out"
        )
    if bad:
        files, labels = _without_corrupt(files, labels, reasons, classes, bad, where)
        warnings.warn(
            f"{where}: skipped {len(bad)} corrupt JPEG file(s) of {len(files) + len(bad)} "
            f"(first: {bad[0][0]}: {bad[0][1]})",
            stacklevel=2,
        )
    return ImageFiles(str(root), files, labels, classes, folder.size, bad)


def _class_folders(root: Path, where: str) -> list[Path]:
    """The class subfolders in sorted order (their index is the label); a clear error for any other layout."""
    if not root.exists():
        raise ValueError(f"{where} does not exist")
    if not root.is_dir():
        raise ValueError(f"{where} is a file, not a folder of class subfolders")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    stray = sorted(p.name for p in root.iterdir() if p.is_file() and _is_jpeg_name(p))
    if not class_dirs:
        found = f"; it holds {len(stray)} JPEG files directly" if stray else ""
        raise ValueError(
            f"{where} has no class subfolders{found}: expected the ImageFolder layout root/<class>/<image>.jpg"
        )
    if stray:
        raise ValueError(
            f"{where}: {len(stray)} JPEG file(s) lie directly in the root, outside any class folder "
            f"(first: {stray[0]}); move them into their class folder"
        )
    return class_dirs


def _check_expected_classes(expected: tuple[str, ...] | None, classes: list[str], where: str) -> None:
    if expected is not None and sorted(expected) != classes:
        missing = sorted(set(expected) - set(classes))
        unexpected = sorted(set(classes) - set(expected))
        raise ValueError(
            f"{where}: the class folders do not match the expected classes "
            f"(missing: {', '.join(missing) or 'none'}; unexpected: {', '.join(unexpected) or 'none'})"
        )


def _list_jpegs(class_dirs: list[Path], where: str) -> tuple[list[str], list[int]]:
    """Every JPEG under each class folder, sorted, with the class's index as its label."""
    files, labels = [], []
    for label, class_dir in enumerate(class_dirs):
        found = sorted(str(p) for p in class_dir.rglob("*") if p.is_file() and _is_jpeg_name(p))
        if not found:
            raise ValueError(
                f"{where}: class folder {class_dir.name!r} holds no JPEG files ({'/'.join(EXTENSIONS)}); "
                "every class needs at least one image, or remove the folder"
            )
        files += found
        labels += [label] * len(found)
    return files, labels


def _corruption_reasons(files: list[str], size: int, name: str, progress: bool) -> list[str | None]:
    """Per file, None or why it does not decode; decoded in threads, with a progress bar for big folders."""
    from tqdm.auto import tqdm

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # PIL decodes without the GIL
        checks = pool.map(_corruption, files, [size] * len(files))
        return list(
            tqdm(
                checks,
                total=len(files),
                desc=f"checking {name}",
                unit="file",
                disable=not progress or len(files) < SCAN_PROGRESS_FROM,
            )
        )


def _without_corrupt(
    files: list[str],
    labels: list[int],
    reasons: list[str | None],
    classes: list[str],
    bad: list[tuple[str, str]],
    where: str,
) -> tuple[list[str], list[int]]:
    """The files and labels left once the corrupt ones go; an error if that empties a class or all."""
    keep = [why is None for why in reasons]
    files = [f for f, k in zip(files, keep, strict=True) if k]
    labels = [lab for lab, k in zip(labels, keep, strict=True) if k]
    if not files:
        raise ValueError(f"{where}: all {len(bad)} JPEG files are corrupt (first: {bad[0][0]}: {bad[0][1]})")
    present = set(labels)
    empty = [c for i, c in enumerate(classes) if i not in present]
    if empty:
        raise ValueError(f"{where}: every JPEG in class folder {empty[0]!r} is corrupt")
    return files, labels


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of an Inception-style crop: random area and aspect ratio.

    Up to ten tries for a box that fits; otherwise the largest centred box with an allowed
    aspect ratio (the same fallback torchvision and DALI use).
    """
    area = height * width
    log_low, log_high = math.log(CROP_ASPECT[0]), math.log(CROP_ASPECT[1])
    for _ in range(10):
        target = area * rng.uniform(*CROP_AREA)
        aspect = math.exp(rng.uniform(log_low, log_high))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    ratio = width / height
    if ratio < CROP_ASPECT[0]:
        w, h = width, round(width / CROP_ASPECT[0])
    elif ratio > CROP_ASPECT[1]:
        h, w = height, round(height * CROP_ASPECT[1])
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


class JpegDataset(Dataset):
    """The DataLoader baseline: PIL decode, random resized crop, flip, normalise, CHW float32."""

    def __init__(self, images: ImageFiles):
        self.images = images
        self.mean = np.asarray(MEAN, dtype=np.float32) * 255
        self.inv_std = 1.0 / (np.asarray(STD, dtype=np.float32) * 255)

    def __len__(self) -> int:
        return len(self.images.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        # np.random is seeded per process (and per DataLoader worker), so runs are repeatable.
        rng = np.random.default_rng(np.random.randint(2**31))
        size = self.images.size
        with Image.open(self.images.files[index]) as image:
            image = image.convert("RGB")
            box = random_resized_crop_box(image.height, image.width, rng)
            crop = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
        pixels = np.asarray(crop, dtype=np.float32)
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        pixels = (pixels - self.mean) * self.inv_std
        chw = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
        return chw, torch.tensor(self.images.labels[index], dtype=torch.int64)
