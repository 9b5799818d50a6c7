"""Every setting of a technique reaches what it configures, checked on the CPU.

tests/test_technique_effects.py checks that each technique's ``apply`` changes the training
step, measured: it catches an ``apply`` that does nothing. This file catches one that ignores
a setting: a mutation audit (each setting's effect removed, one at a time) found 26 such
mutants that every CPU test let pass, and two techniques, cupy_fusion and prefetch, whose
whole ``apply`` could do nothing unseen on a machine without a GPU (their effect tests need
one). Each test here applies a technique to a small setup and looks at what ``apply`` built.
Where ``apply`` only reads the device's type, the setup names a CUDA device without using one:
nothing here touches a GPU.
"""

import pytest
import torch
from torch import nn

from workbench.loop import TrainSetup, default_loss, make_optimizer
from workbench.models import inspect_model
from workbench.techniques import get_technique

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a CUDA-typed device, never used: apply() reads only its type


def _setup(model: nn.Module | None = None, device: torch.device = CPU) -> TrainSetup:
    return TrainSetup(
        model=model or nn.Linear(4, 2),
        device=device,
        loss_fn=default_loss,
        make_optimizer=make_optimizer("adamw", 1e-3),
    )


def _applied(name: str, settings: dict | None = None, setup: TrainSetup | None = None) -> TrainSetup:
    technique = get_technique(name)
    setup = setup or _setup()
    technique.apply(setup, technique.configure(settings or {}))
    return setup


def test_amp_autocasts_in_the_dtype_asked_for():
    """float16 was checked nowhere: an amp that always used bfloat16 passed."""
    for dtype, expected in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        setup = _applied("amp", {"dtype": dtype})
        with setup.forward_context():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == expected


def test_amp_o2_computes_the_loss_from_float32_logits_and_scales_float16():
    seen = []
    setup = _setup(nn.Linear(4, 3))
    setup.loss_fn = lambda outputs, targets: (seen.append(outputs.dtype), default_loss(outputs, targets))[1]
    _applied("amp", {"level": "O2"}, setup)
    setup.loss_fn(setup.model(torch.randn(2, 4).bfloat16()), torch.tensor([0, 1]))
    assert seen == [torch.float32], "O2's model is bfloat16; the loss must still be taken in float32"

    from workbench.mixed_precision import DynamicLossScaler

    scaled = _applied("amp", {"dtype": "float16", "level": "O2"}, _setup(device=CUDA))
    assert scaled.make_loss_scaler is DynamicLossScaler and scaled.loss_scaling


def test_checkpointing_wraps_every_repeated_block_the_innermost_ones():
    from workbench.techniques.checkpointing import repeated_blocks

    model, _ = inspect_model("mlp")
    _applied("checkpointing", setup=_setup(model))
    names, modules = repeated_blocks(model), dict(model.named_modules())
    assert len(names) > 1 and all("forward" in vars(modules[name]) for name in names)

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    nested = nn.Module()
    nested.stages = nn.ModuleList([nn.Sequential(block(), block()) for _ in range(2)])
    assert repeated_blocks(nested) == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]


def test_compile_passes_its_mode_and_fullgraph_to_torch_compile(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **options: (seen.update(options), model)[1])
    _applied("compile", {"mode": "max-autotune", "fullgraph": True})
    assert seen == {"mode": "max-autotune", "fullgraph": True}


def test_cuda_graphs_in_compile_mode_compiles_the_model():
    from torch._dynamo.eval_frame import OptimizedModule

    assert isinstance(_applied("cuda_graphs", {"mode": "compile"}).model, OptimizedModule)


def test_cupy_fusion_swaps_in_the_fused_modules_and_optimizer():
    """Its effect test needs a GPU; here a no-op apply passed every test."""
    from workbench.fused_ops import FusedAdamW, FusedLayerNorm, FusedLinearGELU

    model, _ = inspect_model("gpt-mini")
    setup = _applied("cupy_fusion", setup=_setup(model))
    kinds = {type(module) for module in model.modules()}
    assert FusedLinearGELU in kinds and FusedLayerNorm in kinds
    assert isinstance(setup.make_optimizer(list(model.parameters())), FusedAdamW)


def test_dali_gives_each_rank_its_own_shard_and_the_threads_asked_for(monkeypatch):
    import workbench.techniques.dali as dali

    built = []
    monkeypatch.setattr(dali, "dali_batches", lambda images, config, *rest: built.append(config))
    setup = _setup()
    setup.world_size, setup.rank = 2, 1
    _applied("dali", {"threads": 3}, setup)
    setup.make_batches(type("Source", (), {"images": None})(), 8, 0)
    assert (built[0].shard_id, built[0].num_shards, built[0].threads) == (1, 2, 3)


def test_dataloader_options_follow_the_settings():
    setup = _applied("dataloader", {"num_workers": 3, "prefetch_factor": 4}, _setup(device=CUDA))
    options = setup.loader_options
    assert (options["num_workers"], options["prefetch_factor"], options["pin_memory"]) == (3, 4, True)


def test_ddp_compression_settings_reach_the_communication_hook():
    from workbench.distributed import CommSettings

    def ranked() -> TrainSetup:
        setup = _setup(device=CUDA)
        setup.world_size, setup.comm = 2, CommSettings()
        return setup

    powersgd = _applied(
        "ddp_compression", {"hook": "powersgd", "rank": 3, "start_iter": 5, "warm_start": False}, ranked()
    )
    assert (powersgd.comm.powersgd_rank, powersgd.comm.start_iter, powersgd.comm.warm_start) == (3, 5, False)
    assert (
        _applied("ddp_compression", {"hook": "int8", "scale": "tensor"}, ranked()).comm.int8_scale == "tensor"
    )


def test_prefetch_pins_the_loader_and_copies_ahead_by_its_depth(monkeypatch):
    """Its effect test needs a GPU; here a no-op apply passed every test. The prefetcher is
    replaced by a recorder, so that no CUDA stream is made."""
    import workbench.techniques.prefetch as prefetch

    depths = []
    monkeypatch.setattr(prefetch, "DevicePrefetcher", lambda batches, device, depth: depths.append(depth))
    setup = _applied("prefetch", {"depth": 2}, _setup(device=CUDA))
    assert setup.loader_options["pin_memory"] is True and len(setup.batch_stages) == 1
    setup.batch_stages[0](iter([]))
    assert depths == [2]


def test_tf32_turns_cudnn_on_in_the_window_and_restores_it():
    from workbench.devices import current_precision

    previous = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    try:
        (window,) = _applied("tf32", {"matmul": False, "cudnn": True}).window_settings
        with window():
            assert current_precision()[1] is True
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    finally:
        torch.backends.cudnn.conv.fp32_precision = previous


@pytest.mark.parametrize("steps", [3, 4])
def test_grad_accum_splits_the_batch_into_the_steps_asked_for(steps):
    """Every fast test used steps=2: one that always split in two passed them all."""
    split = _applied("grad_accum", {"steps": steps}).split_batch
    parts = split(torch.randn(12, 4), torch.arange(12))
    assert len(parts) == steps and sum(share for _, _, share in parts) == pytest.approx(1.0)
