"""DDP communication hooks of workbench's own: top-k sparsification, 8-bit quantization, and a
hierarchical all-reduce over simulated nodes.

PyTorch ships the 16-bit and PowerSGD hooks (workbench.distributed uses them as they are); these
three are written here, each as a hook function and a state object, with the signature DDP's
``register_comm_hook(state, hook)`` expects: ``hook(state, bucket) -> Future[Tensor]``, whose
value is the bucket's averaged gradient.

``topk``
    Each rank adds the error it kept from earlier steps to its gradient (error feedback), keeps
    the ``density`` share of entries with the largest magnitude, and sends their values (float32)
    and positions (int32): 2 x density x the dense payload, index overhead included. The entries
    it did not send stay in its residual for the next step. Ranks choose different positions, so
    the hook gathers everyone's values and positions (``all_gather``) and adds them up; it cannot
    all-reduce. Lin et al., "Deep Gradient Compression" (ICLR 2018), and Stich et al., "Sparsified
    SGD with Memory" (NeurIPS 2018), show that error feedback keeps such sparse updates converging.
``int8``
    Each rank quantizes its error-corrected gradient to int8 with one scale per bucket (or per
    tensor): ``q = round(g / s)``, ``s = max|g| / 127``, and keeps ``g - q s`` as its residual.
    int8 sums overflow, so it gathers everyone's ``q`` and scales rather than all-reducing: about a
    quarter of float32's bytes per rank, which a ring all-gather sends N - 1 times, against the
    2 (N - 1) / N times of a ring all-reduce, so the saving shrinks as N grows (4x at N = 2).
    Error feedback for quantized gradients: Seide et al., "1-bit SGD" (Interspeech 2014).
``hierarchical``
    For jobs that span machines: reduce inside each node to one leader, all-reduce across nodes
    among the leaders, broadcast back inside each node. Only the leaders' all-reduce crosses the
    network, over M nodes instead of N ranks, so the slow link carries 2 (M - 1) / M of the
    payload in 2 (M - 1) messages instead of 2 (N - 1) / N in 2 (N - 1). On one machine the nodes
    are simulated (``ranks_per_node``), and the simulated link delays only the leaders' traffic.
    The three collectives of a bucket run on one thread of the hook's, bucket after bucket, so
    every rank issues them in the same order while backward goes on.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _residual(residuals: dict[int, torch.Tensor], bucket: Any, like: torch.Tensor) -> torch.Tensor:
    """The error this rank kept for ``bucket``; zeros the first time, or when DDP rebuilt its buckets
    (after the first iteration it regroups parameters in the order their gradients arrive)."""
    kept = residuals.get(bucket.index())
    if kept is None or kept.shape != like.shape:
        kept = torch.zeros_like(like)
    return kept


def _gather(tensor: torch.Tensor, group: Any) -> tuple[list[torch.Tensor], torch.futures.Future]:
    """Every rank's ``tensor`` (same shape on all), asynchronously: (outputs, future)."""
    outputs = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(outputs, tensor, group=group, async_op=True)
    return outputs, work.get_future()


class TopKState:
    """What the top-k hook keeps between steps: the density and each bucket's residual."""

    def __init__(self, density: float, process_group: Any = None):
        self.density = density
        self.process_group = process_group
        self.residuals: dict[int, torch.Tensor] = {}


def topk_hook(state: TopKState, bucket: Any) -> torch.futures.Future:
    buffer = bucket.buffer()
    corrected = buffer.float() + _residual(state.residuals, bucket, buffer.float())
    count = max(1, math.ceil(state.density * corrected.numel()))
    positions = corrected.abs().topk(count, sorted=False).indices
    values = corrected[positions]
    corrected[positions] = 0.0  # what was sent leaves the residual; the rest waits for later steps
    state.residuals[bucket.index()] = corrected
    all_values, values_sent = _gather(values, state.process_group)
    all_positions, positions_sent = _gather(positions.to(torch.int32), state.process_group)

    def add_up(_: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for rank_values, rank_positions in zip(all_values, all_positions, strict=True):
            total.index_add_(0, rank_positions.long(), rank_values)
        buffer.copy_(total.div_(len(all_values)))
        return buffer

    return torch.futures.collect_all([values_sent, positions_sent]).then(add_up)


INT8_SCALES = ("bucket", "tensor")


class Int8State:
    """What the int8 hook keeps between steps: where its scales apply and each bucket's residual."""

    def __init__(self, scale: str = "bucket", process_group: Any = None):
        self.scale = scale
        self.process_group = process_group
        self.residuals: dict[int, torch.Tensor] = {}


def _segments(bucket: Any, scale: str) -> list[int]:
    """Element counts that share one scale: the whole bucket, or each of its gradients."""
    whole = bucket.buffer().numel()
    if scale == "bucket":
        return [whole]
    sizes = [gradient.numel() for gradient in bucket.gradients()]
    return sizes if sum(sizes) == whole else [whole]  # a padded bucket: one scale for all of it


def int8_hook(state: Int8State, bucket: Any) -> torch.futures.Future:
    buffer = bucket.buffer()
    corrected = buffer.float() + _residual(state.residuals, bucket, buffer.float())
    segments = _segments(bucket, state.scale)
    sizes = torch.tensor(segments, device=buffer.device)
    peaks = torch.stack([part.abs().max() for part in corrected.split(segments)])
    scales = torch.where(peaks > 0, peaks / 127.0, torch.ones_like(peaks))
    per_entry = scales.repeat_interleave(sizes)
    quantized = (corrected / per_entry).round_().clamp_(-127, 127).to(torch.int8)
    state.residuals[bucket.index()] = corrected - quantized.float() * per_entry
    all_quantized, quantized_sent = _gather(quantized, state.process_group)
    all_scales, scales_sent = _gather(scales, state.process_group)

    def add_up(_: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for rank_quantized, rank_scales in zip(all_quantized, all_scales, strict=True):
            total.add_(rank_quantized.float() * rank_scales.repeat_interleave(sizes))
        buffer.copy_(total.div_(len(all_quantized)))
        return buffer

    return torch.futures.collect_all([quantized_sent, scales_sent]).then(add_up)


class HierarchicalState:
    """The simulated nodes' process groups, and the thread that runs each bucket's collectives.

    Made on every rank at once: ``dist.new_group`` is itself collective, so every rank creates
    every group, in the same order, even those it is not in.
    """

    def __init__(self, ranks_per_node: int, link_delay: Callable[[float], None] | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} does not divide world_size={world}")
        self.ranks_per_node = ranks_per_node
        self.nodes = world // ranks_per_node
        self.world_size = world
        self.node_group = None
        for node in range(self.nodes):
            members = list(range(node * ranks_per_node, (node + 1) * ranks_per_node))
            group = dist.new_group(members)
            if rank in members:
                self.node_group, self.leader = group, members[0]
        self.leader_group = dist.new_group([node * ranks_per_node for node in range(self.nodes)])
        self.is_leader = rank == self.leader
        self.link_delay = link_delay  # the simulated inter-node link, charged by the leaders alone
        self._work: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="workbench-hierarchical", daemon=True).start()

    def internode_wire_bytes(self, payload: float) -> float:
        """Bytes a leader sends across nodes for a ring all-reduce of ``payload`` among M leaders."""
        return 2 * (self.nodes - 1) / self.nodes * payload

    def _serve(self) -> None:
        while True:
            tensor, done = self._work.get()
            try:
                dist.reduce(tensor, dst=self.leader, group=self.node_group)
                if self.is_leader:
                    dist.all_reduce(tensor, group=self.leader_group)
                    if self.link_delay is not None:
                        self.link_delay(self.internode_wire_bytes(tensor.numel() * tensor.element_size()))
                dist.broadcast(tensor, src=self.leader, group=self.node_group)
                done.set_result(tensor.div_(self.world_size))
            except Exception as error:  # noqa: BLE001 - DDP raises it in backward, where the user sees it
                done.set_exception(error)


def hierarchical_hook(state: HierarchicalState, bucket: Any) -> torch.futures.Future:
    done: torch.futures.Future = torch.futures.Future()
    state._work.put((bucket.buffer(), done))
    return done


# The hook charges the simulated link itself (only its inter-node traffic crosses it), so the
# meter must not delay its buckets again (workbench.distributed.CommMeter.wrap).
hierarchical_hook.charges_link_itself = True
