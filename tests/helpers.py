"""Small builders shared by the tests (importable: tests/ is on sys.path via conftest)."""

from workbench.data import resolve_data
from workbench.techniques import parse_techniques
from workbench.worker import UnitSpec, run_unit


def unit_spec(model="mlp", techniques=None, steps=3, warmup=1, batch_size=16, data=None, **overrides):
    spec = UnitSpec(
        model=model,
        data=resolve_data(data, model, 0),
        loss_fn=overrides.pop("loss_fn", None),
        techniques=parse_techniques(techniques or {}),
        steps=steps,
        warmup=warmup,
        batch_size=batch_size,
        device="cpu",
        seed=0,
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


def train(model="mlp", techniques=None, **kwargs) -> dict:
    """Run one unit in this process (fast; isolation is tested separately)."""
    return run_unit(unit_spec(model, techniques, **kwargs))
