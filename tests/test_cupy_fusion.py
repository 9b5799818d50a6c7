"""cupy_fusion on any machine: settings, the module patterns, and clear refusals off the GPU.

The kernels' numerics are tested on a GPU (tests/test_fused_ops_gpu.py); their compilation
everywhere (tests/test_kernels_compile.py).
"""

import pytest
import torch
from torch import nn

from workbench.fused_ops import (
    FusedAdamW,
    FusedLayerNorm,
    FusedLinearGELU,
    bias_gelu,
    describe_replacements,
    fuse_model,
    layer_norm,
)
from workbench.models import inspect_model
from workbench.techniques import Context, conflict_reason, get_technique

CPU = torch.device("cpu")
FUSION = get_technique("cupy_fusion")


def test_unavailable_on_cpu_with_the_reason():
    model, label = inspect_model("gpt-mini")
    reason = FUSION.unavailable_reason(Context(device=CPU, model=model, model_name=label), FUSION.Config())
    assert reason == "needs a CUDA device; this run is on cpu"


def test_settings_are_checked():
    with pytest.raises(ValueError, match="keep at least one of bias_gelu, layer_norm"):
        FUSION.configure(
            {"bias_gelu": False, "layer_norm": False, "residual_layer_norm": False, "optimizer": False}
        )
    with pytest.raises(ValueError, match="cupy_fusion: optimizer must be True or False"):
        FUSION.configure({"optimizer": "yes"})
    with pytest.raises(ValueError, match="unknown option 'dropout'"):
        FUSION.configure({"dropout": 0.1})


def test_not_combined_with_compile():
    assert "cannot trace CuPy" in conflict_reason(
        [(FUSION, FUSION.Config()), (get_technique("compile"), get_technique("compile").Config())]
    )


def test_gpt_mini_swaps_are_reported():
    model, _ = inspect_model("gpt-mini")
    replaced = fuse_model(model)
    kinds = [swap.before for swap in replaced]
    assert kinds.count("residual add + ln2") == 4
    assert kinds.count("Linear + GELU") == 4
    assert kinds.count("LayerNorm") == 5  # ln1 of each block and ln_f; each ln2 is inside the fused add
    assert isinstance(model.blocks[0].mlp[0], FusedLinearGELU) and isinstance(
        model.blocks[0].mlp[1], nn.Identity
    )
    assert isinstance(model.ln_f, FusedLayerNorm)
    assert "4 Linear + GELU (blocks.0.mlp.0, blocks.1.mlp.0, ...)" in describe_replacements(replaced)


def test_swaps_share_parameters_and_state_dict_keys():
    model, _ = inspect_model("gpt-mini")
    before = {name: param for name, param in model.named_parameters()}
    keys = set(model.state_dict())
    fuse_model(model)
    after = dict(model.named_parameters())
    assert set(model.state_dict()) == keys
    assert all(after[name] is param for name, param in before.items())


def test_dry_run_changes_nothing():
    model, _ = inspect_model("mlp")
    text = repr(model)
    assert len(fuse_model(model, dry_run=True)) == 8
    assert repr(model) == text


def test_user_model_patterns():
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.GELU(),  # fused with the Linear before it
        nn.Linear(16, 16, bias=False),
        nn.GELU(),  # no bias to fuse: left alone
        nn.Linear(16, 16),
        nn.GELU(approximate="tanh"),  # a different function than the kernel's erf GELU: left alone
        nn.LayerNorm(16),  # fused
        nn.LayerNorm((4, 4)),  # over two dimensions: left alone
    )
    replaced = fuse_model(model)
    assert [(swap.name, swap.before) for swap in replaced] == [("0", "Linear + GELU"), ("6", "LayerNorm")]
    assert type(model[2]) is nn.Linear and type(model[7]) is nn.LayerNorm


def test_patterns_can_be_switched_off():
    model, _ = inspect_model("gpt-mini")
    replaced = fuse_model(model, bias_gelu=False, residual_layer_norm=False)
    assert {swap.before for swap in replaced} == {"LayerNorm"} and len(replaced) == 9


def test_resnet_has_nothing_to_fuse_but_the_optimizer():
    model, label = inspect_model("resnet-mini")
    assert describe_replacements(fuse_model(model, dry_run=True)) == "no module matched a fused pattern"
    ctx = Context(device=torch.device("cuda"), model=model, model_name=label)
    if FUSION.unavailable_reason(ctx, FUSION.Config()) is None:  # only judged where CUDA and CuPy exist
        reason = FUSION.unavailable_reason(ctx, FUSION.configure({"optimizer": False}))
        assert "nothing the enabled patterns match" in reason


def test_fused_ops_refuse_cpu_tensors_clearly():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="run on CUDA tensors only; these are on cpu"):
        bias_gelu(x, torch.zeros(8))
    with pytest.raises(RuntimeError, match="run on CUDA tensors only"):
        layer_norm(x, torch.ones(8), torch.zeros(8))
    weight = nn.Parameter(torch.randn(3))
    weight.grad = torch.randn(3)
    with pytest.raises(RuntimeError, match="run on CUDA tensors only"):
        FusedAdamW([weight]).step()


def test_a_fused_model_copies_and_pickles_with_its_own_parameters():
    """The fused transformer block's forward was a closure stored on the instance: a deep copy (an
    EMA or eval copy) computed with the original block's parameters, and the model did not pickle."""
    import copy
    import pickle

    model, _ = inspect_model("gpt-mini")
    fuse_model(model)
    copied = copy.deepcopy(model)
    block = copied.blocks[0]
    assert block.forward.__self__ is block and block.ln2.weight is not model.blocks[0].ln2.weight
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored.blocks[0]) is type(model.blocks[0]) and "forward" not in vars(restored.blocks[0])
    # still fused: fusing again finds no block left to fuse
    assert all(swap.before != "residual add + ln2" for swap in fuse_model(restored, dry_run=True))


def test_checkpointing_by_class_name_still_finds_the_fused_blocks():
    """cupy_fusion (order 16) gives each transformer block a fused subclass before checkpointing
    (20) selects: "type:TransformerBlock" then matched nothing, and the arm ran unchecked, its
    note saying "checkpointed " and no module."""
    from workbench.loop import make_optimizer

    setup = _fusion_setup("gpt-mini", make_optimizer("adamw", 1e-3))
    FUSION.apply(setup, FUSION.Config())
    checkpointing = get_technique("checkpointing")
    note = checkpointing.apply(setup, checkpointing.configure({"select": "type:TransformerBlock"}))
    assert note.startswith("checkpointed blocks.0, blocks.1, blocks.2, ... (4 in all)"), note
    with pytest.raises(
        ValueError, match="matches no submodule of the model as the techniques before it left it"
    ):
        checkpointing.apply(setup, checkpointing.configure({"select": "decoder.*"}))


def test_fused_adamw_takes_gradients_whose_size_one_dimensions_have_other_strides():
    """Autograd gives a (1, 8) parameter's gradient strides (1, 1) where the parameter has (8, 1):
    the same memory order, refused as another memory layout."""
    from workbench.fused_ops import _same_layout

    weight = nn.Parameter(torch.randn(1, 8))
    (torch.ones(4, 1) @ weight).sum().backward()
    assert _same_layout(weight.grad.as_strided((1, 8), (1, 1)), weight)
    assert not _same_layout(torch.randn(8, 3).t(), torch.randn(3, 8))  # a transpose is another order


def test_tensors_reach_the_kernels_by_address_without_cupy_arrays():
    """Through DLPack, CuPy 13 refused bfloat16 (and CuPy 14 needs ml_dtypes for it)."""
    from workbench import raw_kernels

    tensor = torch.ones(4, dtype=torch.bfloat16)
    assert raw_kernels.view(tensor) == tensor.data_ptr() and raw_kernels.view(None) == 0
    with pytest.raises(ValueError, match="contiguous"):
        raw_kernels.view(torch.ones(4, 4).t())


def _fusion_setup(model_name: str, make_optimizer):
    from workbench.loop import TrainSetup

    model, _ = inspect_model(model_name)
    return TrainSetup(
        model=model, device=CPU, loss_fn=lambda out, y: out.sum(), make_optimizer=make_optimizer
    )


def test_an_arm_that_would_fuse_nothing_is_refused_not_measured(monkeypatch):
    """resnet-mini under SGD: no module matches and the optimizer is not AdamW. The arm measured
    the unfused model, with a verdict, and only a note said nothing was fused."""
    import workbench.techniques.cupy_fusion as cupy_fusion
    from workbench.loop import make_optimizer

    with pytest.raises(
        ValueError, match="cupy_fusion fused nothing in this model.*optimizer SGD left unfused"
    ):
        FUSION.apply(_fusion_setup("resnet-mini", make_optimizer("sgd", 0.1)), FUSION.Config())
    # Planned: where CUDA and CuPy are ready, the run's optimizer decides it before anything runs.
    monkeypatch.setattr(cupy_fusion, "cupy_unavailable_reason", lambda device: None)
    model, label = inspect_model("resnet-mini")
    ctx = Context(device=torch.device("cuda"), model=model, model_name=label, optimizer="sgd")
    assert "the run's optimizer is sgd" in FUSION.check(ctx, FUSION.Config())
    assert (
        FUSION.check(Context(device=torch.device("cuda"), model=model, model_name=label), FUSION.Config())
        is None
    )
    # The user's own factory may build AdamW: only building one tells (apply's probe, above).
    own = Context(
        device=torch.device("cuda"), model=model, model_name=label, optimizer="your own build_adamw"
    )
    assert FUSION.check(own, FUSION.Config()) is None


def test_an_adamw_that_cannot_be_fused_is_left_unfused_with_the_reason():
    """amsgrad=True: it failed at the first optimizer step; a namesake class was taken for torch's AdamW."""

    class AdamW(torch.optim.SGD):  # a namesake (as in some libraries), not torch.optim.AdamW
        pass

    amsgrad = _fusion_setup("gpt-mini", lambda params: torch.optim.AdamW(params, amsgrad=True))
    assert "AdamW left unfused: FusedAdamW does not implement AdamW's amsgrad=True" in FUSION.apply(
        amsgrad, FUSION.Config()
    )
    assert type(amsgrad.make_optimizer([nn.Parameter(torch.zeros(1))])) is torch.optim.AdamW
    namesake = _fusion_setup("gpt-mini", lambda params: AdamW(params, lr=0.1))
    assert "optimizer AdamW left unfused" in FUSION.apply(namesake, FUSION.Config())
    plain = _fusion_setup("gpt-mini", lambda params: torch.optim.AdamW(params))
    assert "AdamW steps in one launch" in FUSION.apply(plain, FUSION.Config())
    assert type(plain.make_optimizer([nn.Parameter(torch.zeros(1))])) is FusedAdamW


def test_fused_adamw_settings():
    weight = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="does not implement AdamW's amsgrad=True"):
        FusedAdamW.from_adamw(torch.optim.AdamW([weight], amsgrad=True))
    with pytest.raises(ValueError, match="betas must be two values"):
        FusedAdamW([weight], betas=(0.9, 1.5))
    fused = FusedAdamW.from_adamw(torch.optim.AdamW([weight], lr=3e-4, weight_decay=0.05, eps=1e-6))
    group = fused.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["eps"], group["betas"]) == (
        3e-4,
        0.05,
        1e-6,
        (0.9, 0.999),
    )


def test_the_kernel_benchmark_speedup_pairs_the_interleaved_rounds():
    # Pure arithmetic, so it runs here although the benchmark itself needs a GPU (the first GPU
    # run found it calling a stats function that no longer existed).
    from workbench.kernel_bench import _speedup

    eager = [2.0e-3, 2.2e-3, 1.9e-3, 2.1e-3, 2.0e-3]  # seconds per call, one per round
    fused = [1.0e-3, 1.1e-3, 0.95e-3, 1.05e-3, 1.0e-3]  # the same rounds, each exactly 2x faster
    point, low, high = _speedup(eager, fused)
    assert point == pytest.approx(2.0, rel=1e-6)
    assert low <= point <= high
    point, low, high = _speedup(eager, [2 * s for s in eager[::-1]])
    assert point < 1 and low < high
