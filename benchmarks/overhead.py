"""Harness overhead: a hand-written PyTorch loop against the same model run by workbench.

Goal: the harness delivers >= 0.99 of the bare loop's throughput.

Two designs, both interleaved, both reported:

end-to-end
    Each round runs two fresh processes back to back, in an order that alternates between
    rounds: (a) a plain loop written here with no workbench code in the timed window, and
    (b) ``wb.ablate``'s baseline arm on the same model, data, seed, warm-up and steps.
    This is the honest user-level comparison, but on a machine where identical processes
    differ by up to 2x, its interval is wide.

in-process
    One fresh process per round builds the model once, then alternates windows of the bare
    loop and of workbench's timed window (``workbench.block.timed_window``: Trainer.step
    with its clock, the kept loss, the progress throttle) over the same model, optimizer
    and batch stream: A B A B ... The process's own speed cancels in each A/B ratio, so
    the interval isolates what the harness adds per step.

per-step cost
    The most precise figure: the same A/B alternation on a trivial model (Linear(4, 2), 8
    samples, one thread), where a step takes tens of microseconds and the harness's own
    work (clock marks, the disabled GradScaler, the kept loss) is a large share. Its cost
    in microseconds, set against the bare loop's step time on the benchmark model, gives
    the throughput ratio that cost implies: bare_step / (bare_step + cost). The same process
    also times the step clock alone (its marks, no step), and on CUDA one event recorded
    fresh and one recorded again: where the harness's cost goes.

On a GPU, ``--device cuda`` runs all three on CUDA: the bare loop moves each batch to the
device as the harness does, and synchronizes the device before each clock read, as any honest
loop must (the harness's timed window does the same).

Run:  python benchmarks/overhead.py [--model mlp] [--rounds 10] [--device cpu|cuda]
      [--json benchmarks/results/overhead-mlp.json]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _bare_setup(model_name: str, batch_size: int, seed: int, device):
    import torch

    from workbench.block import seed_everything
    from workbench.data import endless_batches, resolve_data
    from workbench.models import build_model
    from workbench.worker import _initialize_runtime

    _initialize_runtime(device)  # the harness pays this outside its clock too
    seed_everything(seed)
    source = resolve_data(None, model_name)
    model = build_model(model_name, source.spec).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = endless_batches(source, batch_size, seed, {})
    return model, optimizer, batches


def _synchronize(device) -> None:
    # torch's own call, as a person would write it, rather than workbench.devices.synchronize:
    # the bare loop runs no workbench code inside its window.
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_window(model, optimizer, batches, steps: int, device) -> float:
    """The loop a person would write. Nothing of workbench runs between the clock reads."""
    import torch.nn.functional as F

    _synchronize(device)  # work queued before the window is not the window's
    t0 = time.perf_counter()
    for _ in range(steps):
        inputs, targets = next(batches)
        inputs, targets = inputs.to(device), targets.to(device)  # a no-op on the CPU
        outputs = model(inputs)
        loss = (
            F.cross_entropy(outputs.flatten(0, -2), targets.flatten())
            if outputs.dim() > 2
            else F.cross_entropy(outputs, targets)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _synchronize(device)  # the window ends when the GPU has done its work, not when it was queued
    return time.perf_counter() - t0


def run_bare_process(args) -> None:
    """Child mode for end-to-end rounds: warm up, time one window, print samples/s as JSON."""
    device = _device(args)
    model, optimizer, batches = _bare_setup(args.model, args.batch_size, 0, device)
    bare_window(model, optimizer, batches, args.warmup, device)
    wall = bare_window(model, optimizer, batches, args.steps, device)
    print(json.dumps({"samples_per_s": args.steps * args.batch_size / wall}))


def run_paired_process(args) -> None:
    """Child mode for in-process rounds: alternate bare and harness windows on one model."""

    from workbench.block import timed_window
    from workbench.loop import Trainer, TrainSetup, default_loss
    from workbench.telemetry import StepClock

    device = _device(args)
    model, optimizer, batches = _bare_setup(args.model, args.batch_size, 0, device)
    setup = TrainSetup(model=model, device=device, loss_fn=default_loss, make_optimizer=lambda _: optimizer)
    trainer = Trainer(setup, batches)
    bare_window(model, optimizer, batches, args.warmup, device)
    ratios = []
    for pair in range(args.pairs):
        order = ("bare", "harness") if pair % 2 == 0 else ("harness", "bare")
        walls = {}
        for kind in order:
            if kind == "bare":
                walls[kind] = bare_window(model, optimizer, batches, args.steps, device)
            else:
                walls[kind] = timed_window(trainer, StepClock(device), args.steps, [])
        ratios.append(walls["bare"] / walls["harness"])  # harness throughput / bare throughput
    print(json.dumps({"ratios": ratios}))


def run_cost_process(args) -> None:
    """Child mode: microseconds the harness adds per step, on a model too small to hide them."""
    import torch

    from workbench.block import timed_window
    from workbench.loop import Trainer, TrainSetup, default_loss
    from workbench.telemetry import StepClock

    device = _device(args)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (torch.randn(8, 4, device=device), torch.randint(0, 2, (8,), device=device))

    class SameBatch:
        def __next__(self):
            return batch

    batches = SameBatch()
    setup = TrainSetup(model=model, device=device, loss_fn=default_loss, make_optimizer=lambda _: optimizer)
    trainer = Trainer(setup, batches)
    steps = args.cost_steps
    bare_window(model, optimizer, batches, steps, device)
    timed_window(trainer, StepClock(device), steps, [])
    bare, harness = [], []
    for _ in range(10):
        bare.append(bare_window(model, optimizer, batches, steps, device) / steps)
        harness.append(timed_window(trainer, StepClock(device), steps, []) / steps)
    print(
        json.dumps(
            {
                "cost_us": 1e6 * (float(np.median(harness)) - float(np.median(bare))),
                "bare_us": 1e6 * float(np.median(bare)),
                **_clock_costs_us(device, steps),
            }
        )
    )


def _clock_costs_us(device, steps: int) -> dict:
    """What the step clock alone costs the CPU per step, with no step around it; on CUDA also
    one event recorded fresh (a new torch.cuda.Event each time) and one recorded again."""
    import torch

    from workbench.telemetry import StepClock

    def per_call_us(call, calls: int) -> float:
        _synchronize(device)
        started = time.perf_counter()
        for _ in range(calls):
            call()
        _synchronize(device)
        return 1e6 * (time.perf_counter() - started) / calls

    clock = StepClock(device)

    def clock_step():
        clock.start()
        for phase in ("data", "forward", "backward", "optimizer"):
            clock.lap(phase)
        clock.stop()

    costs = {}
    for _ in range(2):  # the first pass creates the clock's events; the second is what a window pays
        costs["clock_step_us"] = per_call_us(clock_step, steps)
        clock.resolve()
    if device.type != "cuda":
        return costs
    event = torch.cuda.Event(enable_timing=True)
    costs["fresh_event_us"] = per_call_us(lambda: torch.cuda.Event(enable_timing=True).record(), steps)
    costs["reused_event_us"] = per_call_us(event.record, steps)
    return costs


def run_step_time_process(args) -> None:
    """Child mode: the bare loop's step time on the benchmark model."""
    device = _device(args)
    model, optimizer, batches = _bare_setup(args.model, args.batch_size, 0, device)
    bare_window(model, optimizer, batches, args.warmup, device)
    walls = [bare_window(model, optimizer, batches, args.steps, device) / args.steps for _ in range(3)]
    print(json.dumps({"step_us": 1e6 * float(np.median(walls))}))


def _device(args):
    import torch

    return torch.device(args.device)


def _child(mode: str, args) -> dict:
    command = [
        sys.executable,
        __file__,
        mode,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--pairs",
        str(args.pairs),
        "--device",
        args.device,
        "--cost-steps",
        str(args.cost_steps),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _harness_round(args) -> float:
    import workbench as wb

    res = wb.ablate(
        model=args.model,
        techniques={},
        steps=args.steps,
        warmup=args.warmup,
        blocks=1,
        batch_size=args.batch_size,
        device=args.device,
        control=False,
        out=False,
        progress=False,
    )
    return float(res.table.samples_per_s.iloc[0])


def _interval(log_ratios: list[float]) -> tuple[float, float, float]:
    from workbench.stats import t_quantile

    values = np.asarray(log_ratios)
    half = t_quantile(0.95, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return math.exp(values.mean()), math.exp(values.mean() - half), math.exp(values.mean() + half)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode",
        nargs="?",
        default="compare",
        choices=["compare", "bare-child", "paired-child", "cost-child", "step-time-child"],
    )
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=8, help="A/B window pairs per in-process round")
    parser.add_argument(
        "--cost-steps", type=int, default=5000, help="steps per window of the trivial model (per-step cost)"
    )
    parser.add_argument(
        "--cost-processes", type=int, default=3,
        help="fresh processes for the per-step cost and for the model's step time (the median is kept)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both loops run")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    for name, least in (("rounds", 2), ("pairs", 1), ("steps", 1), ("cost_steps", 1), ("cost_processes", 1)):
        if getattr(args, name) < least:  # two rounds at least: an interval needs two
            parser.error(f"--{name.replace('_', '-')} must be at least {least}; got {getattr(args, name)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA device; torch sees none here (use --device cpu)")
    if args.mode.endswith("-child"):
        from workbench.heap import hold_heap_steady

        hold_heap_steady()  # the same C heap settings as the harness's workers (workbench.heap)
    if args.mode == "bare-child":
        return run_bare_process(args)
    if args.mode == "paired-child":
        return run_paired_process(args)
    if args.mode == "cost-child":
        return run_cost_process(args)
    if args.mode == "step-time-child":
        return run_step_time_process(args)

    started = time.time()
    end_to_end, in_process = [], []
    for index in range(args.rounds):
        order = ("bare", "harness") if index % 2 == 0 else ("harness", "bare")
        rates = {}
        for kind in order:
            rates[kind] = (
                _child("bare-child", args)["samples_per_s"] if kind == "bare" else _harness_round(args)
            )
        end_to_end.append(math.log(rates["harness"] / rates["bare"]))
        ratios = _child("paired-child", args)["ratios"]
        in_process.append(float(np.mean(np.log(ratios))))  # one value per process: pairs within it correlate
        print(
            f"round {index + 1}/{args.rounds}: end-to-end {rates['harness'] / rates['bare']:.3f}, "
            f"in-process {math.exp(in_process[-1]):.4f}",
            flush=True,
        )
        # After each round, what is measured so far: a run stopped at a time limit keeps it.
        _write(args, _report(args, started, end_to_end, in_process))
    costs = [_child("cost-child", args) for _ in range(args.cost_processes)]
    cost_us = float(np.median([c["cost_us"] for c in costs]))
    step_us = float(
        np.median([_child("step-time-child", args)["step_us"] for _ in range(args.cost_processes)])
    )
    implied = step_us / (step_us + cost_us)
    per_step_cost = {
        "harness_cost_us": cost_us,
        "trivial_bare_step_us": float(np.median([c["bare_us"] for c in costs])),
        "model_bare_step_us": step_us,
        "implied_ratio": implied,
        # Where the harness's cost goes: its step clock alone, and on CUDA one event's record.
        **{
            key: float(np.median([c[key] for c in costs]))
            for key in costs[0]
            if key not in ("cost_us", "bare_us")
        },
    }
    report = _report(args, started, end_to_end, in_process, per_step_cost)
    e2e, paired = report["end_to_end"], report["in_process"]
    print(f"\nharness / bare-loop throughput, {args.model}, {args.rounds} rounds (95% paired t-intervals):")
    print(f"  end-to-end (fresh processes): {e2e['ratio']:.3f} [{e2e['low']:.3f}, {e2e['high']:.3f}]")
    print(
        f"  in-process (A/B windows):     {paired['ratio']:.4f} [{paired['low']:.4f}, {paired['high']:.4f}]"
    )
    print(
        f"  per-step cost: the harness adds {cost_us:.1f} us to a step; the bare {args.model} step takes "
        f"{step_us:.0f} us, so the implied ratio is {implied:.4f}"
    )
    clock_costs = f"  of which the step clock alone: {per_step_cost['clock_step_us']:.1f} us"
    if "fresh_event_us" in per_step_cost:
        clock_costs += (
            f"; one CUDA event recorded: {per_step_cost['fresh_event_us']:.1f} us made fresh, "
            f"{per_step_cost['reused_event_us']:.1f} us recorded again"
        )
    print(clock_costs)
    _write(args, report)


def _report(
    args, started: float, end_to_end: list, in_process: list, per_step_cost: dict | None = None
) -> dict:
    """The figures so far; ``complete`` once every round and the per-step cost are in."""
    from workbench.environment import machine_summary

    def interval(log_ratios: list) -> dict:
        if len(log_ratios) < 2:  # one round has a ratio but no interval
            return {"ratio": math.exp(log_ratios[0]), "low": None, "high": None}
        ratio, low, high = _interval(log_ratios)
        return {"ratio": ratio, "low": low, "high": high}

    return {
        "benchmark": "overhead",
        "model": args.model,
        "device": args.device,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "rounds_done": len(in_process),
        "complete": per_step_cost is not None,
        "pairs_per_round": args.pairs,
        "end_to_end": interval(end_to_end),
        "in_process": interval(in_process),
        "in_process_by_round": [math.exp(value) for value in in_process],
        "per_step_cost": per_step_cost,
        "machine": machine_summary(),
        "wall_s": time.time() - started,
    }


def _write(args, report: dict) -> None:
    if args.json:
        from workbench.results_folder import write_json_atomic

        write_json_atomic(Path(args.json), report)


if __name__ == "__main__":
    main()
