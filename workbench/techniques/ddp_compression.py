"""ddp_compression: DDP communication hooks that shrink, sparsify, quantize or route gradient sync,
and bucket settings that overlap it with backward.

What it does
    In data-parallel training every rank all-reduces its gradients each step. A DDP
    communication hook decides what travels:

    - ``fp16``/``bf16`` cast each gradient bucket to 16 bits before the all-reduce (half the
      bytes) and back after it;
    - ``powersgd`` replaces each gradient matrix M (n x m) by a rank-r approximation P Q^T and
      all-reduces P (n x r) and Q (m x r), keeping the approximation error for the next step
      (error feedback); ``batched_powersgd`` does the same with each whole bucket folded into
      one square matrix;
    - ``topk`` sends only the ``density`` share of entries with the largest magnitude, as
      values and int32 positions (2 x density x the float32 bytes), and keeps the rest for
      later steps (error feedback);
    - ``int8`` quantizes each bucket (or each tensor: ``scale``) to 8 bits with a float32
      scale, keeping the rounding error for later steps: about a quarter of the bytes;
    - ``hierarchical`` reduces inside each node, all-reduces among one leader per node, and
      broadcasts back: only the leaders' traffic crosses the network (``ranks_per_node``;
      on one machine the nodes are simulated, and ``link`` delays only that traffic).

    ``bucket_cap_mb`` sets how many megabytes of gradients go out together: smaller buckets
    start communicating earlier in backward (more of it hidden behind the gradient computation),
    larger ones pay the per-message latency fewer times. ``gradient_as_bucket_view`` makes the
    gradients views into DDP's buckets, saving a copy of every gradient each step and its
    memory. ``no_sync`` keeps gradients local during the first k-1 micro-batches of
    ``grad_accum``, so ranks communicate once per optimizer step.

When it helps
    When gradient synchronization is a large share of the step: a slow or shared network,
    many ranks, a model with many parameters per unit of compute. Baidu Intelligent Cloud
    Tech Hub's "How to Supercharge AI Model Training" lists these levers for distributed
    training: compressing what is sent (16-bit casting, low-rank PowerSGD, sparsification,
    quantization), overlapping communication with backward, fusing gradients into buckets,
    and hierarchical all-reduce across machines. PowerSGD (Vogels et al., NeurIPS 2019)
    reports over 100x less traffic at rank 1-2 with accuracy close to full precision on image
    models; Deep Gradient Compression (Lin et al., ICLR 2018) sends 0.1% of the gradient with
    error feedback. The results table shows how much of each step's communication was hidden
    behind backward (``comm_hidden_share``) and how much the step waited for
    (``comm_exposed_ms``), and the breakdown plot draws both.

When it hurts
    Compression costs compute (casts; PowerSGD's matrix products and orthogonalization; top-k's
    selection) and changes the maths: low-rank, sparse and quantized updates can slow
    convergence (watch ``loss_vs_baseline``), and PowerSGD falls back to a plain all-reduce
    for its first ``start_iter`` iterations (so a run whose warm-up is shorter is refused:
    those steps would be timed). ``topk`` and ``int8`` gather every rank's part
    instead of all-reducing (different ranks send different positions; int8 sums overflow),
    and a ring all-gather sends N - 1 parts against an all-reduce's 2 (N - 1) / N, so their
    saving shrinks as ranks are added. ``hierarchical`` adds two steps inside the node, which
    pay off only when the link between nodes is the slow part. On a fast link, or with one
    rank, there is little to save. The ``bf16`` hook needs NCCL. PowerSGD on gloo aborts when
    DDP splits gradients into several buckets, so on CPU workbench gives it a single bucket
    and says so.

Settings
    ``hook`` (``none`` | ``fp16`` (default) | ``bf16`` | ``powersgd`` | ``batched_powersgd`` | ``topk``
    | ``int8`` | ``hierarchical``; the one that matters), ``rank`` (PowerSGD's matrix
    approximation rank, default 1), ``start_iter`` (iteration from which PowerSGD compresses;
    earlier ones all-reduce in full; default 2, the least PowerSGD accepts with error
    feedback), ``warm_start`` (reuse last step's Q, default True), ``density`` (topk's share
    of entries sent, default 0.01), ``scale`` (int8: ``bucket`` (default) or ``tensor``),
    ``ranks_per_node`` (hierarchical, default 2), ``bucket_cap_mb`` (None: DDP's default, a
    first bucket of 1 MB, then 25 MB each; 25 given here makes every bucket 25 MB), ``gradient_as_bucket_view`` (default False, DDP's default), ``no_sync`` (default
    True: with grad_accum, all-reduce once per optimizer step). Needs ``world_size`` > 1 in
    ``ablate``. Bytes are measured by wrapping the hook (see workbench.distributed); a
    simulated link (``ablate(link=...)``) delays each bucket in proportion to its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.comm_hooks import INT8_SCALES
from workbench.config import check_bool, check_choice, check_int, check_number
from workbench.distributed import DDP_ORDER, parameter_mib
from workbench.techniques.base import Context, Technique

HOOKS = ("none", "fp16", "bf16", "powersgd", "batched_powersgd", "topk", "int8", "hierarchical")
POWERSGD = ("powersgd", "batched_powersgd")
# The settings that only one kind of hook reads (the others leave them out of arm names and sweeps).
HOOK_SETTINGS = {
    "rank": POWERSGD,
    "start_iter": POWERSGD,
    "warm_start": POWERSGD,
    "density": ("topk",),
    "scale": ("int8",),
    "ranks_per_node": ("hierarchical",),
}


@dataclass(frozen=True)
class DdpCompressionConfig:
    hook: str = field(default="fp16", metadata={"choices": HOOKS})
    rank: int = 1
    start_iter: int = 2
    warm_start: bool = True
    density: float = 0.01
    scale: str = field(default="bucket", metadata={"choices": INT8_SCALES})
    ranks_per_node: int = 2
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    no_sync: bool = True

    def __post_init__(self) -> None:
        check_choice("ddp_compression", "hook", self.hook, HOOKS)
        check_int("ddp_compression", "rank", self.rank, 1)
        check_int(
            "ddp_compression",
            "start_iter",
            self.start_iter,
            2,
            why=" (PowerSGD with error feedback starts compressing from its second iteration at the earliest)",
        )
        check_bool("ddp_compression", "warm_start", self.warm_start)
        check_number("ddp_compression", "density", self.density, above=0.0, most=1.0)
        check_choice("ddp_compression", "scale", self.scale, INT8_SCALES)
        check_int("ddp_compression", "ranks_per_node", self.ranks_per_node, 1)
        check_bool("ddp_compression", "gradient_as_bucket_view", self.gradient_as_bucket_view)
        if self.bucket_cap_mb is not None:
            check_number("ddp_compression", "bucket_cap_mb", self.bucket_cap_mb, above=0.0)
        check_bool("ddp_compression", "no_sync", self.no_sync)


class DdpCompression(Technique):
    name = "ddp_compression"
    summary = "DDP communication hooks (fp16, bf16, PowerSGD, top-k, int8, hierarchical), buckets, no_sync"
    order = DDP_ORDER - 5  # it configures the DDP wrapper, which is applied at DDP_ORDER
    group = "communication"
    tune_space = {"hook": ("fp16", "powersgd")}  # half the bytes, or a low-rank sketch of them
    Config = DdpCompressionConfig
    requires = ("ranks",)

    def settings_that_matter(self, config: DdpCompressionConfig) -> list[str]:
        fields = super().settings_that_matter(config)
        return [name for name in fields if config.hook in HOOK_SETTINGS.get(name, (config.hook,))]

    def check(self, ctx: Context, config: DdpCompressionConfig) -> str | None:
        if config.hook == "bf16" and ctx.device.type != "cuda":
            return "the bf16 hook needs NCCL (a CUDA device); gloo, the CPU backend, refuses it"
        if config.hook == "hierarchical" and ctx.world_size > 1:
            nodes, left = divmod(ctx.world_size, config.ranks_per_node)
            if left or nodes < 2:
                return (
                    f"the hierarchical hook needs at least two nodes of ranks_per_node={config.ranks_per_node} "
                    f"ranks each, so world_size a multiple of {config.ranks_per_node} from "
                    f"{2 * config.ranks_per_node}; world_size={ctx.world_size} is not"
                )
        return None

    def validate(self, ctx: Context, config: DdpCompressionConfig) -> None:
        # PowerSGD all-reduces in full before start_iter: timed, those steps would blur both the
        # bytes per step and the speed (resnet-mini with warmup=1 measured a compression of 2.8x, not 32x).
        if config.hook in POWERSGD and ctx.world_size > 1 and ctx.warmup < config.start_iter:
            raise ValueError(
                f"ddp_compression: warmup={ctx.warmup} is too short for {config.hook}: it all-reduces in full "
                f"until iteration start_iter={config.start_iter}, and those steps must not be timed; use "
                f"warmup >= {config.start_iter}"
            )

    def apply(self, setup, config: DdpCompressionConfig) -> str:
        comm = setup.comm
        comm.hook, comm.powersgd_rank = config.hook, config.rank
        comm.start_iter, comm.warm_start = config.start_iter, config.warm_start
        comm.density, comm.int8_scale, comm.ranks_per_node = (
            config.density,
            config.scale,
            config.ranks_per_node,
        )
        comm.bucket_cap_mb, comm.no_sync = config.bucket_cap_mb, config.no_sync
        comm.gradient_as_bucket_view = config.gradient_as_bucket_view
        note = f"hook={config.hook}"
        if config.hook == "topk":
            note += f" (density {config.density:g}: values and int32 positions, error feedback)"
        elif config.hook == "int8":
            note += f" (one scale per {config.scale}, error feedback)"
        elif config.hook == "hierarchical":
            nodes = setup.world_size // config.ranks_per_node
            note += f" ({nodes} nodes of {config.ranks_per_node} ranks; simulated where the ranks share a machine)"
        one_bucket = False
        if config.hook in POWERSGD:
            note += f" (rank {config.rank}, compressing from iteration {config.start_iter})"
            if setup.device.type != "cuda":
                # gloo aborts PowerSGD when gradients arrive in more than one bucket: give it one.
                single = parameter_mib(setup.model) + 1.0
                if comm.bucket_cap_mb is None or comm.bucket_cap_mb < single:
                    comm.bucket_cap_mb, one_bucket = single, True
                    note += (
                        f"; every gradient in one bucket (bucket_cap_mb={single:g}, above their "
                        f"{single - 1.0:.2f} MiB), because PowerSGD on gloo aborts with several"
                    )
        if comm.bucket_cap_mb is not None and not one_bucket:
            note += f"; bucket_cap_mb={comm.bucket_cap_mb:g}"
        if comm.gradient_as_bucket_view:
            note += "; gradients are views into the buckets"
        if config.no_sync and setup.split_batch.parts > 1:
            note += f"; no_sync: one all-reduce per {setup.split_batch.parts} micro-batches"
        return note


TECHNIQUE = DdpCompression()
