"""Models as users bring them: outputs that are not tensors, batches that are dicts or tuples,
and checkpointing that finds the repeated blocks of any model.

These use small stand-ins written the way the libraries write them (a Hugging Face-style
model takes named inputs and returns a mapping with ``loss`` and ``logits``); the real
libraries run in the ``thirdparty`` tier (tests/test_thirdparty.py).
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections import OrderedDict

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.data import batch_size_of, inputs_and_targets
from workbench.loop import Trainer, TrainSetup, call_model, default_loss, make_optimizer
from workbench.techniques import get_technique
from workbench.techniques.channels_last import to_channels_last
from workbench.techniques.checkpointing import repeated_blocks, select_modules
from workbench.techniques.grad_accum import MicroBatches
from workbench.telemetry import StepClock

CPU = torch.device("cpu")
VOCAB, LENGTH = 32, 12


class Output(OrderedDict):
    """Like transformers' ModelOutput: a mapping whose fields are also attributes."""

    __getattr__ = OrderedDict.get


class TinyCausalLM(nn.Module):
    """Named inputs (input_ids, attention_mask, labels) and a loss of its own when given labels."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(3)
        )
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(x)
        out = Output(logits=logits)
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return out


class TwoInputs(nn.Module):
    """Takes its inputs positionally, as a model fed a tuple does."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, a, b):
        return self.left(a) + self.right(b)


def lm_batches(count: int = 4, labels: bool = True, size: int = 8) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if labels:
            batch["labels"] = ids
        batches.append(batch)
    return batches


def test_the_models_own_loss_is_used_and_logits_otherwise():
    model = TinyCausalLM()
    batch = lm_batches(1)[0]
    outputs = call_model(model, batch)
    assert default_loss(outputs, None) is outputs["loss"]
    ids = batch["input_ids"]
    without = call_model(model, {"input_ids": ids})  # no labels: no loss of its own
    expected = nn.functional.cross_entropy(without["logits"].flatten(0, 1), ids.flatten())
    torch.testing.assert_close(default_loss(without, ids), expected)  # logits, tokens flattened
    first_of_tuple = (without["logits"], "extra")
    torch.testing.assert_close(default_loss(first_of_tuple, ids), expected)


def test_the_results_name_the_default_loss_the_arms_take():
    """A Hugging Face model given labels trains on its own loss, and results.json called it
    cross_entropy (so did `workbench compare`); a model without labels takes cross-entropy."""
    own = wb.plan(model=TinyCausalLM, data=lm_batches(), device="cpu").attrs["config"]["loss_fn"]
    assert own == "the model's own loss"
    without = wb.plan(
        model=TinyCausalLM, data=[(b["input_ids"], b["input_ids"]) for b in lm_batches()], device="cpu"
    )
    assert without.attrs["config"]["loss_fn"] == "cross_entropy"
    assert (
        wb.plan(model=_small_mlp, data=_PAIRS, loss_fn=nn.CrossEntropyLoss(), device="cpu").attrs["config"][
            "loss_fn"
        ]
        == "CrossEntropyLoss"
    )


def _small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _frozen_mlp() -> nn.Module:
    return _small_mlp().requires_grad_(False)


class _IgnoresItsInput(nn.Module):
    """Returns logits that do not depend on its one parameter: nothing for backward to reach."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.zeros(x.shape[0], 3)


class _NotOnMeta(nn.Module):
    """Reads a number from a tensor while it is built (as timm's drop-path schedules did): it
    cannot be built on the meta device, so the check builds it for real."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.mlp = _small_mlp().requires_grad_(not frozen)
        self.scale = torch.linspace(0.5, 1.0, 2)[-1].item()

    def forward(self, x):
        return self.mlp(x) * self.scale


class _HeadLoss(nn.Module):
    """A loss with a head of its own to train (ArcFace-style): the optimizer never stepped it."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)

    def forward(self, features, targets):
        return nn.functional.cross_entropy(self.head(features), targets)


_PAIRS = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))] * 2


# Each is a mistake every arm would make: before this check, each arm failed with PyTorch's own
# words, after a process had started; now plan() (and so ablate()) refuses it in one line.
@pytest.mark.parametrize(
    ("model", "data", "loss_fn", "expected"),
    [
        (_frozen_mlp, _PAIRS, None, r"nothing to train: all of its parameters \(4\) have requires_grad=False"),
        (_small_mlp, _PAIRS, lambda outputs: outputs.sum(), r"called as loss_fn\(outputs, targets\), and <lambda>\(outputs\)"),
        (_small_mlp, _PAIRS, lambda o, t: nn.functional.cross_entropy(o, t).item(), r"returned float: \.item\(\)"),
        (_small_mlp, [(x, y.int()) for x, y in _PAIRS], None, r"int64.*targets are torch\.int32: convert them"),
        (_small_mlp, [(x.double(), y) for x, y in _PAIRS], None, r"inputs are torch\.float64 and the model's parameters torch\.float32"),
        (_small_mlp, [(x.byte(), y) for x, y in _PAIRS], None, r"inputs are torch\.uint8 \(image bytes\?\).*inputs\.float\(\) / 255"),
        (_small_mlp, [(x.long(), y) for x, y in _PAIRS], None, r"inputs are torch\.int64 and the model's parameters torch\.float32: if they are features"),
        # token ids and an error that is not about types: no advice to make them floats
        (lambda: nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(99, 3)), [(torch.randint(0, 10, (8, 5)), y) for _, y in _PAIRS], None, r"shapes cannot be multiplied \(8x20 and 99x3\)$"),
        (_IgnoresItsInput, _PAIRS, None, r"the loss has no gradient"),
        (_small_mlp, _PAIRS, lambda o, t: nn.functional.cross_entropy(o, t).detach(), r"loss_fn's loss has no gradient"),
        (_small_mlp, [{"x": x, "y": y} for x, y in _PAIRS], nn.CrossEntropyLoss(), r"loss_fn gets targets=None.*pairs"),
        (lambda: nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 3)), _PAIRS, None, r"lazy layers \(LazyLinear\).*dummy batch"),
        (_NotOnMeta, [(x, y.int()) for x, y in _PAIRS], None, r"targets are torch\.int32: convert them"),
        (lambda: _NotOnMeta(frozen=True), _PAIRS, None, r"nothing to train"),
        (_small_mlp, _PAIRS, _HeadLoss(), r"loss_fn holds parameters to train \(head\.weight, head\.bias\)"),
    ],
    ids=["frozen", "loss-arity", "loss-item", "int32-labels", "float64-inputs", "uint8-inputs", "int64-inputs", "token-ids", "no-gradient", "detached-loss", "dict-batch-loss_fn", "lazy-layers", "not-on-meta-int32", "not-on-meta-frozen", "loss-with-parameters"],
)  # fmt: skip
def test_a_mistake_every_arm_would_make_is_refused_before_any_arm_runs(model, data, loss_fn, expected):
    if isinstance(data[0], dict):
        model = lambda: _DictInputs()  # noqa: E731 - a factory, as a user writes one
    with pytest.raises(ValueError, match=expected):
        wb.plan(model=model, data=data, loss_fn=loss_fn, device="cpu")


class _StaysLazy(nn.modules.lazy.LazyModuleMixin, nn.Linear):
    """A lazy layer that keeps its class after its first forward (cls_to_become None)."""

    cls_to_become = None

    def __init__(self, out_features: int):
        super().__init__(0, out_features)
        self.weight = nn.parameter.UninitializedParameter()
        self.bias = nn.parameter.UninitializedParameter()

    def reset_parameters(self):
        if not self.has_uninitialized_params() and self.in_features != 0:
            super().reset_parameters()

    def initialize_parameters(self, input):
        if self.has_uninitialized_params():
            with torch.no_grad():
                self.in_features = input.shape[-1]
                self.weight.materialize((self.out_features, self.in_features))
                self.bias.materialize((self.out_features,))
                self.reset_parameters()


def _lazy_then_initialised() -> nn.Module:
    model = nn.Sequential(_StaysLazy(3))
    model(torch.zeros(1, 4))  # what the refusal tells a user to do
    return model


class _SparseInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 3))

    def forward(self, x):
        return torch.sparse.mm(x, self.weight)


def test_sparse_inputs_are_planned():
    """The resume identity digests a list's first batch: a sparse tensor by its dense values
    (it cannot be reshaped to bytes as it is)."""
    inputs = torch.randn(8, 16).relu().to_sparse()
    data = [(inputs, torch.randint(0, 3, (8,)))] * 2
    assert not wb.plan(model=_SparseInputs, data=data, device="cpu").empty


def test_a_lazy_layer_initialised_in_its_factory_is_accepted():
    assert not wb.plan(model=_lazy_then_initialised, data=_PAIRS, device="cpu").empty
    with pytest.raises(ValueError, match=r"lazy layers \(_StaysLazy\)"):
        wb.plan(model=lambda: nn.Sequential(_StaysLazy(3)), data=_PAIRS, device="cpu")


def test_a_factory_that_cannot_build_on_meta_is_checked_for_real_and_passes_when_it_is_right():
    assert not wb.plan(model=_NotOnMeta, data=_PAIRS, device="cpu").empty


class _DictInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _small_mlp()

    def forward(self, x, y):
        return self.mlp(x)


def test_a_forward_that_fails_off_the_run_device_is_left_for_the_arms_to_judge():
    """On CUDA the check runs on meta tensors, or two samples on the CPU; a model that fails
    there may well run on its own device, so only the run on the CPU is refused."""
    from workbench.loop import check_the_loss

    class NeedsItsDevice(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            if x.device.type != "cuda":
                raise RuntimeError("this model runs on CUDA only")
            return self.linear(x)

    check_the_loss(NeedsItsDevice, _PAIRS[0], None, torch.device("cuda"))  # left to the arms
    with pytest.raises(
        ValueError,
        match="forward on the first batch fails, as every arm's would: RuntimeError: this model runs on CUDA only",
    ):
        check_the_loss(NeedsItsDevice, _PAIRS[0], None, CPU)  # fmt: skip


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0])),  # a CPU tensor beside meta outputs
        lambda outputs, targets: nn.functional.cross_entropy(outputs[targets != 2], targets[targets != 2]),
    ],
    ids=["class-weights", "masked"],
)
def test_a_loss_that_cannot_run_on_meta_tensors_is_checked_on_the_cpu_for_a_gpu_run(loss_fn):
    """Off the CPU, the check runs on meta tensors first; a loss that cannot (class weights, a
    mask that depends on the values) is run on two real samples instead, with the batch as given."""
    from workbench.loop import check_the_loss

    check_the_loss(_small_mlp, _PAIRS[0], loss_fn, torch.device("cuda"))
    as_a_number = lambda outputs, targets: loss_fn(outputs, targets).item()  # noqa: E731
    with pytest.raises(ValueError, match="returned float"):
        check_the_loss(_small_mlp, _PAIRS[0], as_a_number, torch.device("cuda"))


def test_ready_made_batches_set_the_batch_size_and_a_different_one_is_refused():
    """workbench uses batches given ready-made as they are, so their size is the batch size:
    grad_accum's check and the record read it (they once read the default 32 for batches of 8)."""
    table = wb.plan(model=_small_mlp, data=_PAIRS, techniques={"grad_accum": {"steps": 4}}, device="cpu")
    assert table.attrs["config"]["batch_size"] == 8
    with pytest.raises(
        ValueError, match=r"batch_size=32, but the data's batches hold 8 samples.*batch_size=8"
    ):
        wb.plan(model=_small_mlp, data=_PAIRS, batch_size=32, device="cpu")
    with pytest.raises(ValueError, match=r"grad_accum: steps=16 exceeds batch_size=8"):
        wb.plan(model=_small_mlp, data=_PAIRS, techniques={"grad_accum": {"steps": 16}}, device="cpu")
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    assert wb.plan(model=_small_mlp, data=dataset, device="cpu").attrs["config"]["batch_size"] == 32
    few = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
    assert wb.plan(model=_small_mlp, data=few, device="cpu").attrs["config"]["batch_size"] == 12
    # a factory's Dataset, too: its size showed only in the arm, which refused batch 32
    assert wb.plan(model=_small_mlp, data=lambda: few, device="cpu").attrs["config"]["batch_size"] == 12
    with pytest.raises(ValueError, match="has 12 samples, fewer than batch_size=16"):
        wb.plan(model=_small_mlp, data=few, batch_size=16, device="cpu")
    # A batch's samples are its targets, as the arms count them: an RNN's inputs lead with time.
    time_major = [(torch.randn(20, 16, 4), torch.randint(0, 3, (16,)))] * 2
    assert wb.plan(model=_TimeMajor, data=time_major, device="cpu").attrs["config"]["batch_size"] == 16
    assert not wb.plan(model=_TimeMajor, data=time_major, batch_size=16, device="cpu").empty


class _TimeMajor(nn.Module):
    """nn.GRU's default layout: inputs (time, batch, features), one label per sequence."""

    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.gru(x)[0][-1])


def test_an_output_the_loss_cannot_use_is_refused_before_any_arm_runs():
    with pytest.raises(ValueError) as error:
        wb.plan(model=TinyCausalLM, data=lm_batches(labels=False), device="cpu", batch_size=8)
    message = str(error.value)
    assert "Output with fields logits" in message and "no targets" in message and "'labels'" in message
    assert "pass (inputs, targets) pairs" in message  # a loss_fn would get targets=None

    class Strings(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return "not a tensor"

    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))] * 2
    with pytest.raises(ValueError, match=r"\(a str\).*no 'loss', 'logits' or tensor"):
        wb.plan(model=Strings, data=data, device="cpu", batch_size=8)
    wrong_targets = [(torch.randn(8, 4), torch.randint(0, 3, (5,)))] * 2  # 5 targets for 8 samples
    with pytest.raises(
        ValueError, match=r"the default loss failed on this model's output \(a tensor of shape"
    ):
        wb.plan(model=lambda: nn.Linear(4, 3), data=wrong_targets, device="cpu", batch_size=8)
    # One output per sample (a regression without its loss_fn): cross-entropy would train nothing.
    regression = [(torch.randn(8, 4), torch.randn(8, 1))] * 2
    with pytest.raises(ValueError, match=r"one output per sample \(a tensor of shape \(8, 1\)\).*mse_loss"):
        wb.plan(model=lambda: nn.Linear(4, 1), data=regression, device="cpu", batch_size=8)
    assert len(wb.plan(model=lambda: nn.Linear(4, 1), data=regression, loss_fn=nn.functional.mse_loss,
                       device="cpu", batch_size=8))  # fmt: skip
    with pytest.raises(ValueError, match=r"must be one tensor \(stack several into one.*got dict"):
        wb.plan(model=lambda: nn.Linear(4, 1), data=[(torch.randn(8, 4), {"a": torch.randn(8)})] * 2,
                device="cpu", batch_size=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor.*shape \(8, 3\)"):
        wb.plan(
            model=TwoInputs,
            data=[((torch.randn(8, 4), torch.randn(8, 4)), torch.zeros(8))] * 2,
            loss_fn=lambda outputs, targets: outputs,
            device="cpu",
            batch_size=8,
        )


def test_inputs_are_passed_as_their_form_says():
    model = TwoInputs()
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    torch.testing.assert_close(call_model(model, (a, b)), model(a, b))  # a tuple: positionally
    torch.testing.assert_close(call_model(model, {"a": a, "b": b}), model(a, b))  # a dict: by name
    assert inputs_and_targets({"a": a}) == ({"a": a}, None)
    assert batch_size_of({"input_ids": torch.zeros(7, 3)}, None) == 7


def _trainer(model: nn.Module, batches: list, split=None) -> Trainer:
    setup = TrainSetup(
        model=model, device=CPU, loss_fn=default_loss, make_optimizer=make_optimizer("sgd", 0.1)
    )
    if split is not None:
        setup.split_batch = split
    return Trainer(setup, iter(batches))


def test_grad_accum_splits_a_dict_batch_and_matches_the_whole_batch():
    torch.manual_seed(0)
    whole = TinyCausalLM()
    accumulated = copy.deepcopy(whole)
    batches = lm_batches(2)
    parts = MicroBatches(2)(batches[0], None)
    assert [part[0]["input_ids"].shape[0] for part in parts] == [4, 4] and [p[2] for p in parts] == [0.5, 0.5]
    assert parts[0][1] is None  # the labels travel inside the dict
    big, small = _trainer(whole, batches), _trainer(accumulated, batches, MicroBatches(2))
    for trainer in (big, small):
        trainer.step(StepClock(CPU))
    for p_whole, p_accumulated in zip(whole.parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(p_accumulated, p_whole, atol=2e-6, rtol=1e-5)
    assert small.samples_seen == big.samples_seen == 8


def test_grad_accum_repeats_what_is_not_per_sample_and_refuses_to_cut_a_sequence_in_time():
    x, z, targets = torch.randn(8, 3), torch.randn(8, 2), torch.arange(8)
    parts = MicroBatches(2)((x, z, 2.0, torch.tensor(0.5)), targets)  # a number, a 0-d tensor: repeated
    assert [part[0][0].shape[0] for part in parts] == [4, 4] and [part[0][2] for part in parts] == [2.0, 2.0]
    assert all(float(part[0][3]) == 0.5 for part in parts)
    time_major = torch.randn(12, 8, 5)  # (T, B, F) with B targets: the first dimension is time
    with pytest.raises(ValueError, match=r"8 samples and inputs of shape \(12, 8, 5\).*time-major"):
        MicroBatches(2)(time_major, targets)

    class LastStep(nn.Module):  # a time-major GRU, classified from its last step
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.GRU(5, 4), nn.Linear(4, 8)

        def forward(self, x):
            return self.head(self.rnn(x)[0][-1])

    # Ready-made batches are read before any arm runs: the arm is unavailable, not failed in every block.
    plan = wb.plan(model=LastStep, data=[(time_major, targets)] * 2, techniques=["grad_accum"], device="cpu")
    reason = plan.set_index("name").loc["grad_accum", "unavailable"]
    assert re.match(
        r"splits a batch along the first dimension, but this batch has 8 samples and inputs of shape \(12, 8, 5\)",
        reason,
    )


class _UnusedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # cuda: the check runs on meta tensors
def test_a_parameter_the_loss_never_reaches_is_refused_before_ddp_fails_every_rank(device):
    from workbench.loop import check_the_loss

    def check(model, world_size):
        check_the_loss(model, _PAIRS[0], None, torch.device(device), world_size)

    with pytest.raises(
        ValueError, match=r"world_size=2, DDP needs a gradient.*unused\.weight, unused\.bias get none"
    ):
        check(_UnusedHead, 2)
    check(_UnusedHead, 1)  # one rank: no DDP, nothing waits for those gradients
    check(lambda: _frozen_unused(_UnusedHead()), 2)  # frozen: nothing to wait for
    # DDP's own option, which the refusal names: DDP then finds such parameters every step
    with pytest.raises(ValueError, match=r"or pass find_unused_parameters=True"):
        check(_UnusedHead, 2)
    check_the_loss(_UnusedHead, _PAIRS[0], None, torch.device(device), 2, find_unused_parameters=True)


def _frozen_unused(model: _UnusedHead) -> _UnusedHead:
    model.unused.requires_grad_(False)
    return model


def test_channels_last_converts_images_inside_tuples_and_dicts():
    image, mask = torch.randn(2, 3, 8, 8), torch.ones(2, 8)
    converted = to_channels_last({"pixels": image, "mask": mask, "pair": (image, 1)})
    assert converted["pixels"].is_contiguous(memory_format=torch.channels_last)
    assert not converted["pixels"].is_contiguous()
    assert converted["mask"] is mask and converted["pair"][1] == 1
    assert converted["pair"][0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.slow  # a real ablation in a fresh process
def test_a_dict_batch_model_trains_in_an_ablation(tmp_path):
    results = wb.ablate(
        model=TinyCausalLM,
        data=lm_batches(),
        techniques={"grad_accum": {"steps": 2}, "checkpointing": True},
        steps=4,
        warmup=1,
        blocks=1,
        batch_size=8,
        device="cpu",
        control=False,
        out=tmp_path / "run",
        progress=False,
    )
    table = results.table.set_index("arm")
    assert set(table.status) == {"ok"}, table.reason.to_dict()
    assert (table.loss_vs_baseline.between(0.9, 1.1)).all()  # the same data, the same losses
    assert "checkpointed layers.0, layers.1, layers.2" in table.loc["checkpointing", "notes"]


def _logged_sgd(log: str, params, lr: float) -> torch.optim.Optimizer:
    """SGD that notes which process built it, and over how many tensors."""
    params = list(params)
    with open(log, "a") as lines:
        lines.write(f"{os.getpid()} {len(params)}\n")
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def test_every_arm_trains_with_the_users_own_optimizer(tmp_path):
    log = tmp_path / "built.txt"
    results = wb.ablate(
        model="mlp",
        techniques=["grad_accum"],
        optimizer=functools.partial(_logged_sgd, str(log), lr=0.05),
        steps=4,
        warmup=1,
        blocks=1,
        device="cpu",
        out=False,
        progress=False,
    )
    table = results.table.set_index("arm")
    assert set(table.status) == {"ok"}, table.reason.to_dict()
    built = [line.split() for line in log.read_text().splitlines()]
    # once here (the check before any arm runs), then once per arm in the block's process
    here = [count for pid, count in built if int(pid) == os.getpid()]
    there = [count for pid, count in built if int(pid) != os.getpid()]
    assert len(here) == 1 and len(there) == 3, built  # baseline, its control, grad_accum
    assert len(set(here + there)) == 1  # over all of the model's parameters each time
    assert results.record["config"]["optimizer"].startswith("partial(_logged_sgd, ")


LEARNING_RATE = 0.1  # read by a factory from its module's globals, as scripts do


def test_an_optimizer_factory_is_given_a_list_and_checked_where_the_arms_build_it_as_it_will():
    """A factory that reads its params twice (a group by ndim, then the rest) got a generator from
    the arms, so its second group was empty, but amp O2's masters as a list: arms trained different
    parameters. And a ZeroRedundancyOptimizer, which needs the ranks' process group, was refused
    by the check in the parent, which has none."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    seen = []

    def by_ndim(params):
        seen.append(type(params))
        return torch.optim.SGD([{"params": [p for p in params if p.dim() > 1]}, {"params": [p for p in params if p.dim() <= 1]}], lr=0.1)  # fmt: skip

    Trainer(
        TrainSetup(model=nn.Linear(2, 2), device=CPU, loss_fn=default_loss, make_optimizer=by_ndim), iter([])
    )
    assert seen == [list]
    zero = functools.partial(ZeroRedundancyOptimizer, optimizer_class=torch.optim.AdamW, lr=1e-3)
    plan = wb.plan(model="mlp", techniques=["ddp_compression"], optimizer=zero, world_size=2, device="cpu")
    assert not plan.unavailable.any()


def test_an_edited_optimizer_factory_is_another_job():
    """Two lambdas share a label; their source tells them apart, so a rerun does not resume."""
    from workbench.ablation import prepare
    from workbench.config import RunConfig

    def identity(factory):
        return prepare("mlp", "digits", None, {}, RunConfig(device="cpu", optimizer=factory)).identity

    first = identity(lambda params: torch.optim.SGD(params, lr=0.1))
    assert first == identity(lambda params: torch.optim.SGD(params, lr=0.1))
    assert (
        first["optimizer_source"]
        != identity(lambda params: torch.optim.SGD(params, lr=0.2))["optimizer_source"]
    )
    assert "optimizer_source" not in identity("sgd")
    # What it builds counts too: a learning rate read from a global, edited between two runs.
    global LEARNING_RATE
    before = identity(lambda params: torch.optim.SGD(params, lr=LEARNING_RATE))
    LEARNING_RATE = 0.001
    try:
        after = identity(lambda params: torch.optim.SGD(params, lr=LEARNING_RATE))
    finally:
        LEARNING_RATE = 0.1
    assert before["optimizer_source"] != after["optimizer_source"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return x + self.body(x)


def test_checkpointing_finds_the_blocks_of_every_stage():
    """A list of stages, each a list of residual blocks: every stage's blocks, not the first's."""
    stages = nn.Sequential(nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block(), Block()))
    assert repeated_blocks(stages) == ["0.0", "0.1", "1.0", "1.1", "1.2"]

    class ResNetLike(nn.Module):  # torchvision's layout: the stages are attributes
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.layer1 = nn.Sequential(Block(), Block())
            self.layer2 = nn.Sequential(Block(), Block())
            self.fc = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # layers, not blocks

    assert repeated_blocks(ResNetLike()) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    assert repeated_blocks(TinyCausalLM()) == ["layers.0", "layers.1", "layers.2"]


def test_checkpointing_selects_by_type_name_class_glob_or_predicate():
    model = nn.Sequential(OrderedDict(a=Block(), b=nn.Linear(4, 4), c=Block()))
    assert select_modules(model, "type:Block") == ["a", "c"]
    assert select_modules(model, Block) == ["a", "c"]
    assert select_modules(model, (Block, nn.Linear)) == ["a", "b", "c"]
    assert select_modules(model, "type:Block,Linear") == ["a", "b", "c"]
    assert select_modules(model, "a*") == ["a"]
    assert select_modules(model, lambda name, m: name == "b") == ["b"]
    with pytest.raises(ValueError, match="select must be None"):
        get_technique("checkpointing").configure({"select": 3})


def test_an_inline_lambda_is_identified_by_its_own_text_not_the_call_around_it():
    """Adding blocks to a run reruns the same call with blocks=2: a model given as an inline
    lambda was identified by inspect.getsource, which gives the whole call, so the rerun read as
    another model ("differs in: model_structure") and was refused."""
    from workbench.ablation import _source_of

    def ablate(**arguments):
        return arguments

    first = ablate(model=lambda: nn.Linear(8,
                                           4), loss_fn=lambda o, y: (o - y).pow(2).mean(), blocks=1)  # fmt: skip
    again = ablate(model=lambda: nn.Linear(8, 4), loss_fn=lambda o, y: (o - y).pow(2).mean(), blocks=2)
    edited = ablate(model=lambda: nn.Linear(8, 5), loss_fn=lambda o, y: (o - y).abs().mean(), blocks=2)
    for name in ("model", "loss_fn"):
        assert _source_of(first[name]) == _source_of(again[name]) != _source_of(edited[name])
    assert _source_of(first["loss_fn"]) == "lambda (o, y): (o - y).pow(2).mean()"


def test_the_default_loss_reads_dense_outputs_in_the_layout_their_targets_fit():
    """A segmentation net's (B, C, H, W) scores were flattened as if the classes came last: with
    C == W it trained on the widths as classes without a word; otherwise it failed on sizes."""
    from torch.nn import functional as F

    from workbench.loop import UnusableOutput

    torch.manual_seed(0)
    tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))  # (batch, tokens, vocabulary)
    assert default_loss(*tokens) == pytest.approx(
        F.cross_entropy(tokens[0].reshape(10, 7), tokens[1].reshape(10)).item()
    )
    square = torch.randn(2, 16, 16, 16), torch.randint(0, 16, (2, 16, 16))  # C == H == W: both layouts fit
    assert default_loss(*square) == pytest.approx(F.cross_entropy(*square).item())
    assert default_loss(*square) != pytest.approx(
        F.cross_entropy(square[0].reshape(-1, 16), square[1].reshape(-1)).item()
    )
    signal = torch.randn(2, 3, 9), torch.randint(0, 3, (2, 9))  # (batch, classes, length)
    assert default_loss(*signal) == pytest.approx(F.cross_entropy(*signal).item())
    with pytest.raises(
        UnusableOutput,
        match=r"cannot pair this model's output \(a tensor of shape \(2, 3, 9\)\) with targets of shape \(2, 4\)",
    ):
        default_loss(signal[0], torch.randint(0, 3, (2, 4)))
