"""channels_last: NHWC memory layout for convolutional models.

What it does
    Stores 4-D activations and conv weights as (N, H, W, C) in memory instead of
    (N, C, H, W). The tensors keep their logical shape; only the strides change, so model
    code is untouched. Inputs are converted as they arrive on the device.

When it helps
    Convolution libraries (cuDNN on tensor cores, oneDNN on CPUs) run NHWC natively; in
    NCHW they may transpose around each conv. The gain is largest with amp on tensor-core
    GPUs (PyTorch's channels_last tutorial; MosaicML Composer ships it as an algorithm).

When it hurts
    Ops without an NHWC kernel convert back and forth, which can cost more than it saves;
    small convolutions and CPU backends vary. Models without Conv2d layers gain nothing, so
    for them it is reported as unavailable.

Settings
    None: it is on or off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.data import map_tensors
from workbench.techniques.base import Technique


@dataclass(frozen=True)
class ChannelsLastConfig:
    pass


def to_channels_last(inputs):
    """Every 4-D tensor among the inputs (a tensor, a tuple, a dict) in NHWC; the rest as it is."""
    return map_tensors(
        inputs,
        lambda tensor: tensor.contiguous(memory_format=torch.channels_last) if tensor.dim() == 4 else tensor,
    )


class ChannelsLast(Technique):
    name = "channels_last"
    summary = "NHWC memory layout for conv models (model weights and 4-D inputs)"
    order = 30
    group = "compute"
    Config = ChannelsLastConfig
    requires = ("conv",)

    def apply(self, setup, config: ChannelsLastConfig) -> str:
        setup.model = setup.model.to(memory_format=torch.channels_last)
        setup.input_transforms.append(to_channels_last)
        return "model and 4-D inputs in channels_last (NHWC)"


TECHNIQUE = ChannelsLast()
