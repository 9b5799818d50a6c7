"""The parts of amp's level O2 (workbench.mixed_precision), each against what it is for."""

import pytest
import torch
from torch import nn

from workbench import mixed_precision
from workbench.mixed_precision import DynamicLossScaler, MasterWeightOptimizer, cast_keeping_norms_in_float32


def _sgd(parameters):
    return torch.optim.SGD(parameters, lr=1.0)


def test_master_weights_keep_updates_that_bfloat16_would_round_away():
    # 1 - 0.001 is 1.0 in bfloat16 (its step near 1 is 1/128): a bfloat16 weight updated in place
    # never moves, while the float32 master accumulates the updates and the model follows it.
    plain = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    cast = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    plain_optimizer, master_optimizer = _sgd([plain]), MasterWeightOptimizer([cast], _sgd)
    for _ in range(10):
        for parameter, optimizer in ((plain, plain_optimizer), (cast, master_optimizer)):
            parameter.grad = torch.full((1,), 1e-3, dtype=torch.bfloat16)
            optimizer.step()
            optimizer.zero_grad()
    assert plain.item() == 1.0, "the bfloat16 update was expected to round away"
    (master,) = master_optimizer.masters
    assert master.dtype == torch.float32 and master.item() == pytest.approx(0.99, abs=1e-4)
    assert cast.item() == pytest.approx(0.99, abs=1 / 128) and cast.item() < 1.0
    assert cast.item() == master.to(torch.bfloat16).item()  # copied back after each step


def test_the_loss_scaler_skips_an_overflowed_step_halves_and_grows_its_scale():
    weight = nn.Parameter(torch.ones(2, dtype=torch.float16))
    optimizer = MasterWeightOptimizer([weight], _sgd)
    scaler = DynamicLossScaler(scale=2.0**16, growth_interval=2)
    weight.grad = torch.tensor([float("inf"), 1.0], dtype=torch.float16)
    scaler.step(optimizer)
    scaler.update()
    assert weight.tolist() == [1.0, 1.0] and scaler.skipped_steps == 1 and scaler.scale_value == 2.0**15
    for _ in range(2):  # two good steps: the gradient is unscaled into the masters, then the scale grows
        weight.grad = torch.full((2,), 2.0**15 * 0.25, dtype=torch.float16)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert weight.tolist() == [0.5, 0.5] and scaler.scale_value == 2.0**16


def test_norm_layers_keep_float32_weights_and_are_fed_float32_where_no_mixed_kernel_runs(monkeypatch):
    def model():
        return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))

    native = model()
    assert cast_keeping_norms_in_float32(native, torch.bfloat16) == (1, 0)  # this CPU's kernel mixes
    seen = []
    native[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    assert native(torch.randn(4, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert native[1].weight.dtype == torch.float32 and native[0].weight.dtype == torch.bfloat16
    monkeypatch.setattr(mixed_precision, "_MIXED_KERNELS", {})
    monkeypatch.setattr(mixed_precision, "_takes_mixed_input", lambda norm, dtype: False)
    cast_around = model()
    assert cast_keeping_norms_in_float32(cast_around, torch.bfloat16) == (1, 1)
    cast_around[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    output = cast_around(torch.randn(4, 8, dtype=torch.bfloat16))
    assert seen == [torch.bfloat16, torch.float32]  # the second model's norm saw float32
    assert output.dtype == torch.bfloat16
