"""The techniques keep the maths they claim to keep."""

import copy

import pytest
import torch
from helpers import train

from workbench.data import builtin_spec
from workbench.loop import Trainer, TrainSetup, WholeBatch, default_loss, make_optimizer
from workbench.models import BUILTIN_MODELS, build_model
from workbench.techniques import get_technique
from workbench.techniques.grad_accum import MicroBatches
from workbench.telemetry import StepClock

CPU = torch.device("cpu")


def _batch(model_name, size=12, seed=0):
    spec = builtin_spec(BUILTIN_MODELS[model_name].default_data)
    generator = torch.Generator().manual_seed(seed)
    if spec.kind == "tokens":
        inputs = torch.randint(0, spec.num_classes, (size, *spec.shape), generator=generator)
        targets = torch.randint(0, spec.num_classes, (size, *spec.shape), generator=generator)
    else:
        inputs = torch.randn(size, *spec.shape, generator=generator)
        targets = torch.randint(0, spec.num_classes, (size,), generator=generator)
    return spec, inputs, targets


def _trainer(model, batches, micro_batches=1):
    setup = TrainSetup(
        model=model,
        device=CPU,
        loss_fn=default_loss,
        make_optimizer=make_optimizer("sgd", 0.05),
        split_batch=MicroBatches(micro_batches) if micro_batches > 1 else WholeBatch(),
    )
    return Trainer(setup, iter(batches))


@pytest.mark.parametrize("model_name", ["mlp", "gpt-mini"])
@pytest.mark.parametrize("k", [2, 3, 5])  # 12 samples: 3 and 5 do not divide evenly for 5
def test_grad_accum_matches_one_big_batch(model_name, k):
    """k micro-batches, each weighted by its share, give the big batch's gradients and updates."""
    spec, inputs, targets = _batch(model_name)
    torch.manual_seed(0)
    reference = build_model(model_name, spec)
    accumulated = copy.deepcopy(reference)
    batches = [(inputs, targets)] * 3
    big, small = _trainer(reference, batches), _trainer(accumulated, batches, micro_batches=k)
    for _ in range(3):
        big.step(StepClock(CPU))
        small.step(StepClock(CPU))
    for (name, p_ref), p_acc in zip(reference.named_parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(
            p_acc, p_ref, atol=2e-6, rtol=1e-5, msg=f"{model_name} {name} differs with k={k}"
        )


def test_grad_accum_first_gradients_equal():
    spec, inputs, targets = _batch("mlp")
    torch.manual_seed(0)
    model = build_model("mlp", spec)
    default_loss(model(inputs), targets).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for chunk_in, chunk_t in zip(inputs.tensor_split(4), targets.tensor_split(4), strict=True):
        (default_loss(model(chunk_in), chunk_t) * len(chunk_t) / len(targets)).backward()
    for g_full, p in zip(full, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g_full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("model_name", ["mlp", "resnet-mini", "gpt-mini"])
def test_checkpointing_gives_identical_gradients(model_name):
    spec, inputs, targets = _batch(model_name, size=8)
    torch.manual_seed(0)
    plain = build_model(model_name, spec)
    checkpointed = copy.deepcopy(plain)
    setup = TrainSetup(
        model=checkpointed, device=CPU, loss_fn=default_loss, make_optimizer=make_optimizer("sgd", 0.1)
    )
    note = get_technique("checkpointing").apply(setup, get_technique("checkpointing").Config())
    assert "checkpointed blocks.0" in note
    for model in (plain, checkpointed):
        model.train()
        default_loss(model(inputs), targets).backward()
    for (name, p_plain), p_ckpt in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(
            p_ckpt.grad, p_plain.grad, atol=1e-6, rtol=1e-5, msg=f"{name} gradient differs"
        )


def test_checkpointing_really_recomputes():
    """The wrapped block runs its forward twice per step (once more during backward)."""
    spec, inputs, targets = _batch("mlp", size=4)
    model = build_model("mlp", spec)
    calls = []
    model.blocks[0].ff[0].register_forward_hook(lambda *args: calls.append(1))
    setup = TrainSetup(
        model=model, device=CPU, loss_fn=default_loss, make_optimizer=make_optimizer("sgd", 0.1)
    )
    get_technique("checkpointing").apply(setup, get_technique("checkpointing").Config())
    default_loss(model(inputs), targets).backward()
    assert len(calls) == 2


def test_a_deep_copy_of_a_checkpointed_model_computes_with_its_own_parameters_and_pickles():
    """An EMA or eval copy: the copy's blocks recompute with the copy's weights, not the original's."""
    import copy
    import io

    spec, inputs, targets = _batch("mlp", size=4)
    model = build_model("mlp", spec)
    setup = TrainSetup(
        model=model, device=CPU, loss_fn=default_loss, make_optimizer=make_optimizer("sgd", 0.1)
    )
    get_technique("checkpointing").apply(setup, get_technique("checkpointing").Config())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in twin.blocks.parameters():
            parameter.mul_(0.5)
    assert not torch.allclose(twin(inputs), model(inputs))
    plain = build_model("mlp", spec)
    plain.load_state_dict(twin.state_dict())
    torch.testing.assert_close(twin(inputs), plain(inputs))

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # the test's own bytes, not a results file
    default_loss(loaded(inputs), targets).backward()  # still checkpointed, and with its own weights
    torch.testing.assert_close(loaded(inputs), model(inputs))


def test_checkpointing_selector_on_a_user_module():
    from torch import nn

    class UserNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(10, 16)
            self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
            self.out = nn.Linear(16, 2)

        def forward(self, x):
            return self.out(self.layers(self.embed(x)))

    from workbench.techniques.checkpointing import repeated_blocks, select_modules

    net = UserNet()
    assert repeated_blocks(net) == ["layers.0", "layers.1", "layers.2"]
    assert select_modules(net, "layers.*") == ["layers.0", "layers.1", "layers.2"]  # outermost matches only
    assert select_modules(net, lambda name, m: isinstance(m, nn.Linear) and name.startswith("out")) == ["out"]
    assert select_modules(net, "nothing.*") == []


def test_bf16_loss_stays_close_to_fp32():
    """After 25 steps of gpt-mini, bf16 autocast's loss is within 3% of float32's.

    At a batch of 4: bf16 steps cost about 1 s at 16 on a CPU without bf16 instructions, and the
    loss still falls from 5.5 to about 3.0 (bf16 within 0.01% of float32 here)."""
    fp32 = train("gpt-mini", {}, steps=20, warmup=5, batch_size=4)
    bf16 = train("gpt-mini", {"amp": {"dtype": "bfloat16"}}, steps=20, warmup=5, batch_size=4)
    final32, final16 = sum(fp32["losses"][-5:]) / 5, sum(bf16["losses"][-5:]) / 5
    assert final32 < fp32["losses"][0] - 0.5, "the model should actually be learning"
    assert abs(final16 - final32) / final32 < 0.03


def test_float16_uses_loss_scaling_and_trains():
    result = train("mlp", {"amp": {"dtype": "float16"}}, steps=10, warmup=2)
    assert "GradScaler" in result["notes"][0]
    assert result["losses"][-1] < result["losses"][0]


def test_tf32_sets_and_restores_the_process_flags_around_each_window():
    """tf32 is unavailable on CPU, but its flag handling is plain Python and can be checked here."""
    from workbench.devices import current_precision
    from workbench.process_state import differences, fingerprint

    before = current_precision()
    setup = TrainSetup(
        model=torch.nn.Linear(2, 2),
        device=CPU,
        loss_fn=default_loss,
        make_optimizer=make_optimizer("sgd", 0.1),
    )
    flags_before = fingerprint()
    get_technique("tf32").apply(setup, get_technique("tf32").Config(matmul=True, cudnn=False))
    assert current_precision() == before  # nothing yet: other arms of a block may run first
    (window,) = setup.window_settings  # entered around each of this arm's windows
    with window():
        assert current_precision() == (True, before[1])  # cudnn=False leaves convolutions alone
    assert current_precision() == before
    # Exactly as before, down to PyTorch's own spelling ('none' is not 'ieee'): the block's
    # check for arms that leave process-wide state changed compares these.
    assert differences(flags_before, fingerprint()) == []


def test_channels_last_converts_model_and_inputs():
    result = train("resnet-mini", {"channels_last": True}, steps=2)
    assert "channels_last" in result["notes"][0]
    from workbench.techniques.channels_last import to_channels_last

    x = to_channels_last(torch.randn(2, 3, 8, 8))
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert to_channels_last(torch.randn(2, 3)).is_contiguous()  # non-4D inputs pass through
