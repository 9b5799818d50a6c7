"""AMP level O2: a model in half precision, trained through float32 master weights.

Level O1 (``torch.autocast``) keeps the weights in float32 and casts each matmul's inputs on the
fly. O2, the level NVIDIA's Apex named and the Baidu AIAK-Training write-up lists beside O1,
casts the model itself, so weights, activations and gradients are all 16-bit and nothing is cast
again inside the step:

- :func:`cast_keeping_norms_in_float32`: every parameter and buffer in the 16-bit type, except
  BatchNorm, LayerNorm, GroupNorm and InstanceNorm, whose statistics need float32's precision.
  Those keep float32 weights. PyTorch's norm kernels take a 16-bit input beside float32 weights
  and compute the statistics in float32 (cuDNN's batch norm, and the CPU kernels used here);
  where a layer's kernel refuses that on the device (a probe says), its input is cast to
  float32 and its output back instead, which costs two casts and saves the float32 input for
  backward.
- :class:`MasterWeightOptimizer`: the run's optimizer steps float32 copies of the parameters (the
  master weights), since a 16-bit weight cannot absorb an update much smaller than itself; after
  each step the masters are copied back into the model.
- :class:`DynamicLossScaler`: for float16, whose 5-bit exponent underflows small gradients, the
  loss is multiplied by a scale before backward, the gradients are divided by it as they become
  the masters' gradients, and a step whose gradients overflowed is skipped and the scale halved
  (Micikevicius et al., "Mixed Precision Training", ICLR 2018; the same defaults as PyTorch's
  GradScaler). bfloat16 has float32's exponent and needs none of this.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from workbench.data import map_tensors

# Normalization layers: their mean and variance are computed in float32 under O2.
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def to_dtype(value: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in ``value`` (a tensor, or nested tuples, lists and dicts) in ``dtype``;
    integer tensors (token ids, labels) and everything else as they are."""
    return map_tensors(value, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


def cast_keeping_norms_in_float32(model: nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """Cast ``model`` to ``dtype`` in place, but for its normalization layers, which keep float32
    weights: fed the 16-bit activations directly where their kernels take a mixed input, else
    fed float32 and handing ``dtype`` back. Returns (norm layers kept, of which cast around)."""
    norms = [module for module in model.modules() if isinstance(module, NORMS)]
    mixed = {id(norm): _takes_mixed_input(norm, dtype) for norm in norms}
    model.to(dtype)
    for norm in norms:
        norm.float()
        if not mixed[id(norm)]:
            norm.register_forward_pre_hook(lambda module, args: to_dtype(args, torch.float32))
            norm.register_forward_hook(lambda module, args, output: to_dtype(output, dtype))
    return len(norms), sum(not native for native in mixed.values())


_MIXED_KERNELS: dict[tuple, bool] = {}  # (layer type, device type, dtype) -> a mixed input works


def _takes_mixed_input(norm: nn.Module, dtype: torch.dtype) -> bool:
    """Whether this kind of norm layer runs forward and backward on a ``dtype`` input with its
    float32 weights, on the layer's device: probed once, on a copy, with a tiny input."""
    device = next((p.device for p in norm.parameters()), torch.device("cpu"))
    key = (type(norm), device.type, dtype)
    if key not in _MIXED_KERNELS:
        shape = _probe_shape(norm)
        works = False
        if shape is not None:
            probe = copy.deepcopy(norm).float().train()
            inputs = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            try:
                output = probe(inputs)
                output.float().sum().backward()
                works = output.dtype == dtype
            except (RuntimeError, ValueError):
                works = False
        _MIXED_KERNELS[key] = works
    return _MIXED_KERNELS[key]


def _probe_shape(norm: nn.Module) -> tuple[int, ...] | None:
    if isinstance(norm, nn.LayerNorm):
        return (2, *norm.normalized_shape)
    if isinstance(norm, nn.GroupNorm):
        return (2, norm.num_channels, 2)
    for extra in range(4):  # BatchNorm1d/2d/3d, InstanceNorm: the input rank each accepts
        shape = (2, norm.num_features, *(2,) * extra)
        try:
            norm._check_input_dim(torch.empty(shape, device="meta"))
            return shape
        except ValueError:
            continue
    return None


class MasterWeightOptimizer:
    """An optimizer over float32 master copies of a 16-bit model's parameters.

    It offers what the train step uses of an optimizer: ``step``, ``zero_grad`` and
    ``param_groups`` (the inner optimizer's, over the masters). ``step`` moves the model's
    gradients to the masters (in float32, divided by a loss scale if one was used), steps the
    inner optimizer, and copies the updated masters back into the model.
    """

    def __init__(
        self, parameters: Iterable[nn.Parameter], make_inner: Callable[[Any], torch.optim.Optimizer]
    ):
        self.model_parameters = [p for p in parameters if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.model_parameters]
        self.inner = make_inner(self.masters)
        self._gradients_loaded = False

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state

    def load_gradients(self, inverse_scale: float = 1.0) -> None:
        """The model's gradients, in float32 and unscaled, as the masters' gradients."""
        for parameter, master in zip(self.model_parameters, self.masters, strict=True):
            if parameter.grad is None:
                master.grad = None
                continue
            gradient = parameter.grad.float()
            master.grad = gradient.mul_(inverse_scale) if inverse_scale != 1.0 else gradient
        self._gradients_loaded = True

    def gradients_finite(self) -> bool:
        """Whether every master gradient is finite (one device-to-host read)."""
        grads = [master.grad for master in self.masters if master.grad is not None]
        return bool(torch.stack([g.isfinite().all() for g in grads]).all()) if grads else True

    @torch.no_grad()
    def step(self) -> None:
        if not self._gradients_loaded:
            self.load_gradients()
        self.inner.step()
        for parameter, master in zip(self.model_parameters, self.masters, strict=True):
            parameter.copy_(master)  # cast back to the model's 16-bit type
        self._gradients_loaded = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.model_parameters:
            if set_to_none:
                parameter.grad = None
            elif parameter.grad is not None:
                parameter.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)
        self._gradients_loaded = False

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for master, saved in zip(self.masters, state["masters"], strict=True):
                master.copy_(saved)


class DynamicLossScaler:
    """Loss scaling for float16 O2 (the LossScaler protocol of workbench.loop), over a
    MasterWeightOptimizer: scale up before backward, unscale into the masters, skip a step
    that overflowed and halve the scale; double it after ``growth_interval`` good steps."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale_value = scale
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0
        self._overflowed = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def step(self, optimizer: MasterWeightOptimizer) -> None:
        optimizer.load_gradients(1.0 / self.scale_value)
        self._overflowed = not optimizer.gradients_finite()
        if self._overflowed:
            self.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)  # this step's gradients are inf or nan: drop them
            return
        optimizer.step()

    def update(self) -> None:
        if self._overflowed:
            self.scale_value /= 2.0
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale_value *= 2.0
            self.good_steps = 0
