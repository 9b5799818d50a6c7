"""The communication hooks of workbench.comm_hooks, on real gloo ranks, against the maths they
promise: what each rank sends, what comes back, what stays behind for the next step. And the
meter's split of communication into the part hidden behind backward and the part exposed."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import on_ranks

from workbench.comm_hooks import (
    HierarchicalState,
    Int8State,
    TopKState,
    hierarchical_hook,
    int8_hook,
    topk_hook,
)
from workbench.distributed import CommMeter, Link

SIZES = (60, 40)  # two gradients in one bucket (int8's per-tensor scales need more than one)


class FakeBucket:
    """The parts of DDP's GradBucket a hook reads: its index, flat buffer and gradients."""

    def __init__(self, index: int, buffer: torch.Tensor, sizes=SIZES):
        self._index, self._buffer, self._sizes = index, buffer, sizes

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(self._buffer.split(list(self._sizes)))


def _join(rank: int, link: Link | None = None) -> CommMeter:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    meter = CommMeter(dist.get_world_size(), link)
    meter.install()
    return meter


def _gradients(rank: int, steps: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(sum(SIZES), generator=generator) for _ in range(steps)]


def _run(meter: CommMeter, hook, state, gradients: list[torch.Tensor]) -> list[np.ndarray]:
    measured = meter.wrap(hook)
    return [measured(state, FakeBucket(0, g.clone())).wait().numpy().copy() for g in gradients]


# --- top-k ---------------------------------------------------------------------------------------------


def _topk_rank(rank: int, density: float) -> dict:
    meter = _join(rank)
    state = TopKState(density)
    outputs = _run(meter, topk_hook, state, _gradients(rank))
    return {"outputs": outputs, "residual": state.residuals[0].numpy().copy(), "bytes": meter.payload_bytes}


def _sparse(vector: np.ndarray, count: int) -> np.ndarray:
    kept = np.zeros_like(vector)
    largest = np.argsort(-np.abs(vector))[:count]
    kept[largest] = vector[largest]
    return kept


@pytest.mark.slow
def test_topk_sends_the_largest_entries_and_keeps_the_rest_for_the_next_step():
    world, density = 2, 0.1
    count = int(np.ceil(density * sum(SIZES)))
    ranks = on_ranks(world, _topk_rank, density)
    grads = [[g.numpy() for g in _gradients(rank)] for rank in range(world)]
    residuals = [np.zeros(sum(SIZES), dtype=np.float32) for _ in range(world)]
    for step in range(2):
        corrected = [grads[rank][step] + residuals[rank] for rank in range(world)]  # error feedback
        sent = [_sparse(c, count) for c in corrected]
        residuals = [c - s for c, s in zip(corrected, sent, strict=True)]
        for rank in range(world):
            np.testing.assert_allclose(
                ranks[rank]["outputs"][step], np.mean(sent, axis=0), rtol=1e-6, atol=1e-6
            )
    for rank in range(world):
        np.testing.assert_allclose(ranks[rank]["residual"], residuals[rank], rtol=1e-6, atol=1e-6)
        # values (float32) and int32 positions: 2 x density x the dense float32 payload, per step
        assert ranks[rank]["bytes"] == 2 * count * (4 + 4)


# --- int8 ----------------------------------------------------------------------------------------------


def _int8_rank(rank: int, scale: str) -> dict:
    meter = _join(rank)
    state = Int8State(scale)
    gradients = _gradients(rank, steps=1)
    outputs = _run(meter, int8_hook, state, gradients)
    return {
        "output": outputs[0],
        "sent": (gradients[0] - state.residuals[0]).numpy(),  # what this rank's int8 stands for
        "residual": state.residuals[0].numpy().copy(),
        "bytes": meter.payload_bytes,
    }


@pytest.mark.slow
@pytest.mark.parametrize("scale, scales", [("bucket", 1), ("tensor", len(SIZES))])
def test_int8_sends_a_quarter_of_the_bytes_and_the_rounding_error_stays_behind(scale, scales):
    world = 2
    ranks = on_ranks(world, _int8_rank, scale)
    grads = [_gradients(rank, steps=1)[0].numpy() for rank in range(world)]
    mean_sent = np.mean([r["sent"] for r in ranks], axis=0)
    for rank, answer in enumerate(ranks):
        np.testing.assert_allclose(answer["output"], mean_sent, rtol=1e-5, atol=1e-6)
        # Rounding to the nearest step of s = max|g| / 127 leaves at most half a step behind.
        parts = np.split(grads[rank], np.cumsum(SIZES)[:-1]) if scale == "tensor" else [grads[rank]]
        steps = np.concatenate([np.full(len(p), np.abs(p).max() / 127) for p in parts])
        assert np.all(np.abs(answer["residual"]) <= steps / 2 + 1e-7)
        assert np.abs(answer["residual"]).max() > 0  # and something was rounded
        assert answer["bytes"] == sum(SIZES) * 1 + 4 * scales  # int8 entries and float32 scales
    assert np.abs(ranks[0]["output"] - np.mean(grads, axis=0)).max() < 0.05


# --- hierarchical --------------------------------------------------------------------------------------


def _hierarchical_rank(rank: int) -> dict:
    link = Link(bandwidth_gbps=1.0, latency_ms=1.0)
    meter = _join(rank, link)
    state = HierarchicalState(ranks_per_node=2, link_delay=meter.link_delay)
    gradients = _gradients(rank, steps=3)
    # Three buckets in flight at once, as in a backward pass: they must not cross.
    measured = meter.wrap(hierarchical_hook)
    futures = [measured(state, FakeBucket(i, g.clone())) for i, g in enumerate(gradients)]
    outputs = [f.wait().numpy().copy() for f in futures]
    return {"outputs": outputs, "leader": state.is_leader, "charged": meter.wire_bytes_charged}


@pytest.mark.slow
def test_hierarchical_all_reduce_averages_over_every_rank_and_only_leaders_cross_nodes():
    world, payload = 4, sum(SIZES) * 4
    ranks = on_ranks(world, _hierarchical_rank)
    grads = [[g.numpy() for g in _gradients(rank, steps=3)] for rank in range(world)]
    for answer in ranks:
        for bucket in range(3):
            expected = np.mean([grads[rank][bucket] for rank in range(world)], axis=0)
            np.testing.assert_allclose(answer["outputs"][bucket], expected, rtol=1e-5, atol=1e-6)
    assert [answer["leader"] for answer in ranks] == [True, False, True, False]
    # Leaders all-reduce among 2 nodes over the link: 2 (2-1)/2 x payload per bucket; the others nothing.
    assert [answer["charged"] for answer in ranks] == [3 * payload, 0.0, 3 * payload, 0.0]


# --- hidden and exposed communication ---------------------------------------------------------------


def test_communication_after_the_last_bucket_is_ready_is_exposed():
    meter = CommMeter(world_size=2)
    # Two backward passes. In the first, bucket 1 is done while backward still computes, and the
    # last bucket (ready at 3) finishes at 5: 2 s exposed. In the second, nothing outlasts
    # the last bucket's readiness by more than 0.5 s.
    meter.pass_starts = [0.0, 10.0]
    meter.intervals = [(1.0, 2.0), (3.0, 5.0), (11.0, 13.0), (12.5, 13.0)]
    assert meter.busy_s() == pytest.approx(1.0 + 2.0 + 2.0)
    assert meter.exposed_s() == pytest.approx(2.0 + 0.5)
    meter.reset()
    assert meter.exposed_s() == 0.0  # nothing sent, nothing exposed
    meter.intervals = [(1.0, 2.0)]
    assert meter.exposed_s() is None  # no forward was marked: unknown, not zero
