"""checkpointing: activation (gradient) checkpointing, trading compute for memory.

What it does
    The selected submodules keep only their inputs during the forward pass and recompute
    their internal activations during the backward pass (``torch.utils.checkpoint``,
    non-reentrant). Gradients are identical to training without it; RNG state is
    preserved, so dropout masks match on recomputation.

When it helps
    Memory: activations usually dominate training memory, and checkpointing the repeated
    blocks of a network cuts them to roughly one block's worth plus the block inputs. The
    freed memory buys a larger batch or a larger model. The ByteTrending overview
    "Accelerate Model Training" (2025) cites 50-80% activation-memory savings as typical.

When it hurts
    Speed: each checkpointed block runs its forward twice, so expect roughly a third more
    compute per step (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016).
    BatchNorm layers inside a checkpointed block update their running statistics on both
    passes (gradients are unaffected).

Settings
    ``select``: which submodules to checkpoint.
    - None (default): the model's repeated blocks: ``model.blocks`` if it exists, otherwise
      the ModuleList/Sequential holding the most same-type children;
    - a glob over module names from ``model.named_modules()``, e.g. ``"layers.*"`` (the
      outermost matches are wrapped);
    - from Python, a callable ``(name, module) -> bool``.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch.utils.checkpoint
from torch import nn

from workbench.techniques.base import Context, Technique

Selector = str | Callable[[str, nn.Module], bool] | None


@dataclass(frozen=True)
class CheckpointingConfig:
    select: Selector = None

    def __post_init__(self) -> None:
        if self.select is None or callable(self.select):
            return
        if not isinstance(self.select, str) or not self.select.strip():
            raise ValueError(
                "checkpointing: select must be None (the repeated blocks), a glob over module names "
                f"such as 'blocks.*', or a callable (name, module) -> bool; got {self.select!r}"
            )


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the model's repeated blocks: ``model.blocks``, else the largest same-type container."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0:
        return [f"blocks.{name}" for name, _ in blocks.named_children()]
    best: list[str] = []
    for prefix, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        kinds = {type(child) for _, child in children}
        has_weights = all(any(True for _ in child.parameters()) for _, child in children)
        if len(children) >= 2 and len(kinds) == 1 and has_weights and len(children) > len(best):
            best = [f"{prefix}.{name}" if prefix else name for name, _ in children]
    return best


def select_modules(model: nn.Module, select: Selector) -> list[str]:
    if select is None:
        return repeated_blocks(model)
    matches = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(chosen + ".") for chosen in matches):
            continue  # the root, or inside a module that is already checkpointed as a whole
        hit = select(name, module) if callable(select) else fnmatch.fnmatchcase(name, select)
        if hit:
            matches.append(name)
    return matches


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` recompute its activations in backward instead of storing them."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward  # an instance attribute: the class stays untouched


class Checkpointing(Technique):
    name = "checkpointing"
    summary = "recompute activations of the repeated blocks in backward: less memory, more compute"
    order = 20
    Config = CheckpointingConfig

    def check(self, ctx: Context, config: CheckpointingConfig) -> str | None:
        if ctx.model is None or select_modules(ctx.model, config.select):
            return None
        if config.select is None:
            return (
                f"found no repeated blocks in {ctx.model_name or 'the model'} (no model.blocks and no "
                "ModuleList/Sequential of 2+ same-type submodules); pass checkpointing={'select': 'glob'}"
            )
        return f"select={config.select!r} matches no submodule of {ctx.model_name or 'the model'}"

    def apply(self, setup, config: CheckpointingConfig) -> str:
        names = select_modules(setup.model, config.select)
        modules = dict(setup.model.named_modules())
        for name in names:
            checkpoint_module(modules[name])
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        return f"checkpointed {shown}"


TECHNIQUE = Checkpointing()
