"""The results figure: speedup with interval whiskers, step-time breakdown, peak memory.

Built on matplotlib's object API (``Figure``), never pyplot's global state, so it is safe
from threads and shows once in a notebook (returned, not also auto-displayed).
"""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib.figure import Figure


class ResultsFigure(Figure):
    """A Figure that renders itself in notebooks, with no pyplot state behind it."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=90)
        return buffer.getvalue()


PHASE_COLORS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "optimizer": "#55a868",
    "replay": "#8172b3",  # cuda_graphs: forward, backward and optimizer as one graph replay
}
STATUS_COLORS = {"ok": "#4c72b0", "diverged": "#c44e52", "interrupted": "#b0b0b0"}


def plot_results(results) -> ResultsFigure:
    table = results.table.iloc[::-1].reset_index(drop=True)  # first arm at the top
    labels = list(table.arm)
    y = np.arange(len(table))
    figure = ResultsFigure(figsize=(13, 1.2 + 0.42 * len(table)), layout="constrained")
    speed_ax, phase_ax, memory_ax = figure.subplots(1, 3, sharey=True, width_ratios=[1.2, 1.2, 0.8])

    # Speedup: point and 95% interval per arm; rows that did not run say why.
    measured = table.speedup.notna()
    colors = [STATUS_COLORS.get(s, "#c44e52") for s in table.status]
    speed_ax.barh(
        y[measured],
        table.speedup[measured] - 1,
        left=1,
        color=[colors[i] for i in y[measured]],
        alpha=0.35,
        height=0.6,
    )
    speed_ax.errorbar(
        table.speedup[measured],
        y[measured],
        xerr=[
            table.speedup[measured] - table.speedup_low[measured],
            table.speedup_high[measured] - table.speedup[measured],
        ],
        fmt="o",
        color="black",
        capsize=3,
        markersize=4,
    )
    speed_ax.axvline(1.0, color="black", linewidth=0.8)
    for index in y[~measured]:
        speed_ax.text(
            1.0, index, f"  {table.status[index]}", va="center", ha="left", color="#c44e52", fontsize=9
        )
    speed_ax.set_xlabel("speedup vs baseline (95% interval)")
    speed_ax.set_yticks(y, labels)
    speed_ax.set_title("Throughput")

    # Step breakdown: where the time of one optimizer step goes.
    left = np.zeros(len(table))
    for phase, color in PHASE_COLORS.items():
        values = table[f"{phase}_ms"].fillna(0).to_numpy()
        phase_ax.barh(y, values, left=left, color=color, label=phase, height=0.6)
        left += values
    other = np.clip(table.step_ms.fillna(0).to_numpy() - left, 0, None)
    phase_ax.barh(y, other, left=left, color="#e0e0e0", label="other", height=0.6)
    phase_ax.set_xlabel("ms per optimizer step")
    phase_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=5, fontsize=8, frameon=False)
    phase_ax.set_title("Step breakdown")

    memory = table.peak_mem_mb.to_numpy(dtype=float)
    memory_ax.barh(y, np.nan_to_num(memory), color="#8172b3", height=0.6)
    for index, value in enumerate(memory):
        if math.isfinite(value):
            memory_ax.text(value, index, f" {value:.0f}", va="center", fontsize=8)
    device = results.config.get("device", "")
    memory_ax.set_xlabel("peak tensor memory per step, MiB")
    memory_ax.set_title("Memory")

    env = results.environment
    where = ", ".join(env.get("gpus") or []) if device.startswith("cuda") else env.get("cpu", "")
    config = results.config
    figure.suptitle(
        f"{config['model']} on {config['data']}, {config['mode']}: {config['steps']} steps per arm x "
        f"{config.get('blocks', config.get('repeats'))} blocks, batch {config['batch_size']}, {device} ({where})",
        fontsize=10,
    )
    return figure


def _arm_colors(arms: list[str]) -> dict[str, tuple]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return {arm: palette(index % 10) for index, arm in enumerate(arms)}


def plot_live(snapshot: dict) -> ResultsFigure:
    """The panel's live view of a running ablation (a LiveRun snapshot): throughput over time,
    step breakdown and loss curves per arm, and machine utilization (CPU; GPU through NVML)."""
    figure = ResultsFigure(figsize=(13, 6), layout="constrained")
    (speed_ax, phase_ax, loss_ax), (cpu_ax, gpu_ax, gpu_detail_ax) = figure.subplots(2, 3)
    arms = snapshot["arms"] or sorted(snapshot["throughput"])
    colors = _arm_colors(arms)
    started = snapshot["started"]

    for arm, points in snapshot["throughput"].items():
        # One line per block: between blocks a new process starts, and nothing was measured.
        for index, block in enumerate(dict.fromkeys(point[2] for point in points)):
            seconds = [point[0] for point in points if point[2] == block]
            rates = [point[1] for point in points if point[2] == block]
            speed_ax.plot(
                seconds, rates, "o-", markersize=3, color=colors.get(arm), label=arm if index == 0 else None
            )
    speed_ax.set_title("Throughput while running")
    speed_ax.set_xlabel("seconds since start")
    speed_ax.set_ylabel("samples/s")
    if snapshot["throughput"]:
        speed_ax.legend(fontsize=7, frameon=False)

    finished = [unit for unit in snapshot["finished"] if unit.get("result")]
    per_arm: dict[str, list[dict]] = {}
    for unit in finished:
        per_arm.setdefault(unit["arm"], []).append(unit["result"])
    names = [arm for arm in arms if arm in per_arm]
    left = np.zeros(len(names))
    for phase, color in PHASE_COLORS.items():
        values = np.array([np.median([r["phase_ms"].get(phase, 0.0) for r in per_arm[arm]]) for arm in names])
        phase_ax.barh(names, values, left=left, color=color, label=phase, height=0.6)
        left += values
    phase_ax.invert_yaxis()
    phase_ax.set_title("Step breakdown (finished blocks)")
    phase_ax.set_xlabel("ms per optimizer step")
    if names:
        phase_ax.legend(fontsize=7, frameon=False, ncol=2)

    for unit in finished:
        loss_ax.plot(
            range(1, len(unit["result"]["losses"]) + 1),
            unit["result"]["losses"],
            color=colors.get(unit["arm"]),
            alpha=0.7,
            linewidth=1,
        )
    loss_ax.set_title("Loss (finished blocks)")
    loss_ax.set_xlabel("optimizer step, warm-up included")

    samples = snapshot["telemetry"]
    seconds = [s["time"] - started for s in samples]
    cpu_ax.plot(seconds, [s["cpu_percent"] for s in samples], color="#4c72b0")
    cpu_ax.set_ylim(0, 105)
    cpu_ax.set_title("CPU utilization (whole machine)")
    cpu_ax.set_ylabel("%")
    cpu_ax.set_xlabel("seconds since start")

    gpu_keys = sorted(
        {key for s in samples for key in s if key.startswith("gpu") and key.endswith("_util_percent")}
    )
    if gpu_keys:
        for key in gpu_keys:
            index = key[3 : key.index("_")]
            gpu_ax.plot(seconds, [s.get(key, np.nan) for s in samples], label=f"GPU {index} util %")
            gpu_ax.plot(
                seconds,
                [s.get(f"gpu{index}_memory_used_mib", np.nan) / 1024 for s in samples],
                "--",
                label=f"GPU {index} memory, GiB",
            )
            gpu_detail_ax.plot(
                seconds, [s.get(f"gpu{index}_power_w", np.nan) for s in samples], label=f"GPU {index} W"
            )
            gpu_detail_ax.plot(
                seconds,
                [s.get(f"gpu{index}_sm_clock_mhz", np.nan) / 10 for s in samples],
                ":",
                label=f"GPU {index} SM clock, x10 MHz",
            )
        gpu_ax.legend(fontsize=7, frameon=False)
        gpu_detail_ax.legend(fontsize=7, frameon=False)
        gpu_ax.set_title("GPU utilization and memory (NVML)")
        gpu_detail_ax.set_title("GPU power and SM clock (NVML)")
    else:
        gpu_ax.plot(seconds, [s["memory_used_mib"] / 1024 for s in samples], color="#8172b3")
        gpu_ax.set_title("Memory used (whole machine)")
        gpu_ax.set_ylabel("GiB")
        gpu_detail_ax.axis("off")
        gpu_detail_ax.text(
            0.5,
            0.5,
            "No GPU telemetry: NVML readings of GPU\nutilization, memory, power and SM clock\n"
            "appear here on a CUDA machine\nwith nvidia-ml-py installed.",
            ha="center",
            va="center",
            fontsize=9,
            color="#666",
        )
    for axes in (gpu_ax, gpu_detail_ax):
        axes.set_xlabel("seconds since start")

    figure.suptitle(
        f"{snapshot['state']}: {snapshot['processes_done']} of {snapshot['processes'] or '?'} processes finished"
        + (f"; now {snapshot['current']}" if snapshot["state"] == "running" and snapshot["current"] else ""),
        fontsize=10,
    )
    return figure
