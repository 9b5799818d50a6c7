"""The technique registry.

Every module in this package that defines a module-level ``TECHNIQUE`` is registered
automatically, so adding a technique means adding one file (plus its row in
tests/technique_settings.py). The registry is kept sorted by each technique's ``order``:
that is the order in which techniques are applied when several are combined.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import pkgutil
from collections.abc import Mapping
from typing import Any

from workbench.config import RunConfig, optimizer_label, unknown_name_error
from workbench.data import DataSource, inputs_and_targets, not_leading_with_samples
from workbench.devices import resolve_device
from workbench.models import inspect_model
from workbench.techniques.base import Context, Technique

_REGISTRY: dict[str, Technique] = {}


def _discover() -> None:
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        technique = getattr(module, "TECHNIQUE", None)
        if technique is not None:
            register_technique(technique)


def register_technique(technique: Technique) -> Technique:
    """Add a technique (a built-in one, or your own Technique subclass instance)."""
    if not isinstance(technique, Technique):
        raise TypeError(f"register_technique needs a Technique instance; got {technique!r}")
    _REGISTRY[technique.name] = technique
    ordered = sorted(_REGISTRY.values(), key=lambda t: (t.order, t.name))
    _REGISTRY.clear()
    _REGISTRY.update((t.name, t) for t in ordered)
    return technique


def unregister_technique(name: str) -> None:
    _REGISTRY.pop(name, None)


def all_techniques() -> list[Technique]:
    """Every registered technique, in composition order."""
    return list(_REGISTRY.values())


def get_technique(name: str) -> Technique:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise unknown_name_error("technique", name, _REGISTRY) from None


def parse_techniques(
    techniques: Mapping[str, Any] | list[str] | tuple[str, ...] | None,
) -> list[tuple[Technique, Any]]:
    """``{"amp": {"dtype": "bfloat16"}, "compile": True}`` -> [(technique, config)], in order.

    ``None`` selects every registered technique with its default settings, and so does a
    list of names for those it names (``["amp", "tf32"]``, as the CLI's ``-t`` gives). A value of
    False or None switches one off. A list of values for a setting sweeps it: the technique
    then appears once per value (once per combination when several settings are lists).
    """
    if techniques is None:
        return [(t, t.Config()) for t in all_techniques()]
    if isinstance(techniques, (list, tuple)) and all(isinstance(name, str) for name in techniques):
        techniques = dict.fromkeys(techniques, True)
    if not isinstance(techniques, Mapping):
        raise ValueError(
            "techniques must be a dict like {'amp': {'dtype': 'bfloat16'}, 'compile': True} "
            f"or a list of names like ['amp', 'tf32']; got {techniques!r}"
        )
    chosen = []
    for name, value in techniques.items():
        technique = get_technique(name)
        if value is False or value is None:
            continue
        combinations = _expand_sweep(name, value)
        if len(combinations) > 1:
            combinations = [technique.sweep_member(one) for one in combinations]
        configs = [technique.configure(one) for one in combinations]
        chosen += [(technique, config) for config in _distinct(technique, configs)]
    return sorted(chosen, key=lambda pair: list(_REGISTRY).index(pair[0].name))


def _expand_sweep(name: str, value: Any) -> list[Any]:
    """``{"num_workers": [0, 2], "pin_memory": True}`` -> one settings dict per listed value."""
    if not isinstance(value, Mapping):
        return [value]
    swept = {key: item for key, item in value.items() if isinstance(item, (list, tuple))}
    if not swept:
        return [value]
    for key, values in swept.items():
        if not values:
            raise ValueError(f"{name}: the sweep over {key} is empty; give at least one value")
        if len(set(map(repr, values))) < len(values):
            raise ValueError(f"{name}: the sweep over {key} repeats a value: {list(values)!r}")
    keys = list(swept)
    return [{**value, **dict(zip(keys, combo, strict=True))} for combo in itertools.product(*swept.values())]


def _distinct(technique: Technique, configs: list[Any]) -> list[Any]:
    """The swept configs that differ in a setting that matters (the first of each kind kept)."""
    seen, kept = set(), []
    for config in configs:
        key = tuple((name, repr(getattr(config, name))) for name in technique.settings_that_matter(config))
        if key not in seen:
            seen.add(key)
            kept.append(config)
    return kept


def settings_of(config: Any) -> dict[str, Any]:
    """A config's settings as a dict that ``techniques=`` accepts again and JSON can hold; a value
    JSON cannot (a checkpointing predicate) is shown by its repr, which does not round-trip."""

    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)) and all(plain(v) == v for v in value):
            return list(value)
        return repr(value)

    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def conflict_reason(techniques: list[tuple[Technique, Any]]) -> str | None:
    """Why these techniques, with these settings, cannot all run in one arm (naming both), or None."""
    for index, (first, first_config) in enumerate(techniques):
        for second, second_config in techniques[index + 1 :]:
            reason = first.conflict_with(first_config, second, second_config) or second.conflict_with(
                second_config, first, first_config
            )
            if reason:
                return f"{first.name} and {second.name} cannot be combined: {reason}"
    return None


def technique_context(
    run: RunConfig,
    model: Any = None,
    source: DataSource | None = None,
    *,
    inspected: tuple[Any, str] | None = None,
    first_batch: Any = None,
) -> Context:
    """What availability checks see of a run: the one place a Context is made.

    ``ablate``/``plan`` pass everything; the panel passes what its controls hold; ``workbench
    list`` passes only a device (and a model, if named), so model- and data-specific
    conditions go unchecked. ``inspected``: ``inspect_model(model)``, when the caller has it;
    ``first_batch``: the data's, when the caller read it (ready-made batches: their layout).
    """
    if inspected is None:
        inspected = inspect_model(model) if model is not None else (None, "")
    instance, model_name = inspected
    return Context(
        device=resolve_device(run.device),
        model=instance,
        model_name=model_name,
        data_is_dataset=source.is_dataset if source is not None else True,
        whole_stream_per_worker=source is not None and source.whole_stream_per_worker,
        batch_size=run.batch_size,
        data_label=source.label if source is not None else "",
        image_size=source.images.size if source is not None and source.images is not None else None,
        image_count=len(source.images.files) if source is not None and source.images is not None else None,
        world_size=run.world_size,
        warmup=run.warmup,
        loader_workers=source.loader_workers if source is not None else 0,
        not_leading_with_samples=[]
        if first_batch is None
        else not_leading_with_samples(*inputs_and_targets(first_batch)),
        optimizer=run.optimizer
        if isinstance(run.optimizer, str)
        else f"your own {optimizer_label(run.optimizer)}",
    )


def list_techniques(device: str = "auto", model: Any = None):
    """A DataFrame of every technique: name, available, reason, summary (plus order, requires).

    Availability is judged for ``device`` and, when given, ``model`` (a built-in name or a
    factory); without a model, model-specific conditions are not checked.
    """
    import pandas as pd

    ctx = technique_context(RunConfig(device=device), model)
    rows = []
    for technique in all_techniques():
        reason = technique.unavailable_reason(ctx, technique.Config())
        rows.append(
            {
                "name": technique.name,
                "available": reason is None,
                "reason": reason or "",
                "summary": technique.summary,
                "order": technique.order,
                "requires": ", ".join(technique.requires),
            }
        )
    return pd.DataFrame(rows)


def describe(name: str) -> str:
    """The method card (module docstring) of a technique."""
    technique = get_technique(name)
    module = importlib.import_module(type(technique).__module__)
    return (module.__doc__ or technique.summary).strip()


__all__ = [
    "Context",
    "Technique",
    "all_techniques",
    "conflict_reason",
    "describe",
    "get_technique",
    "list_techniques",
    "parse_techniques",
    "settings_of",
    "register_technique",
    "unregister_technique",
]

_discover()
