"""What one sample of each built-in dataset looks like, so a built-in model can size itself.

The lowest floor of the data layer: models (which size themselves from a DataSpec) and data
(which loads the samples) both stand on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import unknown_name_error
from workbench.datasets import digits, jpeg, text, textures

BUILTIN_DATA = ("digits", "textures", "text", "jpeg", "synthetic")


@dataclass(frozen=True)
class DataSpec:
    """What one sample looks like, so a built-in model can size itself."""

    kind: str  # "image" (C, H, W floats) or "tokens" (T int64 ids)
    shape: tuple[int, ...]
    num_classes: int  # classes, or the vocabulary size for tokens


def builtin_spec(name: str) -> DataSpec:
    specs = {
        "digits": DataSpec("image", digits.SHAPE, digits.NUM_CLASSES),
        "textures": DataSpec("image", textures.SHAPE, textures.NUM_CLASSES),
        "text": DataSpec("tokens", text.SHAPE, text.VOCAB),
        "jpeg": DataSpec("image", (3, jpeg.CROP, jpeg.CROP), len(jpeg.CLASSES)),
    }
    if name not in specs:
        raise unknown_name_error("dataset", name, BUILTIN_DATA)
    return specs[name]
