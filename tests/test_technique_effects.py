"""Every technique's effect, observed: each check fails if the technique's ``apply`` did nothing.

test_techniques.py shows that every technique trains; a technique whose ``apply`` changed
nothing would pass it too. Here each technique has one effect check (EFFECT_CHECKS, described
by the ``effect`` of its row in technique_settings.py) that builds the arm the way a block does
(workbench.block.BlockArm), runs a step or two and looks at what happened: autocast inside the
forward, NHWC tensors, fewer bytes saved for backward, a forward per micro-batch, the loader's
worker processes, DALI's batches, compiled frames, fewer bytes on the wire, TF32 flags, a graph
replayed, fused kernels launched. test_effect_check_fails_when_apply_does_nothing replaces each
technique's ``apply`` by one that changes nothing and shows that its check then fails.

A newly registered technique fails test_every_technique_has_an_effect_check (and its own
test_technique_has_its_effect) until it gets a row ``effect`` and a check here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import requires_cuda
from helpers import arm_result, block_spec, run_spec, unavailable_here
from technique_settings import TECHNIQUE_SETTINGS
from torch import nn
from torch.utils.data import DataLoader, Dataset

import workbench.data
import workbench.fused_ops
from workbench.block import BlockArm
from workbench.devices import synchronize
from workbench.distributed import Rank
from workbench.models import inspect_model
from workbench.techniques import all_techniques, get_technique
from workbench.telemetry import StepClock

NAMES = [t.name for t in all_techniques()]
CPU = torch.device("cpu")
# Where the GPU-only techniques are checked; on CPU they skip with their own unavailable_reason.
GPU_OR_CPU = torch.device("cuda") if torch.cuda.is_available() else CPU


# --- building and running one arm, as a block does -------------------------------------------------


def _config(name: str):
    return get_technique(name).configure(TECHNIQUE_SETTINGS[name]["config"])


def _skip_if_unavailable(name: str, model: str, device: torch.device = CPU, world_size: int = 1) -> None:
    """Skip with the technique's own reason when it cannot run here (no GPU, no CuPy, no DALI...)."""
    reason = unavailable_here(name, model, device, world_size)
    if reason:
        pytest.skip(f"{name} is unavailable here: {reason}")


@contextlib.contextmanager
def built_arm(
    techniques: dict, model: str, device: torch.device = CPU, batch_size: int = 8, data=None
) -> Iterator[BlockArm]:
    """One arm built in this process exactly as a block builds it: seeded model, techniques applied
    in order, data opened, Trainer made. Released on exit (DataLoader workers, DALI threads)."""
    spec = block_spec(model, techniques, data=data, batch_size=batch_size)
    arm = BlockArm(
        spec.arms[0],
        model=spec.model,
        data=spec.data,
        loss_fn=None,
        run=spec.run,
        device=device,
        rank=Rank(),
        shared=False,
    )
    arm.build()
    try:
        yield arm
    finally:
        arm.release()


def run_steps(arm: BlockArm, steps: int) -> list[torch.Tensor]:
    """``steps`` optimizer steps inside the arm's window (its process-wide switches entered)."""
    with arm.active():
        losses = [arm.trainer.step(StepClock(arm.device)) for _ in range(steps)]
    synchronize(arm.device)
    return losses


def _forward_inputs(model: nn.Module) -> list:
    """The first positional input of every call of ``model``'s forward, appended as it happens."""
    seen: list = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    return seen


# --- the effect checks, one per technique ----------------------------------------------------------


def amp_autocasts_the_forward() -> None:
    dtype = getattr(torch, _config("amp").dtype)
    observed = []
    with built_arm({"amp": TECHNIQUE_SETTINGS["amp"]["config"]}, "mlp") as arm:
        kind = arm.device.type

        def record(module, args, output):  # runs inside the forward, i.e. inside the step's autocast (if any)
            observed.append((torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), output.dtype))

        arm.trainer.model.register_forward_hook(record)
        run_steps(arm, 2)
    assert len(observed) == 2, f"expected one forward per step, saw {len(observed)}"
    for enabled, autocast_dtype, output_dtype in observed:
        assert enabled, "autocast was not enabled inside the model's forward"
        assert autocast_dtype == dtype, f"autocast ran in {autocast_dtype}, not the configured {dtype}"
        assert output_dtype == dtype, (
            f"the model's output is {output_dtype}, not {dtype}: its matmuls were not cast"
        )


def _strictly_nhwc(tensor: torch.Tensor) -> bool:
    """channels_last and not also NCHW-contiguous (a tensor with C == 1 or H*W == 1 is both)."""
    return tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()


def channels_last_makes_tensors_nhwc() -> None:
    # Colour images (3 channels): resnet-mini's own data is grayscale, and a 1-channel batch is
    # NCHW and NHWC at once, so its conversion could not be seen.
    with built_arm({"channels_last": True}, "resnet-mini", data="jpeg") as arm:
        model = arm.trainer.model
        inputs = _forward_inputs(model)
        first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        activations = []
        first_conv.register_forward_hook(lambda module, args, output: activations.append(output))
        run_steps(arm, 1)
        # Weights after a step: the optimizer's in-place update must keep the layout too.
        layouts_differ = {
            name: m.weight
            for name, m in model.named_modules()
            if isinstance(m, nn.Conv2d)
            and m.weight.shape[1] > 1
            and m.weight.shape[2] * m.weight.shape[3] > 1
        }
    assert layouts_differ, "resnet-mini has no conv weight whose NCHW and NHWC layouts differ"
    nchw = [name for name, weight in layouts_differ.items() if not _strictly_nhwc(weight)]
    assert not nchw, f"conv weights still in NCHW: {nchw}"
    (x,) = inputs
    assert x.dim() == 4 and x.shape[1] > 1, f"unexpected resnet-mini input shape {tuple(x.shape)}"
    assert _strictly_nhwc(x), f"the input reaching the model has strides {x.stride()}, not channels_last"
    assert _strictly_nhwc(activations[0]), "the first conv's output is not channels_last"


def _bytes_saved_for_backward(arm: BlockArm) -> int:
    """Bytes of every tensor autograd saves for backward during one train step.

    Inside a (non-reentrant) checkpointed module, checkpoint pushes saved-tensor hooks of its
    own, innermost, which keep a placeholder instead of the tensor and recompute it in
    backward: what this outer hook counts is what the step really holds for backward.
    """
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run_steps(arm, 1)
    return saved


def checkpointing_saves_fewer_activations() -> None:
    # A stack of MLP blocks and of transformer blocks (resnet-mini's conv blocks take the same path,
    # model.blocks, at several times the cost).
    for model in ("mlp", "gpt-mini"):
        _skip_if_unavailable("checkpointing", model)
        with built_arm({}, model) as arm:
            without = _bytes_saved_for_backward(arm)
        with built_arm({"checkpointing": TECHNIQUE_SETTINGS["checkpointing"]["config"]}, model) as arm:
            with_it = _bytes_saved_for_backward(arm)
        assert with_it < without, (
            f"{model}: checkpointing saved {with_it} bytes for backward, no fewer than the {without} without it"
        )


def grad_accum_runs_a_forward_per_micro_batch() -> None:
    micro_batches, batch_size = _config("grad_accum").steps, 8
    with built_arm(
        {"grad_accum": TECHNIQUE_SETTINGS["grad_accum"]["config"]}, "mlp", batch_size=batch_size
    ) as arm:
        trainer, model = arm.trainer, arm.trainer.model
        before_step = copy.deepcopy(model)  # the weights the step starts from
        batches = []  # what the step was fed
        next_batch = trainer.next_batch

        def next_batch_kept():
            batches.append(next_batch())
            return batches[-1]

        trainer.next_batch = next_batch_kept
        inputs_seen = _forward_inputs(model)
        gradients = {}

        def keep_gradients(optimizer, args, kwargs):  # the gradient the optimizer is about to apply
            gradients.update({name: p.grad.detach().clone() for name, p in model.named_parameters()})

        trainer.optimizer.register_step_pre_hook(keep_gradients)
        run_steps(arm, 1)
        forward_sizes = [len(x) for x in inputs_seen]
        expected = [len(part) for part in torch.arange(batch_size).tensor_split(micro_batches)]
        assert forward_sizes == expected, (
            f"one optimizer step ran the forward on batches of {forward_sizes}; "
            f"{micro_batches} micro-batches of a batch of {batch_size} are {expected}"
        )
        # The accumulated gradient is the full batch's (each micro-batch's loss weighted by its share).
        ((inputs, targets),) = batches
        arm.setup.loss_fn(before_step(inputs), targets).backward()
        for name, parameter in before_step.named_parameters():
            torch.testing.assert_close(
                gradients[name],
                parameter.grad,
                rtol=1e-4,
                atol=1e-6,
                msg=lambda text, name=name: f"{name}: {text}",
            )


class _LoadingProcesses(Dataset):
    """A Dataset that writes the id of the process loading each sample to a file (workers are forked
    or spawned, so a file is what both sides can see)."""

    def __init__(self, dataset: Dataset, record: Path):
        self.dataset, self.record = dataset, record

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        with open(self.record, "a") as record:
            record.write(f"{os.getpid()}\n")
        return self.dataset[index]


def dataloader_loads_in_worker_processes() -> None:
    config = _config("dataloader")
    loaders: list[DataLoader] = []

    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        record = Path(folder) / "pids"

        class WatchedDataLoader(DataLoader):  # the arm's own DataLoader, with its samples' loaders noted
            def __init__(self, dataset, *args, **kwargs):
                super().__init__(_LoadingProcesses(dataset, record), *args, **kwargs)
                loaders.append(self)

        patch.setattr(workbench.data, "DataLoader", WatchedDataLoader)
        with built_arm({"dataloader": TECHNIQUE_SETTINGS["dataloader"]["config"]}, "mlp") as arm:
            run_steps(arm, 2)
            device = arm.device
        pids = {int(line) for line in record.read_text().split()}
    (loader,) = loaders
    assert loader.num_workers == config.num_workers, (
        f"the arm's DataLoader has num_workers={loader.num_workers}, not {config.num_workers}"
    )
    assert loader.pin_memory == (config.pin_memory and device.type == "cuda")
    if config.num_workers == 0:
        assert pids == {os.getpid()}
        return
    assert loader.prefetch_factor == (config.prefetch_factor or 2)
    assert loader.persistent_workers == (
        True if config.persistent_workers is None else config.persistent_workers
    )
    assert os.getpid() not in pids, "the training process loaded samples itself"
    assert 1 <= len(pids) <= config.num_workers, f"samples loaded by {len(pids)} processes"


def dali_feeds_the_model() -> None:
    _skip_if_unavailable("dali", "mlp")
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    produced: list[torch.Tensor] = []
    loaders: list = []
    original_next = DALIGenericIterator.__next__

    def next_recorded(self):
        outputs = original_next(self)
        produced.append(outputs[0]["images"])  # kept alive, so identity below is meaningful
        return outputs

    class NoDataLoader(DataLoader):
        def __init__(self, *args, **kwargs):
            loaders.append(self)
            super().__init__(*args, **kwargs)

    row = TECHNIQUE_SETTINGS["dali"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DALIGenericIterator, "__next__", next_recorded)
        patch.setattr(workbench.data, "DataLoader", NoDataLoader)
        with built_arm({"dali": row["config"]}, "mlp", data=row.get("data")) as arm:
            inputs = _forward_inputs(arm.trainer.model)
            run_steps(arm, 2)
    assert not loaders, "the arm built a torch DataLoader: its batches did not come from DALI"
    assert len(inputs) == 2
    for x in inputs:
        assert any(x is batch for batch in produced), (
            "the model was fed a tensor DALI's iterator did not produce"
        )


def compile_runs_a_compiled_model() -> None:
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.utils import counters

    with built_arm({"compile": TECHNIQUE_SETTINGS["compile"]["config"]}, "mlp") as arm:
        assert isinstance(arm.trainer.model, OptimizedModule), (
            f"the model that trains is a {type(arm.trainer.model).__name__}, not torch.compile's OptimizedModule"
        )
        counters.clear()
        run_steps(arm, 2)
    assert counters["frames"]["ok"] >= 1, (
        f"TorchDynamo compiled no frame during the steps: {dict(counters['frames'])}"
    )
    assert counters["stats"]["unique_graphs"] >= 1


def ddp_compression_sends_fewer_bytes() -> None:
    row = TECHNIQUE_SETTINGS["ddp_compression"]
    model, world_size = "mlp", row["world_size"]
    _skip_if_unavailable("ddp_compression", model, world_size=world_size)
    hook = _config("ddp_compression").hook
    instance, _ = inspect_model(model)
    # What DDP's plain all-reduce sends per step: every float32 gradient, once (the baseline measures it).
    plain = sum(p.numel() * p.element_size() for p in instance.parameters() if p.requires_grad)
    spec = block_spec(model, {"ddp_compression": row["config"]}, steps=2, warmup=1)
    answer = run_spec(spec, world_size)
    sent = arm_result(answer)["comm_bytes_per_step"]  # what the comm hook handed to collectives (CommMeter)
    if hook in ("fp16", "bf16"):
        assert sent == pytest.approx(plain / 2), (
            f"the {hook} hook should all-reduce 16-bit gradients ({plain // 2} bytes a step); it sent {sent:.0f}"
        )
    else:
        assert sent < plain, (
            f"hook={hook} sent {sent:.0f} bytes a step, no fewer than a plain all-reduce ({plain})"
        )


def _tf32_flags() -> tuple[bool, bool]:
    """(matmul, cuDNN conv) TF32 switches, read through the API this PyTorch sets them with."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # PyTorch >= 2.9; the legacy reads raise then
        return (
            torch.backends.cuda.matmul.fp32_precision == "tf32",
            torch.backends.cudnn.conv.fp32_precision == "tf32",
        )
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@contextlib.contextmanager
def _tf32_off() -> Iterator[None]:
    """Both TF32 switches off (cuDNN's is on by default), so that turning them on can be seen;
    afterwards exactly as they were."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        owners, name, off = (torch.backends.cuda.matmul, torch.backends.cudnn.conv), "fp32_precision", "ieee"
    else:
        owners, name, off = (torch.backends.cuda.matmul, torch.backends.cudnn), "allow_tf32", False
    saved = [getattr(owner, name) for owner in owners]
    for owner in owners:
        setattr(owner, name, off)
    try:
        yield
    finally:
        for owner, value in zip(owners, saved, strict=True):
            setattr(owner, name, value)


def tf32_is_on_inside_the_window() -> None:
    _skip_if_unavailable("tf32", "mlp", GPU_OR_CPU)
    config = _config("tf32")
    with _tf32_off(), built_arm({"tf32": TECHNIQUE_SETTINGS["tf32"]["config"]}, "mlp", GPU_OR_CPU) as arm:
        during = []
        arm.trainer.model.register_forward_hook(lambda module, args, output: during.append(_tf32_flags()))
        run_steps(arm, 1)
        after = _tf32_flags()
    assert during == [(config.matmul, config.cudnn)], (
        f"TF32 (matmul, cudnn) inside the forward: {during}; configured ({config.matmul}, {config.cudnn})"
    )
    assert after == (False, False), (
        f"TF32 (matmul, cudnn) is {after} after the arm's window, not off as before it"
    )


def prefetch_copies_batches_ahead() -> None:
    _skip_if_unavailable("prefetch", "mlp", GPU_OR_CPU)
    from workbench.techniques.prefetch import DevicePrefetcher

    depth, steps = _config("prefetch").depth, 3
    produced: list[torch.Tensor] = []
    original_next = DevicePrefetcher.__next__

    def next_recorded(self):
        batch = original_next(self)
        produced.append(batch[0])
        return batch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DevicePrefetcher, "__next__", next_recorded)
        with built_arm({"prefetch": TECHNIQUE_SETTINGS["prefetch"]["config"]}, "mlp", GPU_OR_CPU) as arm:
            batches = arm.trainer.batches
            inputs = _forward_inputs(arm.trainer.model)
            run_steps(arm, steps)
    assert isinstance(batches, DevicePrefetcher), (
        f"the step takes its batches from a {type(batches).__name__}, not the side-stream prefetcher"
    )
    assert batches.copies == steps + depth, (
        f"{batches.copies} copies in {steps} steps; {depth} should run ahead"
    )
    assert all(any(x is p for p in produced) for x in inputs), (
        "the model was fed batches the prefetcher did not copy"
    )


def cuda_graphs_replays_the_step() -> None:
    _skip_if_unavailable("cuda_graphs", "mlp", GPU_OR_CPU)
    warmup_steps, steps = _config("cuda_graphs").warmup_steps, 4
    replays = 0
    original_replay = torch.cuda.CUDAGraph.replay

    def counted_replay(graph):
        nonlocal replays
        replays += 1
        return original_replay(graph)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda.CUDAGraph, "replay", counted_replay)
        with built_arm(
            {"cuda_graphs": TECHNIQUE_SETTINGS["cuda_graphs"]["config"]}, "mlp", GPU_OR_CPU
        ) as arm:
            forwards = _forward_inputs(arm.trainer.model)
            losses = run_steps(arm, steps)
    # Eager warm-up steps, then one capture (the forward's Python runs once more, into the graph),
    # then every step, the capturing one included, is a replay that runs no Python forward at all.
    assert replays == steps - warmup_steps, f"{replays} graph replays in {steps} steps"
    assert len(forwards) == warmup_steps + 1, f"the Python forward ran {len(forwards)} times in {steps} steps"
    assert len({float(loss) for loss in losses[warmup_steps:]}) > 1, (
        "the replays did not train (the same loss)"
    )


def cupy_fusion_launches_fused_kernels() -> None:
    _skip_if_unavailable("cupy_fusion", "gpt-mini", GPU_OR_CPU)
    from workbench.fused_ops import FusedAdamW, FusedLayerNorm, FusedLinearGELU

    config = _config("cupy_fusion")
    launched: Counter = Counter()
    original_launch = workbench.fused_ops._launch

    def counted_launch(name, entry, *args):
        launched[entry] += 1
        return original_launch(name, entry, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workbench.fused_ops, "_launch", counted_launch)
        with built_arm(
            {"cupy_fusion": TECHNIQUE_SETTINGS["cupy_fusion"]["config"]}, "gpt-mini", GPU_OR_CPU
        ) as arm:
            kinds = {type(m) for m in arm.trainer.model.modules()}
            optimizer = arm.trainer.optimizer
            run_steps(arm, 1)
    expected: list[str] = []
    if config.bias_gelu:
        assert FusedLinearGELU in kinds, "no Linear + GELU was replaced"
        expected += ["bias_gelu_forward", "bias_gelu_backward"]
    if config.layer_norm:
        assert FusedLayerNorm in kinds, "no LayerNorm was replaced"
    if config.layer_norm or config.residual_layer_norm:
        expected += ["residual_dropout_layer_norm_forward", "residual_dropout_layer_norm_backward"]
    if config.optimizer:
        assert isinstance(optimizer, FusedAdamW), (
            f"the optimizer is {type(optimizer).__name__}, not FusedAdamW"
        )
        expected += ["adamw_step"]
    missing = [entry for entry in expected if not launched[entry]]
    assert not missing, f"fused kernels never launched during a step: {missing} (launched: {dict(launched)})"


# --- settings whose effect is not the technique's default one ---------------------------------------


def amp_o2_casts_the_model_and_steps_float32_masters(
    device: torch.device = CPU, dtype: str = "bfloat16"
) -> None:
    from workbench.mixed_precision import NORMS

    half = getattr(torch, dtype)
    # resnet-mini: its BatchNorm layers stay float32
    with built_arm({"amp": {"level": "O2", "dtype": dtype}}, "resnet-mini", device=device) as arm:
        model, optimizer = arm.trainer.model, arm.trainer.optimizer
        outputs = []
        model.register_forward_hook(lambda module, args, output: outputs.append(output.dtype))
        run_steps(arm, 2)
        norms = {
            f"{name}.{p}"
            for name, m in model.named_modules()
            if isinstance(m, NORMS)
            for p, _ in m.named_parameters()
        }
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        model_parameters = list(model.parameters())
    assert norms, "resnet-mini has no normalization layer"
    wrong = {n: d for n, d in dtypes.items() if d != (torch.float32 if n in norms else half)}
    assert not wrong, f"under O2, weights are {dtype} and norm layers float32; these are not: {wrong}"
    assert outputs == [half] * 2, f"the model's outputs were {outputs}, not {dtype}: it ran in float32"
    assert masters and all(m.dtype == torch.float32 for m in masters), (
        "the optimizer does not step float32 masters"
    )
    assert all(m is not p for m, p in zip(masters, model_parameters, strict=False)), (
        "the masters are the weights"
    )
    for parameter, master in zip(model_parameters, masters, strict=True):  # copied back after the step
        torch.testing.assert_close(parameter, master.detach().to(parameter.dtype), rtol=0, atol=0)


def _ddp_answer(config: dict, world_size: int, **overrides) -> tuple[int, dict]:
    """(bytes a plain all-reduce sends per step, the arm's measurements) for a ddp_compression arm
    of the mlp on ``world_size`` ranks, in fresh rank processes (forked from the warm template)."""
    instance, _ = inspect_model("mlp")
    plain = sum(p.numel() * p.element_size() for p in instance.parameters() if p.requires_grad)
    spec = block_spec(
        "mlp", {"ddp_compression": config}, steps=2, warmup=1, world_size=world_size, **overrides
    )
    return plain, arm_result(run_spec(spec, world_size))


def topk_sends_values_and_positions_of_a_few() -> None:
    density = 0.05
    plain, answer = _ddp_answer({"hook": "topk", "density": density}, 2)
    sent = answer["comm_bytes_per_step"]
    # float32 values and int32 positions of the density share: 2 x density x the float32 bytes
    assert sent == pytest.approx(2 * density * plain, rel=0.02), (
        f"topk at density {density} should send about {2 * density * plain:.0f} bytes a step; it sent {sent:.0f}"
    )


def int8_sends_a_quarter() -> None:
    plain, answer = _ddp_answer({"hook": "int8"}, 2)
    sent = answer["comm_bytes_per_step"]
    assert sent == pytest.approx(plain / 4, rel=0.02), (
        f"int8 should send about a quarter of {plain} bytes a step (and one scale per bucket); it sent {sent:.0f}"
    )


def hierarchical_sends_only_the_leaders_across_nodes() -> None:
    from workbench.config import Link

    fast = Link(bandwidth_gbps=1000.0, latency_ms=0.0)  # charged, hardly waited for
    plain, answer = _ddp_answer({"hook": "hierarchical", "ranks_per_node": 2}, 4, link=fast)
    crossed = answer["link_bytes_per_step"]
    # Rank 0 leads node 0: it all-reduces with the other node's leader, 2 (2-1)/2 = 1x the payload;
    # a flat ring of 4 ranks would send 2 (4-1)/4 = 1.5x across the link.
    assert crossed == pytest.approx(plain, rel=0.01), (
        f"rank 0 sent {crossed:.0f} bytes a step over the link; the leaders' all-reduce across 2 nodes is "
        f"{plain}, a flat ring's {1.5 * plain:.0f}"
    )


def _gradient_storages(rank: int, spec) -> tuple[int, int]:
    """In a rank process: build the arm as a block does, take two steps, and count the distinct
    storages its gradients live in."""
    from workbench.worker import _process_setup

    rank_info, device, meter, _heap = _process_setup(spec)
    arm = BlockArm(spec.arms[0], model=spec.model, data=spec.data, loss_fn=None, run=spec.run, device=device,
                   rank=rank_info, meter=meter, shared=False)  # fmt: skip
    arm.build()
    seen: list[tuple[int, int]] = []  # per step, before the optimizer: (storages, gradients)

    def count(optimizer, args, kwargs):
        gradients = [p.grad for p in arm.trainer.model.parameters() if p.grad is not None]
        seen.append((len({g.untyped_storage().data_ptr() for g in gradients}), len(gradients)))

    arm.trainer.optimizer.register_step_pre_hook(count)
    run_steps(arm, 2)
    return seen[-1]  # the second step: after DDP rebuilt its buckets


def gradients_live_in_the_buckets() -> None:
    from helpers import on_ranks

    spec = block_spec(
        "mlp", {"ddp_compression": {"hook": "none", "gradient_as_bucket_view": True}}, world_size=2
    )
    storages, gradients = on_ranks(2, _gradient_storages, spec)[0]
    assert storages < gradients, (
        f"the {gradients} gradients live in {storages} storages of their own, not in DDP's buckets"
    )


# Settings with an effect of their own, beyond their technique's default one: "technique[setting]".
SETTING_EFFECT_CHECKS: dict[str, Callable[[], None]] = {
    "amp[level=O2]": amp_o2_casts_the_model_and_steps_float32_masters,
    # float16 O2 runs only on CUDA (on a CPU it is refused), with a GradScaler beside the masters.
    "amp[level=O2,dtype=float16] on CUDA": functools.partial(
        amp_o2_casts_the_model_and_steps_float32_masters, torch.device("cuda"), "float16"
    ),
    "ddp_compression[hook=topk]": topk_sends_values_and_positions_of_a_few,
    "ddp_compression[hook=int8]": int8_sends_a_quarter,
    "ddp_compression[hook=hierarchical]": hierarchical_sends_only_the_leaders_across_nodes,
    "ddp_compression[gradient_as_bucket_view]": gradients_live_in_the_buckets,
}


EFFECT_CHECKS: dict[str, Callable[[], None]] = {
    "amp": amp_autocasts_the_forward,
    "channels_last": channels_last_makes_tensors_nhwc,
    "checkpointing": checkpointing_saves_fewer_activations,
    "grad_accum": grad_accum_runs_a_forward_per_micro_batch,
    "dataloader": dataloader_loads_in_worker_processes,
    "dali": dali_feeds_the_model,
    "compile": compile_runs_a_compiled_model,
    "ddp_compression": ddp_compression_sends_fewer_bytes,
    "prefetch": prefetch_copies_batches_ahead,
    "tf32": tf32_is_on_inside_the_window,
    "cuda_graphs": cuda_graphs_replays_the_step,
    "cupy_fusion": cupy_fusion_launches_fused_kernels,
}


# --- the tests ---------------------------------------------------------------------------------------


def _marks(name: str) -> list:
    marks = []
    if TECHNIQUE_SETTINGS.get(name, {}).get("slow"):
        marks.append(pytest.mark.slow)
    if "cuda" in get_technique(name).requires:
        marks.append(pytest.mark.gpu)
    return marks


CASES = [pytest.param(name, id=name, marks=_marks(name)) for name in NAMES]


def test_every_technique_has_an_effect_check():
    missing_checks = [name for name in NAMES if name not in EFFECT_CHECKS]
    assert not missing_checks, (
        f"add an effect check to EFFECT_CHECKS in {Path(__file__).name}: {missing_checks}"
    )
    missing_rows = [name for name in NAMES if not TECHNIQUE_SETTINGS.get(name, {}).get("effect")]
    assert not missing_rows, (
        f"say what the effect check observes ('effect') in technique_settings.py: {missing_rows}"
    )
    assert sorted(EFFECT_CHECKS) == sorted(NAMES), "EFFECT_CHECKS names a technique that is not registered"


@pytest.mark.parametrize("name", CASES)
def test_technique_has_its_effect(name):
    """The technique, applied the way a block applies it, visibly changes the run."""
    if name not in EFFECT_CHECKS:
        pytest.fail(f"{name} has no effect check: add one to EFFECT_CHECKS in {Path(__file__).name}")
    EFFECT_CHECKS[name]()


def does_nothing(setup, config) -> str:
    """An ``apply`` that changes nothing (module-level, so it reaches rank processes by reference)."""
    return "nothing (a test's stand-in for an apply that does nothing)"


@pytest.mark.parametrize("name", CASES)
def test_effect_check_fails_when_apply_does_nothing(name, monkeypatch):
    """The check is not vacuous: with the technique's apply() replaced by a no-op, it fails.

    The registry's instance is patched, so arms built in this process use the no-op; rank
    processes (ddp_compression) get the patched instance through the pickled BlockSpec.
    """
    if name not in EFFECT_CHECKS:
        pytest.fail(f"{name} has no effect check: add one to EFFECT_CHECKS in {Path(__file__).name}")
    monkeypatch.setattr(get_technique(name), "apply", does_nothing)
    with pytest.raises(AssertionError):
        EFFECT_CHECKS[name]()


def _setting_marks(key: str) -> list:
    if key.endswith("on CUDA"):
        return [pytest.mark.gpu, requires_cuda]
    return [pytest.mark.slow] if key.startswith("ddp_compression") else []  # rank processes


SETTING_CASES = [pytest.param(key, id=key, marks=_setting_marks(key)) for key in SETTING_EFFECT_CHECKS]


@pytest.mark.parametrize("key", SETTING_CASES)
def test_setting_has_its_effect(key):
    SETTING_EFFECT_CHECKS[key]()


@pytest.mark.parametrize("key", SETTING_CASES)
def test_setting_effect_check_fails_when_apply_does_nothing(key, monkeypatch):
    monkeypatch.setattr(get_technique(key.split("[")[0]), "apply", does_nothing)
    with pytest.raises(AssertionError):
        SETTING_EFFECT_CHECKS[key]()
