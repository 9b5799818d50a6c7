"""Shared tests, parametrized over every registered technique (see technique_settings.py)."""

import dataclasses
import importlib
import math

import pytest
import torch
from helpers import arm_result, block_spec, run_spec, train, unavailable_here
from hypothesis import given, settings
from hypothesis import strategies as st
from technique_settings import TECHNIQUE_SETTINGS

from workbench.models import inspect_model
from workbench.techniques import Context, all_techniques, get_technique, list_techniques, parse_techniques

NAMES = [t.name for t in all_techniques()]
CPU = torch.device("cpu")


def test_every_registered_technique_has_a_row():
    assert sorted(NAMES) == sorted(TECHNIQUE_SETTINGS), "add a row to tests/technique_settings.py"


def test_registry_is_in_explicit_composition_order():
    undeclared = [t.name for t in all_techniques() if "order" not in type(t).__dict__]
    assert not undeclared, f"declare an explicit order in the class: {undeclared}"
    orders = [t.order for t in all_techniques()]
    assert len(set(orders)) == len(orders), (
        "two techniques share an order: their composition would be ambiguous"
    )
    # compile comes after every change to the model, and cuda_graphs after compile: it captures
    # the whole step, compiled kernels included.
    assert [t.name for t in all_techniques()[-2:]] == ["compile", "cuda_graphs"]


def _cases():
    for name, row in TECHNIQUE_SETTINGS.items():
        for model in row["models"]:
            marks = [pytest.mark.slow] if row.get("slow") else []
            yield pytest.param(name, model, id=f"{name}-{model}", marks=marks)


@pytest.mark.parametrize("name,model", list(_cases()))
def test_technique_trains(name, model, tmp_path):
    """Every technique trains a few steps on every built-in model it applies to."""
    row = TECHNIQUE_SETTINGS[name]
    reason = unavailable_here(name, model, CPU)
    if reason:
        pytest.skip(f"{name} is unavailable here: {reason}")
    if row.get("world_size", 1) > 1:
        spec = block_spec(model, {name: row["config"]}, steps=3, warmup=1, data=row.get("data"))
        answer = run_spec(spec, row["world_size"], log_path=tmp_path / "unit.log")
        result = arm_result(answer)
    else:
        result = train(model, {name: row["config"]}, steps=3, warmup=1, data=row.get("data"))
    assert len(result["losses"]) == 4
    assert all(math.isfinite(loss) for loss in result["losses"])
    assert result["samples_per_s"] > 0
    assert result["notes"] and result["notes"][0], "apply() must say what it did"


@pytest.mark.parametrize("name", NAMES)
def test_method_card(name):
    """The module docstring is the method card: what, when it helps, when it hurts, settings."""
    module = importlib.import_module(type(get_technique(name)).__module__)
    card = module.__doc__ or ""
    for heading in ("What it does", "When it helps", "When it hurts", "Settings"):
        assert heading in card, f"{name}'s method card lacks '{heading}'"
    assert "seeds" not in card, "cite a source by its name and title; 'the seeds' means nothing to a user"
    assert get_technique(name).summary


@pytest.mark.parametrize("name", NAMES)
def test_availability_answers_with_a_reason(name):
    """Available on this CPU machine exactly where it should be, and otherwise a reason."""
    technique = get_technique(name)
    for model in TECHNIQUE_SETTINGS[name]["models"]:
        reason = unavailable_here(name, model, CPU)
        if "cuda" in technique.requires:
            assert reason == "needs a CUDA device; this run is on cpu", (name, model, reason)
        elif reason is not None:  # only a missing optional package may stop it here, and says how to fix it
            assert "pip install" in reason, (name, model, reason)
    if "conv" in technique.requires:  # a model without convolutions: nothing to convert
        instance, label = inspect_model("mlp")
        reason = technique.unavailable_reason(
            Context(device=CPU, model=instance, model_name=label), technique.Config()
        )
        assert isinstance(reason, str) and "Conv2d" in reason


@pytest.mark.parametrize("name", NAMES)
def test_configure_accepts_true_dict_and_config(name):
    technique = get_technique(name)
    default = technique.configure(True)
    assert isinstance(default, technique.Config)
    assert technique.configure(dataclasses.asdict(default)) == default
    assert technique.configure(default) is default


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_names_the_valid_ones(name):
    technique = get_technique(name)
    with pytest.raises(ValueError, match=f"{name}: unknown option 'no_such_option'"):
        technique.configure({"no_such_option": 1})


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 100),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["bfloat16", "float16", "fp8", "default", "max-autotune", "blocks.*", ""]),
    st.lists(st.integers(), max_size=2),
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_config_validation_fuzz(name, data):
    """Any value either yields a valid config or a ValueError that names the technique."""
    technique = get_technique(name)
    fields = [f.name for f in dataclasses.fields(technique.Config)]
    chosen = data.draw(st.dictionaries(st.sampled_from(fields), _ANY_VALUE) if fields else st.just({}))
    try:
        config = technique.configure(chosen)
    except ValueError as error:
        assert str(error).startswith(name), str(error)
        return
    assert isinstance(config, technique.Config)
    technique.describe(config)  # a valid config can always be shown


def test_bad_values_give_clear_errors():
    cases = {
        "amp": ({"dtype": "fp8"}, "amp: dtype must be one of 'bfloat16' | 'float16'; got 'fp8'"),
        "grad_accum": ({"steps": 0}, "grad_accum: steps must be >= 1; got 0"),
        "compile": ({"mode": "fast"}, "compile: mode must be one of"),
        "dataloader": ({"num_workers": -1}, "dataloader: num_workers must be >= 0"),
        "checkpointing": ({"select": 3}, "checkpointing: select must be None"),
    }
    for name, (options, message) in cases.items():
        with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("(", r"\(")):
            get_technique(name).configure(options)
    with pytest.raises(ValueError, match="prefetch_factor needs num_workers > 0"):
        get_technique("dataloader").configure({"num_workers": 0, "prefetch_factor": 4})
    with pytest.raises(ValueError, match="steps must be an integer"):
        get_technique("grad_accum").configure({"steps": True})
    with pytest.raises(
        ValueError, match="unknown technique 'ampp'.*valid techniques: .*amp.*did you mean 'amp'"
    ):
        parse_techniques({"ampp": True})


def test_a_list_of_names_means_their_defaults():
    by_list = parse_techniques(["tf32", "amp"])
    assert [(t.name, c) for t, c in by_list] == [
        (t.name, c) for t, c in parse_techniques({"amp": True, "tf32": True})
    ]
    with pytest.raises(ValueError, match="unknown technique 'ampp'"):
        parse_techniques(["ampp"])


def test_list_techniques_on_cpu():
    table = list_techniques(device="cpu")
    assert list(table.columns[:4]) == ["name", "available", "reason", "summary"]
    tf32 = table.set_index("name").loc["tf32"]
    assert not tf32.available and "CUDA" in tf32.reason
    per_model = list_techniques(device="cpu", model="gpt-mini").set_index("name")
    assert not per_model.loc["channels_last"].available
    assert "no Conv2d" in per_model.loc["channels_last"].reason
