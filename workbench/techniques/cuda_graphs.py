"""cuda_graphs: capture the whole train step as a CUDA graph once, then replay it every step.

What it does
    ``mode="manual"`` (default): the first ``warmup_steps`` steps run eagerly on a side
    stream, so that allocations, cuBLAS/cuDNN autotuning and the optimizer's state all happen
    before capture. Then ``torch.cuda.graph`` captures the compute step: forward, backward and
    the optimizer step, and every micro-batch under grad_accum, reading from static input and
    target buffers. From then on a step copies its batch into those buffers and replays the
    graph: one launch for what were hundreds of kernel launches. The step-time breakdown
    then shows ``replay_ms`` (the whole graph) instead of forward, backward and optimizer.
    ``mode="compile"``: ``torch.compile(model, mode="reduce-overhead")``, whose CUDA-graph
    trees capture forward and backward; the optimizer step stays eager.

When it helps
    Launch-bound steps: small models and small batches, where the GPU idles while Python
    issues kernels one at a time (Baidu Intelligent Cloud Tech Hub's "How to Supercharge AI
    Model Training" counts CUDA Graph among the compute optimizations for exactly this). The
    PyTorch blog "Accelerating PyTorch with CUDA Graphs" (2021) reports 1.70x on Mask R-CNN
    in NVIDIA's MLPerf submission, and about 5x on the graphed backbone alone.

When it hurts
    Large kernels gain nothing: their launch cost is already hidden. The graph keeps a
    private memory pool with the step's activations for its lifetime. Capture happens during
    the warm-up (on step ``warmup_steps + 1``), so its one-time cost is in neither
    ``startup_s`` (the first step) nor the timed steps. What cannot be captured is refused
    with the reason, never silently run eagerly:
    - shapes that change: every batch must have the captured shape (workbench's loaders drop
      the ragged last batch; your own iterable must too);
    - CPU synchronization inside the step (``.item()``, printing a tensor, ``x[mask]`` and
      other data-dependent shapes): capture fails and the arm says so;
    - float16 amp: ``GradScaler.step`` reads ``found_inf`` on the CPU to decide whether to
      skip the step, a sync that cannot be captured. This is a documented limitation: use
      ``amp`` with bfloat16, which needs no scaler;
    - DDP: capture needs ``DDP(static_graph=True)`` over NCCL; workbench's DDP arms do not
      build a static graph, so multi-rank arms are refused;
    - ``cupy_fusion``: its AdamW keeps the step count on the CPU and uploads a pointer table
      every step, which a replay would freeze;
    - amp at ``level="O2"``: its master-weight copies happen outside the captured step;
    - ``compile`` beside ``mode="compile"``: the model would be compiled twice.
    Adam and AdamW are created with ``capturable=True``, which keeps their step counter on
    the GPU so a replayed step advances it. Dropout is graph-safe: PyTorch registers its
    generator with the graph, and each replay draws fresh random numbers.

Settings
    ``mode``: ``"manual"`` (default) | ``"compile"``.
    ``warmup_steps``: eager steps on a side stream before capture (manual mode, default 3).
    The run's ``warmup`` must be at least ``warmup_steps + 1``, so that capture happens before
    the clock starts; a shorter one is refused with the reason. The same rule holds in compile
    mode, where it keeps the graph trees' own warm-up and recording, which take the first calls,
    out of the timed steps (there ``warmup_steps`` sets nothing else).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.config import check_choice, check_int
from workbench.data import map_tensors, tensors_of
from workbench.techniques.base import Context, Technique
from workbench.telemetry import StepClock

MODES = ("manual", "compile")
FLOAT16_AMP = (
    "float16 amp's GradScaler.step reads found_inf on the CPU to decide whether to skip the step, "
    "a sync a graph cannot hold; use amp with dtype bfloat16 (no scaler)"
)
COMPILED_TWICE = (
    "mode='compile' is torch.compile(mode='reduce-overhead'), so with the compile technique on as well "
    "the model would be compiled twice: use one of them, or cuda_graphs mode='manual'"
)


@dataclass(frozen=True)
class CudaGraphsConfig:
    mode: str = field(default="manual", metadata={"choices": MODES})
    warmup_steps: int = 3

    def __post_init__(self) -> None:
        check_choice("cuda_graphs", "mode", self.mode, MODES)
        check_int("cuda_graphs", "warmup_steps", self.warmup_steps, 1, why=" (eager steps before capture)")


class _NoClock(StepClock):
    """The clock passed to the step while it is being captured: timing events have no place in a graph."""

    def __init__(self):
        super().__init__(torch.device("cpu"))

    def start(self) -> None: ...

    def lap(self, phase: str) -> None: ...

    def stop(self) -> None: ...


SYNC_HINT = (
    "the step synchronizes with the CPU while being captured, which a CUDA graph cannot hold "
    "(for example .item(), printing a tensor, a data-dependent shape such as x[mask], or a "
    "GradScaler); remove the sync from the model and loss, or leave cuda_graphs off"
)


class GraphedStep:
    """Runs ``trainer.compute`` eagerly ``warmup_steps`` times, captures it, then replays it."""

    def __init__(self, warmup_steps: int):
        self.eager_steps_left = warmup_steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: Any = None
        self.static_targets: torch.Tensor | None = None
        self.static_loss: torch.Tensor | None = None
        self.pool_bytes = 0  # what the graph's private memory pool holds for its lifetime

    def __call__(self, trainer, inputs: Any, targets: torch.Tensor, clock: StepClock) -> torch.Tensor:
        if self.graph is None and self.eager_steps_left > 0:
            self.eager_steps_left -= 1
            return self._on_side_stream(lambda: trainer.compute(inputs, targets, clock))
        if self.graph is None:
            self._capture(trainer, inputs, targets)
        self._check_shapes(inputs, targets)
        _copy_into(self.static_inputs, inputs)
        _copy_into(self.static_targets, targets)  # None for a dict batch: its labels are inputs
        self.graph.replay()
        clock.lap("replay")
        return self.static_loss.clone()  # the static output is overwritten by the next replay

    @staticmethod
    def _on_side_stream(work):
        """Warm-up runs on a side stream, as PyTorch's capture recipe asks."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = work()
        torch.cuda.current_stream().wait_stream(side)
        return result

    def _capture(self, trainer, inputs: Any, targets: torch.Tensor) -> None:
        self.static_inputs = _clone(inputs)
        self.static_targets = _clone(targets)
        trainer.optimizer.zero_grad(set_to_none=True)  # gradients are then allocated in the graph's pool
        graph = torch.cuda.CUDAGraph()
        # Capture allocates only from the graph's new private pool: what the caching allocator
        # reserves in between is that pool. torch.cuda.graph() empties the allocator's cache as
        # it starts, so the cache is emptied first here too: else the warm-up steps' cached
        # blocks, released inside, hid the pool (an H100 run showed graphed gpt-mini at 10 MiB,
        # its parameters and optimizer state alone, against the eager step's 82 MiB).
        device = next((p.device for p in trainer.model.parameters()), None)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(device)
        try:
            with torch.cuda.graph(graph):
                self.static_loss = trainer.compute(self.static_inputs, self.static_targets, _NoClock())
        except RuntimeError as error:
            if "captur" in str(error).lower() or "not permitted" in str(error).lower():
                raise RuntimeError(f"cuda_graphs: {SYNC_HINT} ({error})") from error
            raise
        self.pool_bytes = max(0, torch.cuda.memory_reserved(device) - reserved_before)
        self.graph = graph

    def _check_shapes(self, inputs: Any, targets: torch.Tensor) -> None:
        captured, got = _shapes((self.static_inputs, self.static_targets)), _shapes((inputs, targets))
        if captured != got:
            raise RuntimeError(
                f"cuda_graphs: a batch has shapes {got}, but the step was captured for {captured}; a graph "
                "replays fixed shapes, so every batch must have the same shape (drop the ragged last batch "
                "with drop_last=True, or pad to one shape)"
            )


def _clone(value: Any) -> Any:
    """A private copy of the batch (tensors cloned, the structure kept) for the graph to read."""
    return map_tensors(value, torch.Tensor.clone)


def _copy_into(static: Any, value: Any) -> None:
    for static_tensor, tensor in zip(tensors_of(static), tensors_of(value), strict=True):
        static_tensor.copy_(tensor)


def _shapes(value: Any) -> list[tuple[int, ...]]:
    return [tuple(tensor.shape) for tensor in tensors_of(value)]


class CudaGraphs(Technique):
    name = "cuda_graphs"
    summary = "capture the whole train step as one CUDA graph and replay it: no per-kernel launch cost"
    order = 95  # last: the captured step must contain every change the other techniques made
    group = "compute"
    Config = CudaGraphsConfig
    requires = ("cuda",)
    own_process_reason = (
        "the captured graph keeps a private memory pool for its lifetime, which per-window memory "
        "deltas cannot see, and its replays draw from the CUDA generator that a block switches per arm"
    )
    conflicts = {
        "cupy_fusion": "its AdamW keeps the step count on the CPU and uploads a pointer table every step, "
        "which a replayed graph would freeze",
    }

    def conflict_with(self, config: CudaGraphsConfig, other: Technique, other_config: Any) -> str | None:
        if other.name == "amp" and getattr(other_config, "dtype", None) == "float16":
            return FLOAT16_AMP
        if other.name == "compile" and config.mode == "compile":
            return COMPILED_TWICE
        return super().conflict_with(config, other, other_config)

    def check(self, ctx: Context, config: CudaGraphsConfig) -> str | None:
        if ctx.world_size > 1:
            return (
                "capturing a DDP step needs DDP(static_graph=True) over NCCL, and workbench's DDP arms do not "
                "build a static graph; run cuda_graphs with world_size=1"
            )
        return None

    def validate(self, ctx: Context, config: CudaGraphsConfig) -> None:
        if ctx.device.type != "cuda":
            return  # unavailable here anyway, so "every technique" (techniques=None) still plans on CPU
        if ctx.warmup < config.warmup_steps + 1:
            raise ValueError(
                f"cuda_graphs: warmup={ctx.warmup} is too short: the step is captured on step "
                f"{config.warmup_steps + 1}, after {config.warmup_steps} eager warm-up step(s), and capture must "
                f"happen before the clock starts; use warmup >= {config.warmup_steps + 1}, or lower "
                "cuda_graphs' warmup_steps"
            )

    def apply(self, setup, config: CudaGraphsConfig) -> str:
        # Plan time refuses these combinations (conflict_with); a user's own technique that turns
        # on the scaler or compiles the model is caught here, before a capture that cannot work.
        if setup.loss_scaling:
            raise ValueError(f"cuda_graphs cannot capture float16 amp: {FLOAT16_AMP}")
        if config.mode == "compile":
            if isinstance(setup.model, torch._dynamo.eval_frame.OptimizedModule):
                raise ValueError(f"cuda_graphs(mode='compile'): {COMPILED_TWICE}")
            setup.model = torch.compile(setup.model, mode="reduce-overhead")
            return "torch.compile(mode='reduce-overhead'): CUDA-graph trees for forward and backward"
        build = setup.make_optimizer

        def capturable(params):
            optimizer = build(params)
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                for group in optimizer.param_groups:
                    group["capturable"] = True  # the step counter lives on the GPU, so replays advance it
            return optimizer

        setup.make_optimizer = capturable
        setup.autocast_cache = False
        setup.graph_step = GraphedStep(config.warmup_steps)
        return (
            f"whole step captured after {config.warmup_steps} eager warm-up step(s) on a side stream, then replayed "
            "(replay_ms is the whole graph)"
        )


TECHNIQUE = CudaGraphs()
