"""Data-parallel arms on CPU: gloo, two ranks, measured communication, faults."""

import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers import arm_result, block_spec, is_kept_template, is_workbench_process, rank_processes, run_spec
from torch import nn

import workbench as wb
from workbench.distributed import CommMeter, CommSettings, Link, free_port, wrap_ddp

WORLD = 2


def _gradients_with(hook: str, rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    meter = CommMeter(WORLD)
    meter.install()
    ddp = wrap_ddp(model, torch.device("cpu"), CommSettings(hook=hook), meter)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    inputs, targets = (
        torch.randn(16, 32, generator=generator),
        torch.randint(0, 4, (16,), generator=generator),
    )
    nn.functional.cross_entropy(ddp(inputs), targets).backward()
    if rank == 0:
        # numpy arrays travel by value; torch tensors would be shared through this process's memory
        queue.put((hook, [p.grad.numpy().copy() for p in model.parameters()], meter.payload_bytes))
        queue.close()
        queue.join_thread()  # the result is through the pipe before this process ends
    dist.barrier()
    dist.destroy_process_group()
    # End without the interpreter's teardown: on this machine a rank that returned normally
    # sometimes aborted there ("terminate called without an active exception", SIGABRT) while
    # torch's C++ threads were being destroyed, after every result was in.
    os._exit(0)


def _gradients(hook: str):
    context = rank_processes()
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_gradients_with, args=(hook, rank, port, queue)) for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    result = queue.get(timeout=120)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return result


def test_fp16_hook_gradients_are_close_and_the_measured_bytes_halve():
    _, exact, exact_bytes = _gradients("none")
    _, compressed, compressed_bytes = _gradients("fp16")
    for a, b in zip(exact, compressed, strict=True):
        assert np.allclose(a, b, rtol=1e-2, atol=1e-4), np.abs(a - b).max()
    parameters = (32 * 64 + 64) + (64 * 4 + 4)
    assert exact_bytes == parameters * 4  # float32 gradients, all-reduced once
    assert exact_bytes / compressed_bytes == 2.0


def test_one_call_gives_no_hook_fp16_and_powersgd_rows_with_measured_bytes():
    res = wb.ablate(
        model="resnet-mini",
        data="textures",
        techniques={"ddp_compression": {"hook": ["fp16", "powersgd"]}},
        world_size=WORLD,
        steps=4,
        warmup=3,
        blocks=1,
        batch_size=16,
        device="cpu",
        out=False,
        progress=False,
        control=False,
    )
    table = res.table.set_index("arm")
    assert (table.status == "ok").all(), table[["status", "reason"]]
    baseline, fp16, powersgd = (
        table.loc[name]
        for name in ("baseline", "ddp_compression[hook=fp16]", "ddp_compression[hook=powersgd]")
    )
    assert baseline.compression_ratio == 1.0 and baseline.comm_mb_per_step > 0.5  # resnet-mini: ~0.67 MB
    assert fp16.compression_ratio == pytest.approx(2.0)
    # On the wire, with ring all-reduces: 2(N-1)/N of the payload, so the same halving
    assert baseline.wire_mb_per_step == pytest.approx(2 * (WORLD - 1) / WORLD * baseline.comm_mb_per_step)
    assert fp16.wire_ratio == pytest.approx(2.0)
    assert powersgd.compression_ratio > 10
    assert "one" in powersgd.notes and "bucket" in powersgd.notes  # gloo: a single bucket, said so
    for row in (baseline, fp16, powersgd):
        assert row.samples_per_s_per_rank > 0 and row.samples_per_s > row.samples_per_s_per_rank
        assert 0 < row.comm_share < 1 and math.isfinite(row.final_loss)
    unit = next(u for u in res.record["units"] if u["arm"] == "baseline")
    assert [r["samples"] for r in unit["result"]["per_rank"]] == [16 * 4] * WORLD


def test_a_gathers_payload_gain_beyond_what_it_saves_on_the_wire_is_said():
    """int8 reads 4.0x smaller at any world size, but gathers (N-1) parts: at 16 ranks it sends
    twice the baseline's bytes over a ring, which no column showed without a simulated link."""
    from workbench.results import _wire_note

    mib = 2**20
    int8_at_16 = {"compression_ratio": 4.0, "wire_ratio": 0.5, "wire_mb_per_step": 4.07}
    (note,) = _wire_note(int8_at_16, 2.03 * mib, 16)
    assert "sends 4.07 MiB per step per rank, more than the baseline's 2.03 (wire_ratio 0.50)" in note
    assert _wire_note({"compression_ratio": 2.0, "wire_ratio": 2.0, "wire_mb_per_step": 0.5}, mib, 4) == []


class SometimesUnused(nn.Module):
    """A branch taken on every other step: its parameters get no gradient on the others."""

    def __init__(self):
        super().__init__()
        self.trunk, self.branch, self.calls = nn.Linear(8, 2), nn.Linear(2, 2), 0

    def forward(self, x):
        self.calls += 1
        out = self.trunk(x)
        return self.branch(out) if self.calls % 2 else out


def test_find_unused_parameters_lets_a_model_whose_steps_skip_a_branch_train():
    """PyTorch's error told the user to pass find_unused_parameters=True, which workbench had no
    way to pass: every arm of such a model failed."""
    batches = [(torch.randn(8, 8), torch.randint(0, 2, (8,))) for _ in range(8)]
    res = wb.ablate(
        model=SometimesUnused, data=batches, techniques={"ddp_compression": {"hook": "fp16"}},
        world_size=WORLD, steps=4, warmup=2, blocks=1, device="cpu", out=False, progress=False,
        control=False, find_unused_parameters=True,
    )  # fmt: skip
    assert set(res.table.status) == {"ok"}, res.table[["arm", "reason"]]
    assert res.record["config"]["find_unused_parameters"] is True


def _buckets_per_step(no_sync: bool) -> float:
    spec = block_spec(
        "mlp",
        {"grad_accum": {"steps": 4}, "ddp_compression": {"hook": "none", "no_sync": no_sync}},
        steps=3,
        warmup=2,
        batch_size=16,
    )
    answer = run_spec(spec, WORLD, timeout_s=120, log_path=_log(f"no-sync-{no_sync}"))
    return arm_result(answer)["buckets_per_step"]


def test_no_sync_communicates_once_per_accumulation_window():
    once, every_micro_batch = _buckets_per_step(True), _buckets_per_step(False)
    assert every_micro_batch == 4 * once
    # grad_accum alone under DDP says why its communication is k times the baseline's
    from types import SimpleNamespace

    from workbench.techniques import get_technique

    grad_accum = get_technique("grad_accum")
    for world_size, said in ((2, True), (1, False)):
        setup = SimpleNamespace(world_size=world_size, split_batch=None)
        note = grad_accum.apply(setup, grad_accum.Config(steps=4))
        assert ("4x the baseline's communication, unless ddp_compression's no_sync" in note) == said, note


def _log(name: str):
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp()) / f"{name}.log"


class DiesOnRankOne(nn.Module):
    """Trains normally on rank 0; on rank 1, kills itself (or raises, or hangs) at its third forward."""

    def __init__(self, how: str):
        super().__init__()
        self.layer, self.how, self.calls = nn.Linear(8, 2), how, 0

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 3:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(600)  # where rank 1 hung: its log's stack names this line
            raise RuntimeError("rank 1 broke on purpose")
        return self.layer(x)


# Worker processes inherit the environment: this tag marks the ones this test session started,
# so that a workbench run beside CI on the same machine is none of these tests' business. (An
# orphan is re-parented to init, so this process's descendants would not show it.)
TAG = f"WORKBENCH_TEST_SESSION_{os.getpid()}"


def _workers() -> set[int]:
    """This session's workbench processes, but for the warm template kept for the next run (its
    workers, forked from it, are still found)."""
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        if not is_workbench_process(p.info["cmdline"]) or is_kept_template(p.pid):
            continue
        try:
            if p.environ().get(TAG) == "1":
                found.add(p.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # not ours to read: another user's, so not this test's either
    return found


@pytest.mark.parametrize(
    "how, message",
    [
        ("kill", "rank 1 of 2 was killed by signal 9"),
        ("raise", "rank 1 of 2: RuntimeError: rank 1 broke on purpose"),
        # It said only "the arm's process was ended", naming no rank and no log.
        ("hang", "the arm's 2 rank processes were ended; where their threads were is in the logs of "),
    ],
)
def test_a_rank_that_dies_raises_or_hangs_fails_its_arm_and_the_rest_goes_on(how, message, monkeypatch):
    batches = [(torch.randn(8, 8), torch.randint(0, 2, (8,))) for _ in range(8)]
    monkeypatch.setenv(TAG, "1")  # inherited by the workers this test starts (and no others)
    started = time.monotonic()
    res = wb.ablate(
        model=lambda: DiesOnRankOne(how),
        data=batches,
        techniques={"ddp_compression": {"hook": "fp16"}},
        world_size=WORLD,
        steps=3,
        warmup=2,
        blocks=1,
        device="cpu",
        out=False,
        progress=False,
        control=False,
        timeout_s=15 if how == "hang" else None,
    )
    table = res.table.set_index("arm")
    for arm in ("baseline", "ddp_compression"):  # both arms hit it; the second still ran
        assert table.loc[arm, "status"] == "failed"
        assert message in table.loc[arm, "reason"]
    unit = next(u for u in res.record["units"] if u["arm"] == "baseline")
    if how != "hang":  # the log of the rank that failed: rank 0's said nothing of it
        assert unit["log"].endswith(".rank1.log"), unit["log"]
    if how == "hang":
        assert "rank 1's (" in table.loc["baseline", "reason"]
        rank_1 = unit["traceback"].partition("rank 1:\n")[2]
        assert "test_ddp.py" in rank_1 and "in forward" in rank_1, unit["traceback"]  # where it hung
    assert time.monotonic() - started < 90
    assert _workers() == set(), "a rank process outlived its arm"


def test_bad_distributed_settings_fail_clearly():
    with pytest.raises(ValueError, match="plan: world_size must be >= 1; got 0"):
        wb.plan(world_size=0, device="cpu")
    with pytest.raises(
        ValueError, match="link simulates the network between ranks, so it needs world_size >= 2"
    ):
        wb.plan(link={"bandwidth_gbps": 1}, device="cpu")
    with pytest.raises(
        ValueError, match="link: unknown option 'bandwidth'; valid options: bandwidth_gbps, latency_ms"
    ):
        wb.plan(world_size=2, link={"bandwidth": 1}, device="cpu")
    with pytest.raises(ValueError, match="link: bandwidth_gbps must be > 0.0"):
        wb.plan(world_size=2, link={"bandwidth_gbps": 0}, device="cpu")
    with pytest.raises(ValueError, match="ddp_compression: hook must be one of 'none' | 'fp16'"):
        wb.plan(world_size=2, techniques={"ddp_compression": {"hook": "fp8"}}, device="cpu")
    with pytest.raises(ValueError, match=r"ddp_compression: density must be > 0.0 and <= 1.0; got 2"):
        wb.plan(world_size=2, techniques={"ddp_compression": {"hook": "topk", "density": 2}}, device="cpu")
    with pytest.raises(ValueError, match=r"ddp_compression: start_iter must be >= 2; got 1 \(PowerSGD"):
        wb.plan(world_size=2, techniques={"ddp_compression": {"start_iter": 1}}, device="cpu")
    alone = wb.plan(techniques={"ddp_compression": True}, device="cpu").set_index("name")
    assert alone.loc["ddp_compression", "unavailable"].startswith("needs several ranks")
    bf16 = wb.plan(world_size=2, techniques={"ddp_compression": {"hook": "bf16"}}, device="cpu").set_index(
        "name"
    )
    assert "the bf16 hook needs NCCL" in bf16.loc["ddp_compression", "unavailable"]
    one_node = wb.plan(world_size=2, techniques={"ddp_compression": {"hook": "hierarchical"}}, device="cpu")
    assert (
        "needs at least two nodes of ranks_per_node=2"
        in one_node.set_index("name").loc["ddp_compression", "unavailable"]
    )


def test_a_launchers_rank_variables_are_not_taken_by_a_one_rank_run(monkeypatch):
    """A pod's RANK/WORLD_SIZE (Kubeflow sets them, without torchrun) reached the block's process,
    which took itself for rank 1 of 2: every arm failed ("a data-parallel block holds exactly one
    arm"), and with MASTER_ADDR/PORT set and isolate=True the run hung in a group that never formed."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    res = wb.ablate(
        "mlp", techniques={}, steps=4, warmup=1, blocks=1, device="cpu", out=False, progress=False
    )
    assert list(res.table.status) == ["ok", "ok"], res.table[["arm", "status", "notes"]]


def test_the_simulated_link_delays_each_bucket_by_its_bytes():
    link = Link(bandwidth_gbps=0.08, latency_ms=2.0)  # 10 MB/s
    assert link.delay_s(1e6) == pytest.approx(0.002 + 0.1)
    spec = block_spec(
        "mlp",
        {"ddp_compression": {"hook": "none"}},
        steps=2,
        warmup=2,
        batch_size=16,
        world_size=WORLD,
        link=link,
    )
    answer = arm_result(run_spec(spec, WORLD, timeout_s=120, log_path=_log("link")))
    wire = 2 * (WORLD - 1) / WORLD * answer["comm_bytes_per_step"]
    expected_ms = 1e3 * (answer["buckets_per_step"] * 0.002 + 8 * wire / 0.08e9)
    assert answer["comm_ms_per_step"] >= 0.9 * expected_ms
    assert any("simulated link: 0.08 Gbit/s" in note for note in answer["notes"])


def test_the_same_ablation_runs_under_torchrun_with_one_node_and_two_ranks(tmp_path):
    """``torchrun ... -m workbench ablate``: each arm spans torchrun's ranks; rank 0 keeps the results."""
    import json
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    out = tmp_path / "results"
    command = [
        torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
        "-m", "workbench", "ablate", "--model", "mlp", "--steps", "3", "--warmup", "2", "--blocks", "1",
        "--no-control", "-t", "ddp_compression:hook=fp16", "--device", "cpu", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "results.json").read_text())
    rows = {row["arm"]: row for row in record["table"]}
    assert rows["baseline"]["status"] == rows["ddp_compression"]["status"] == "ok"
    assert rows["ddp_compression"]["compression_ratio"] == 2.0
    assert record["config"]["world_size"] == 2
    assert all(len(u["result"]["per_rank"]) == 2 for u in record["units"])
    assert done.stdout.count("Saved results.json") == 1  # rank 0 alone reports

    # Resuming under torchrun is refused, and the refusal leaves the run's plan as it was (it was
    # rewritten first, with the blocks asked for now).
    plan = (out / "plan.json").read_bytes()
    again = subprocess.run(
        [*command[:-5], "--blocks", "2", *command[-5:]], capture_output=True, text=True, timeout=300
    )
    assert again.returncode != 0 and "resuming under torchrun is not supported" in again.stderr, again.stderr[
        -3000:
    ]
    assert (out / "plan.json").read_bytes() == plan


def test_the_bytes_a_rank_sends_are_the_mean_over_the_ranks_not_rank_0s():
    """hierarchical's node leader (rank 0, always) reduces, all-reduces and broadcasts: its bytes
    alone read as a compression ratio of 0.33, as if the hook tripled the traffic."""
    from workbench.worker import all_ranks

    mine = {"samples": 80, "wall_s": 1.0, "samples_per_s": 80.0, "comm_bytes_per_step": 3.0e6}
    other = {**mine, "comm_bytes_per_step": 1.0e6}
    job = all_ranks(mine, [mine, other, mine, other])
    assert job["comm_bytes_per_step"] == 2.0e6 and job["samples_per_s"] == 320.0 and job["world_size"] == 4


RANK_ONE_FAILS = """
import json, os, sys
import torch
import workbench as wb

class FailsOnRankOne(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def forward(self, x):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:  # in the arm's rank 1
            raise RuntimeError("boom on rank 1")
        return self.layer(x)

data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
res = wb.ablate(FailsOnRankOne, data, techniques={}, steps=2, warmup=1, blocks=1, control=False,
                batch_size=8, device="cpu", out=sys.argv[1], progress=False)
print("REASONS", os.environ["RANK"], json.dumps(list(res.table.reason)))
"""


def test_under_torchrun_every_rank_returns_rank_0s_record_of_a_failed_arm(tmp_path):
    """Through the Python API under torchrun, rank 1's Results said its peer closed the
    connection where rank 0's named rank 1's own error: a script printing on every rank told two stories."""
    import json
    import shutil
    import subprocess
    import sys

    script = tmp_path / "fails.py"
    script.write_text(RANK_ONE_FAILS)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    command = [
        torchrun,
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        str(script),
        str(tmp_path / "r"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    said = {line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in done.stdout.splitlines()
            if line.startswith("REASONS")}  # fmt: skip
    assert set(said) == {"0", "1"}, done.stdout[-2000:] + done.stderr[-3000:]
    assert said["0"] == said["1"] and "boom on rank 1" in said["0"][0], said


def test_small_buckets_hide_communication_behind_backward_and_one_bucket_cannot():
    # resnet-mini's gradients are 0.7 MB: 25 MB buckets make one, which is ready only when the
    # gradient computation ends, so all of its communication is exposed; 0.1 MB buckets start
    # while backward still computes. A slow simulated link makes the communication visible.
    res = wb.ablate(
        model="resnet-mini",
        data="textures",
        techniques={"ddp_compression": {"hook": "none", "bucket_cap_mb": [0.1, 25.0]}},
        world_size=WORLD,
        link={"bandwidth_gbps": 0.2, "latency_ms": 1.0},
        steps=4,
        warmup=2,
        blocks=1,
        batch_size=16,
        device="cpu",
        out=False,
        progress=False,
        control=False,
    )
    table = res.table.set_index("arm")
    assert (table.status == "ok").all(), table[["status", "reason"]]
    small, one = (
        table.loc["ddp_compression[bucket_cap_mb=0.1]"],
        table.loc["ddp_compression[bucket_cap_mb=25.0]"],
    )
    assert one.comm_hidden_share == 0.0 and one.comm_exposed_ms == pytest.approx(one.comm_ms)
    assert small.comm_hidden_share > 0.0 and small.comm_exposed_ms < small.comm_ms
    for row in (small, one):
        # the link carried what a ring all-reduce of every gradient sends per rank: 2 (N-1)/N x the payload
        assert row.link_mb_per_step == pytest.approx(2 * (WORLD - 1) / WORLD * row.comm_mb_per_step)
    figure = res.plot()
    labels = figure.legends[0].get_texts()
    assert {"communication (exposed)", "communication hidden behind backward"} <= {
        t.get_text() for t in labels
    }
