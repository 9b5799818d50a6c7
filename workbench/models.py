"""Built-in models, one per kind of bottleneck, and the adapter for a user's own model.

- ``mlp``: a stack of small Linear layers. Each kernel does little work, so on a GPU the
  step is dominated by launch and Python overhead.
- ``resnet-mini``: a CIFAR-style ResNet (conv + BatchNorm): compute- and memory-bound
  convolutions, the home ground of channels_last.
- ``gpt-mini``: a small decoder-only transformer trained as a causal language model
  (attention, LayerNorm, GELU MLPs): matmul-bound, with activations that dominate memory.

Every built-in model keeps its repeated blocks in ``model.blocks`` (an nn.ModuleList):
that is what activation checkpointing wraps by default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import callable_label, error_text, unknown_name_error
from workbench.data_spec import DataSpec, builtin_spec


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, width), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class MLP(nn.Module):
    def __init__(self, spec: DataSpec, width: int = 256, depth: int = 4):
        super().__init__()
        in_features = 1
        for size in spec.shape:
            in_features *= size
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BasicBlock(nn.Module):
    """The two-conv residual block of He et al. (2016), with a 1x1 projection when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetMini(nn.Module):
    """Three stages (16, 32, 64 channels) of two BasicBlocks each, as in the CIFAR ResNets."""

    def __init__(self, spec: DataSpec, widths: tuple[int, ...] = (16, 32, 64), blocks_per_stage: int = 2):
        super().__init__()
        channels = spec.shape[0]
        self.stem = nn.Sequential(
            nn.Conv2d(channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks = []
        in_width = widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(in_width, width, stride))
                in_width = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(in_width, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTMini(nn.Module):
    """A pre-LayerNorm decoder-only transformer in the shape of GPT-2, scaled down."""

    def __init__(self, spec: DataSpec, width: int = 128, depth: int = 4, heads: int = 4):
        super().__init__()
        self.token_embedding = nn.Embedding(spec.num_classes, width)
        self.position_embedding = nn.Embedding(spec.shape[0], width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, spec.num_classes, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: N(0, 0.02). PyTorch's N(0, 1) embedding default, tied to the
        # output layer, would start training at a loss far above ln(vocab).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (batch, time, vocab) logits


class NoOpModel(nn.Module):
    """A model that does no work, so that a run times the input pipeline alone.

    The loader-only arms use it (the idea of Composer's NoOpModel): batches are still
    produced, collated and moved to the device, but forward, backward and the optimizer
    step cost next to nothing, so samples/s is what the loader can feed.
    """

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))  # one parameter, so the optimizer has a step to take

    def forward(self, *inputs: Any, **named_inputs: Any) -> torch.Tensor:
        return self.weight * 1.0


def noop_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return outputs


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    build: Callable[[DataSpec], nn.Module]
    accepts: tuple[str, ...]  # DataSpec kinds it can train on
    default_data: str
    summary: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "mlp", MLP, ("image",), "digits", "4 residual Linear blocks: launch- and overhead-bound"
        ),
        BuiltinModel(
            "resnet-mini", ResNetMini, ("image",), "textures", "CIFAR-style ResNet: conv + BatchNorm"
        ),
        BuiltinModel("gpt-mini", GPTMini, ("tokens",), "text", "4-layer decoder-only transformer, causal LM"),
    )
}


def list_models():
    """A DataFrame of the built-in models: name, default_data, accepts, summary."""
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "name": m.name,
                "default_data": m.default_data,
                "accepts": ", ".join(m.accepts),
                "summary": m.summary,
            }
            for m in BUILTIN_MODELS.values()
        ]
    )


def get_builtin_model(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise unknown_name_error("model", name, BUILTIN_MODELS) from None


def check_model_arg(model: object) -> None:
    """A model is a built-in name or a zero-argument callable returning an nn.Module."""
    if isinstance(model, str):
        get_builtin_model(model)
    elif isinstance(model, nn.Module):
        raise ValueError(
            "model must be a built-in name or a zero-argument callable that returns an nn.Module "
            "(e.g. model=lambda: MyNet()), not a module instance: every arm needs a fresh, identically "
            "initialised copy"
        )
    elif not callable(model):
        raise ValueError(
            f"model must be a built-in name ({', '.join(BUILTIN_MODELS)}) or a zero-argument callable "
            f"returning an nn.Module; got {model!r}"
        )


def model_label(model: object) -> str:
    if isinstance(model, str):
        return model
    return callable_label(model)


def build_model(model: object, spec: DataSpec | None) -> nn.Module:
    """Build a fresh model: a built-in sized for ``spec``, or whatever the user's factory returns."""
    if isinstance(model, str):
        builtin = get_builtin_model(model)
        assert spec is not None
        return builtin.build(spec)
    try:
        built = model()
    except TypeError as error:  # nn.Linear, say: a class that needs arguments, not a factory
        if _needs_arguments(model):
            raise ValueError(
                f"model is called with no arguments to build each arm's copy, and {model_label(model)} needs "
                f"some ({error}); pass a factory: model=lambda: {model_label(model)}(...)"
            ) from None
        raise
    if not isinstance(built, nn.Module):
        raise ValueError(
            f"the model factory {model_label(model)} returned {type(built).__name__}, not an nn.Module"
        )
    return built


def _needs_arguments(factory: object) -> bool:
    """Whether calling ``factory()`` fails for want of arguments (not for an error inside it)."""
    try:
        inspect.signature(factory).bind()
    except TypeError:
        return True
    except ValueError:  # a builtin whose signature Python cannot tell
        return False
    return False


def inspect_model(model: object) -> tuple[nn.Module, str]:
    """An instance to look at (which layers it has) without paying for its weights when possible."""
    check_model_arg(model)
    spec = builtin_spec(get_builtin_model(model).default_data) if isinstance(model, str) else None
    try:
        with torch.device("meta"):
            built = build_model(model, spec)
    except Exception:  # noqa: BLE001 - some user models touch real data while constructing
        built = _build_before_the_arms(model, spec)
    _refuse_lazy_parameters(built)
    return built, model_label(model)


def _build_before_the_arms(model: object, spec: DataSpec | None) -> nn.Module:
    """The model built for real, where the meta device would not do; a factory that fails here
    fails in every arm, so it is refused in one line (its traceback chained, for the API)."""
    try:
        return build_model(model, spec)
    except ValueError:  # workbench's own words (not an nn.Module, needs arguments), or the factory's
        raise
    except Exception as error:
        raise ValueError(
            f"the model factory {model_label(model)} fails as it builds the model, as it would in "
            f"every arm: {error_text(error)}"
        ) from error


def _refuse_lazy_parameters(built: nn.Module) -> None:
    """A lazy module (nn.LazyLinear) has no shapes until its first forward, and an optimizer
    cannot be made over its parameters before then: each arm would fail, so say it now."""
    lazy = sorted(
        {
            type(module).__name__
            for module in built.modules()
            # a lazy layer that already ran its first forward has shapes (unless it became its
            # plain class, as LazyLinear does)
            if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params()
        }
    )
    if lazy:
        raise ValueError(
            f"the model has lazy layers ({', '.join(lazy)}), whose parameters have no shape until a "
            "first forward: in the factory, run one forward of a dummy batch before returning the "
            "model (model(torch.zeros(1, features))), or give the layers their input sizes"
        )
