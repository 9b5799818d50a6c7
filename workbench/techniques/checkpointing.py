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

Unavailable
    When the model has no repeated blocks for the default to find. A ``select`` that matches
    nothing is refused before anything runs, with the model's submodules (and the nearest name).

Settings
    ``select``: which submodules to checkpoint.
    - None (default): every repeated block of the model: the children of every ModuleList or
      Sequential that holds 2+ blocks of one type (a block: a module with weights and
      submodules of its own): transformer layers, and the residual blocks of every stage of
      a ResNet, not just the first. Where such lists nest (a list of stages, each a list of
      blocks), the innermost lists' blocks are checkpointed and the outer ones are not;
    - a glob over module names from ``model.named_modules()``, e.g. ``"layers.*"`` (the
      outermost matches are wrapped);
    - ``"type:Name"`` (or ``"type:A,B"``): every module whose class, or a class it derives
      from, is named so, e.g. ``"type:GPT2Block"``; from Python, a class or a tuple of classes
      does the same (``isinstance``);
    - from Python, a callable ``(name, module) -> bool``.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch.utils.checkpoint
from torch import nn

from workbench.techniques.base import Context, Technique

Selector = str | type | tuple | Callable[[str, nn.Module], bool] | None
TYPE_PREFIX = "type:"


@dataclass(frozen=True)
class CheckpointingConfig:
    select: Selector = None

    def __post_init__(self) -> None:
        if self.select is None or callable(self.select) and not isinstance(self.select, type):
            return
        if _module_classes(self.select) is not None:
            return
        if not isinstance(self.select, str) or not self.select.strip() or self.select.strip() == TYPE_PREFIX:
            raise ValueError(
                "checkpointing: select must be None (every repeated block), a glob over module names "
                "such as 'blocks.*', 'type:ClassName', a module class, or a callable (name, module) -> bool; "
                f"got {self.select!r}"
            )


def _module_classes(select: Selector) -> tuple | None:
    """The classes a type selector names (a class, a tuple of them); None for other selectors."""
    if isinstance(select, type) and issubclass(select, nn.Module):
        return (select,)
    if (
        isinstance(select, tuple)
        and select
        and all(isinstance(c, type) and issubclass(c, nn.Module) for c in select)
    ):
        return select
    return None


def _is_block(module: nn.Module) -> bool:
    """A unit worth checkpointing: it has weights and submodules of its own (not a lone Linear)."""
    return any(True for _ in module.children()) and any(True for _ in module.parameters())


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``outer`` ("" is the model itself)."""
    return name != outer and (outer == "" or name.startswith(f"{outer}."))


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of every repeated block: the children of each ModuleList/Sequential that holds 2+
    blocks of one type. Where such lists nest (a list of stages, each a list of blocks), the
    innermost lists give the blocks, so that every stage's blocks are checkpointed one by one."""
    lists = []
    for prefix, container in model.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            children = list(container.named_children())
            kinds = {type(child) for _, child in children}
            if len(children) >= 2 and len(kinds) == 1 and all(_is_block(child) for _, child in children):
                lists.append((prefix, children))
    innermost = [
        (prefix, children) for prefix, children in lists if not any(_inside(o, prefix) for o, _ in lists)
    ]
    return [f"{prefix}.{name}" if prefix else name for prefix, children in innermost for name, _ in children]


def select_modules(model: nn.Module, select: Selector) -> list[str]:
    if select is None:
        return repeated_blocks(model)
    classes = _module_classes(select)
    if isinstance(select, str) and select.startswith(TYPE_PREFIX):
        names = {name.strip() for name in select[len(TYPE_PREFIX) :].split(",") if name.strip()}
        # a subclass too, as a class given from Python (isinstance): a block that cupy_fusion
        # swapped to its fused subclass is still the block the name selects
        matches_select: Callable[[str, nn.Module], bool] = lambda _, m: any(  # noqa: E731
            base.__name__ in names for base in type(m).__mro__
        )
    elif classes is not None:
        matches_select = lambda _, m: isinstance(m, classes)  # noqa: E731
    elif callable(select):
        matches_select = select
    else:
        matches_select = lambda name, _: fnmatch.fnmatchcase(name, select)  # noqa: E731
    matches = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(chosen + ".") for chosen in matches):
            continue  # the root, or inside a module that is already checkpointed as a whole
        if matches_select(name, module):
            matches.append(name)
    return matches


def _some_submodules(model: nn.Module, shown: int = 6) -> str:
    """What a select could have named: the model's first submodules, two levels deep at most,
    with their classes (a glob matches the dotted names; type:ClassName the classes)."""
    found = [(name, type(m).__name__) for name, m in model.named_modules() if name and name.count(".") <= 1]
    listed = ", ".join(f"{name} ({kind})" for name, kind in found[:shown])
    more = f", and {len(found) - shown} more" if len(found) > shown else ""
    return f"its submodules include {listed}{more}" if found else "it has no submodules"


def _closest_select(model: nn.Module, select: Selector) -> str:
    """The words " (did you mean 'blocks'?)" for a misspelt name or class in a string select; else ""."""
    if not isinstance(select, str):
        return ""
    if select.startswith(TYPE_PREFIX):
        classes = sorted({type(module).__name__ for module in model.modules()})
        wanted = [name.strip() for name in select[len(TYPE_PREFIX) :].split(",") if name.strip()]
        close = [found for name in wanted for found in difflib.get_close_matches(name, classes, n=1)]
        suggestion = TYPE_PREFIX + ",".join(close)
        return (
            f" (did you mean {suggestion!r}?)" if len(close) == len(wanted) and suggestion != select else ""
        )
    names = [name for name, _ in model.named_modules() if name]
    # a glob's fixed part against the names: 'blokcs.*' is close to 'blocks'
    stem = select.split("*")[0].split("?")[0].split("[")[0].rstrip(".")
    close = difflib.get_close_matches(stem, names, n=1) if stem else []
    if not close:
        return ""
    suggestion = select.replace(stem, close[0], 1)
    if suggestion == select or not select_modules(model, suggestion):  # only a select that would match
        return ""
    return f" (did you mean {suggestion!r}?)"


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` recompute its activations in backward instead of storing them.

    Its ``forward`` becomes an instance attribute (the class stays untouched): a partial that
    holds the module itself, not a closure over its bound forward. A deep copy (an EMA or eval
    copy) then holds its copy and computes with the copy's parameters, and the model pickles.
    A forward already set on the instance (a hook library's wrapper) is kept and checkpointed.
    """
    own = module.__dict__.get("forward")
    module.forward = functools.partial(_recompute_in_backward, module, own)


def _recompute_in_backward(module: nn.Module, own_forward, *args, **kwargs):
    """``module``'s forward (its instance's own, else its class's) under non-reentrant checkpointing."""
    forward = own_forward if own_forward is not None else type(module).forward.__get__(module)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


class Checkpointing(Technique):
    name = "checkpointing"
    summary = "recompute activations of the repeated blocks in backward: less memory, more compute"
    order = 20
    group = "memory"
    Config = CheckpointingConfig

    def validate(self, ctx: Context, config: CheckpointingConfig) -> None:
        # A select of the user's that matches nothing is a mistake (a typo, another model's
        # names): refused before anything runs, not an arm shown as unavailable beside the rest.
        if ctx.model is None or config.select is None or select_modules(ctx.model, config.select):
            return
        raise ValueError(
            f"checkpointing: select={config.select!r} matches no submodule of {ctx.model_name or 'the model'}"
            f"{_closest_select(ctx.model, config.select)}; {_some_submodules(ctx.model)}"
        )

    def check(self, ctx: Context, config: CheckpointingConfig) -> str | None:
        if ctx.model is None or config.select is not None or select_modules(ctx.model, None):
            return None
        return (
            f"found no repeated blocks in {ctx.model_name or 'the model'} (no ModuleList/Sequential of "
            "2+ same-type blocks); pass checkpointing={'select': 'glob'} or {'select': 'type:ClassName'}"
        )

    def apply(self, setup, config: CheckpointingConfig) -> str:
        names = select_modules(setup.model, config.select)
        if not names:  # check() saw the model as built; a technique before this one changed it
            raise ValueError(
                f"checkpointing: select={config.select!r} matches no submodule of the model as the "
                f"techniques before it left it; {_some_submodules(setup.model)}"
            )
        modules = dict(setup.model.named_modules())
        for name in names:
            checkpoint_module(modules[name])
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        return f"checkpointed {shown}"


TECHNIQUE = Checkpointing()
