"""ddp_compression: DDP communication hooks that shrink, and bucket sizes that overlap, gradient sync.

What it does
    In data-parallel training every rank all-reduces its gradients each step. A DDP
    communication hook decides what travels: ``fp16``/``bf16`` cast each gradient bucket to
    16 bits before the all-reduce (half the bytes) and back after it; ``powersgd`` replaces
    each gradient matrix M (n x m) by a rank-r approximation P Q^T and all-reduces P (n x r)
    and Q (m x r), keeping the approximation error for the next step (error feedback);
    ``batched_powersgd`` does the same with each whole bucket folded into one square
    matrix. ``bucket_cap_mb`` sets how many megabytes of gradients go out together: smaller
    buckets start communicating earlier in backward (more overlap), larger ones pay the
    per-message latency fewer times. ``no_sync`` keeps gradients local during the first
    k-1 micro-batches of ``grad_accum``, so ranks communicate once per optimizer step.

When it helps
    When gradient synchronization is a large share of the step: a slow or shared network,
    many ranks, a model with many parameters per unit of compute. Baidu Intelligent Cloud
    Tech Hub's "How to Supercharge AI Model Training" lists these levers for distributed
    training: compressing what is sent (16-bit casting, low-rank PowerSGD), overlapping
    communication with backward, and communicating less often.
    PowerSGD (Vogels et al., NeurIPS 2019) reports over 100x less traffic at rank 1-2 with
    accuracy close to full precision on image models.

When it hurts
    Compression costs compute (casts; for PowerSGD, matrix products and an
    orthogonalization) and changes the maths: PowerSGD's low-rank updates can slow
    convergence, and it falls back to a plain all-reduce for its first ``start_iter``
    iterations. On a fast link, or with one rank, there is little to save. The ``bf16`` hook
    needs NCCL. PowerSGD on gloo aborts when DDP splits gradients into several buckets, so
    on CPU workbench gives it a single bucket and says so.

Settings
    ``hook`` (``none`` | ``fp16`` | ``bf16`` | ``powersgd`` | ``batched_powersgd``; the one
    that matters), ``rank`` (PowerSGD's matrix approximation rank, default 1),
    ``start_iter`` (iteration from which PowerSGD compresses; earlier ones all-reduce in
    full; default 2, the least PowerSGD accepts with error feedback), ``warm_start``
    (reuse last step's Q, default True), ``bucket_cap_mb`` (None: DDP's default of 25 MB),
    ``no_sync`` (default True: with grad_accum, all-reduce once per optimizer step). Needs
    ``world_size`` > 1 in ``ablate``. Bytes are measured by wrapping the hook (see
    workbench.distributed); a simulated link (``ablate(link=...)``) delays each bucket in
    proportion to its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.config import check_bool, check_choice, check_int, check_number
from workbench.distributed import DDP_ORDER, parameter_mib
from workbench.techniques.base import Context, Technique

HOOKS = ("none", "fp16", "bf16", "powersgd", "batched_powersgd")
POWERSGD = ("powersgd", "batched_powersgd")


@dataclass(frozen=True)
class DdpCompressionConfig:
    hook: str = field(default="fp16", metadata={"choices": HOOKS})
    rank: int = 1
    start_iter: int = 2
    warm_start: bool = True
    bucket_cap_mb: float | None = None
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
        if self.bucket_cap_mb is not None:
            check_number("ddp_compression", "bucket_cap_mb", self.bucket_cap_mb, above=0.0)
        check_bool("ddp_compression", "no_sync", self.no_sync)


class DdpCompression(Technique):
    name = "ddp_compression"
    summary = "DDP gradient-compression hooks (fp16, bf16, PowerSGD), bucket size, no_sync under grad_accum"
    order = DDP_ORDER - 5  # it configures the DDP wrapper, which is applied at DDP_ORDER
    tune_space = {"hook": ("fp16", "powersgd")}  # half the bytes, or a low-rank sketch of them
    Config = DdpCompressionConfig
    requires = ("ranks",)

    def settings_that_matter(self, config: DdpCompressionConfig) -> list[str]:
        fields = super().settings_that_matter(config)
        if config.hook not in POWERSGD:  # rank, start_iter and warm_start are PowerSGD's alone
            fields = [name for name in fields if name not in ("rank", "start_iter", "warm_start")]
        return fields

    def check(self, ctx: Context, config: DdpCompressionConfig) -> str | None:
        if config.hook == "bf16" and ctx.device.type != "cuda":
            return "the bf16 hook needs NCCL (a CUDA device); gloo, the CPU backend, refuses it"
        return None

    def apply(self, setup, config: DdpCompressionConfig) -> str:
        comm = setup.comm
        comm.hook, comm.powersgd_rank = config.hook, config.rank
        comm.start_iter, comm.warm_start = config.start_iter, config.warm_start
        comm.bucket_cap_mb, comm.no_sync = config.bucket_cap_mb, config.no_sync
        note = f"hook={config.hook}"
        if config.hook in POWERSGD:
            note += f" (rank {config.rank}, compressing from iteration {config.start_iter})"
            if setup.device.type != "cuda":
                # gloo aborts PowerSGD when gradients arrive in more than one bucket: give it one.
                single = parameter_mib(setup.model) + 1.0
                if comm.bucket_cap_mb is None or comm.bucket_cap_mb < single:
                    comm.bucket_cap_mb = single
                    note += f"; one {single:.1f} MB bucket, because PowerSGD on gloo aborts with several"
        if comm.bucket_cap_mb is not None:
            note += f"; bucket_cap_mb={comm.bucket_cap_mb:g}"
        if config.no_sync and setup.split_batch.parts > 1:
            note += f"; no_sync: one all-reduce per {setup.split_batch.parts} micro-batches"
        return note


TECHNIQUE = DdpCompression()
