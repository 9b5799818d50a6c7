"""Small builders shared by the tests (importable: tests/ is on sys.path via conftest)."""

from workbench.block import ArmSpec
from workbench.data import resolve_data
from workbench.techniques import parse_techniques
from workbench.worker import BlockSpec, run_block

ARM = "arm"  # the name of the one arm in the blocks these helpers build


def block_spec(
    model="mlp", techniques=None, steps=3, warmup=1, batch_size=16, data=None, arms=None, **overrides
) -> BlockSpec:
    """A BlockSpec for one arm (``techniques``), or for several: ``arms={"name": techniques, ...}``."""
    arms = arms if arms is not None else {ARM: techniques or {}}
    spec = BlockSpec(
        model=model,
        data=resolve_data(data, model, 0),
        loss_fn=overrides.pop("loss_fn", None),
        arms=[ArmSpec(name, parse_techniques(chosen)) for name, chosen in arms.items()],
        steps=steps,
        warmup=warmup,
        rounds=overrides.pop("rounds", 1),
        batch_size=batch_size,
        device="cpu",
        seed=0,
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


def arm_result(answer: dict, name: str = ARM) -> dict:
    """One arm's measurements from a block's answer; a failure fails the test with its reason."""
    assert answer.get("type", "result") == "result", answer
    if name not in answer["arms"]:
        failure = answer["failures"].get(name, {})
        raise AssertionError(f"{name} failed: {failure.get('reason')}\n{failure.get('traceback', '')}")
    return answer["arms"][name]


def train(model="mlp", techniques=None, **kwargs) -> dict:
    """Run one arm in this process (fast; isolation is tested separately). Its measurements."""
    return arm_result(run_block(block_spec(model, techniques, **kwargs)))
