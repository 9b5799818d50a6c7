"""MFU arithmetic, FLOP counting, the peak table, and the per-arm GPU columns (all on CPU)."""

import math

import pytest
import torch

from workbench.data import resolve_data
from workbench.environment import format_environment
from workbench.loop import default_loss
from workbench.mfu import compute_dtype, count_flops
from workbench.models import build_model
from workbench.peak_flops import achieved_tflops, mfu_percent, peak_tflops
from workbench.results import summarize


@pytest.mark.parametrize(
    "device_name,dtype,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),  # SXM
        ("NVIDIA H100 PCIe", "bfloat16", 756.0),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "float16", 312.0),  # "A100", not the "A10" row
        ("NVIDIA A10", "float32", 31.2),
        ("NVIDIA L40S", "bfloat16", 362.0),  # "L40S", not the "L4" row
        ("NVIDIA L4", "bfloat16", 121.0),
    ],
)
def test_peak_table_lookup(device_name, dtype, peak):
    assert peak_tflops(device_name, dtype)[0] == peak


def test_peak_lookup_says_why_not():
    assert peak_tflops("Tesla V100-SXM2-16GB", "bfloat16") == (
        None,
        "V100 has no bfloat16 tensor-core peak in the table",
    )
    value, reason = peak_tflops("NVIDIA GeForce RTX 9090", "bfloat16")
    assert value is None and "add one to get MFU" in reason


def test_mfu_arithmetic():
    # 1 GFLOP per sample at 100,000 samples/s is 100 TFLOP/s: a tenth of a 1000 TFLOP/s GPU, a twentieth of two.
    assert achieved_tflops(1e9, 1e5) == pytest.approx(100.0)
    assert mfu_percent(100.0, 1000.0) == pytest.approx(10.0)
    assert mfu_percent(100.0, 1000.0, gpus=2) == pytest.approx(5.0)


def test_flops_of_the_mlp_match_the_formula():
    """A Linear does 2*B*in*out FLOPs forward and twice that backward (input and weight gradients);
    the stem's input needs no gradient, so its backward is half of that."""
    spec = resolve_data(None, "mlp").spec
    batch, width = 16, 256
    inputs, targets = torch.zeros((batch, *spec.shape)), torch.zeros(batch, dtype=torch.long)
    flops = count_flops(lambda: build_model("mlp", spec), inputs, targets, default_loss)
    in_features = math.prod(spec.shape)
    expected = 6 * batch * (4 * width * width + width * spec.num_classes) + 4 * batch * in_features * width
    assert flops == expected


def test_flop_counting_leaves_no_real_memory_behind():
    spec = resolve_data(None, "gpt-mini").spec
    tokens = torch.zeros((4, *spec.shape), dtype=torch.long)
    flops = count_flops(lambda: build_model("gpt-mini", spec), tokens, tokens, default_loss)
    assert flops > 0  # the model and batch lived on the meta device: nothing was computed


def test_compute_dtype():
    model = torch.nn.Linear(2, 2)
    assert compute_dtype(model, torch.bfloat16) == "bfloat16"
    assert compute_dtype(model, None) == "float32"
    assert compute_dtype(model.half(), None) == "float16"


def _unit(arm, block, samples_per_s, start, device_name="NVIDIA H100 80GB HBM3"):
    return {
        "arm": arm,
        "block": block,
        "status": "ok",
        "result": {
            "samples_per_s": samples_per_s,
            "wall_s": 1.0,
            "steps": 10,
            "samples": samples_per_s,
            "step_s": [0.1] * 10,
            # one timed window of this arm, [start, start + 10]
            "windows": [{"round": 0, "steps": 10, "start": start, "end": start + 10, "step_s": [0.1] * 10}],
            "phase_ms": {"data": 1.0, "forward": 2.0, "backward": 3.0, "optimizer": 4.0, "replay": 0.0},
            "peak_mem_mib": 100.0,
            "peak_rss_mib": 100.0,
            "startup_s": 1.0,
            "cpu_util_pct": 50.0,
            "losses": [1.0] * 12,
            "notes": [],
            "flops_per_sample": 1e9,
            "compute_dtype": "bfloat16",
            "device_name": device_name,
            "nvml_gpus": [1],
        },
    }


def test_summary_computes_tflops_mfu_and_gpu_readings_per_arm():
    arms = [
        {"name": "baseline", "role": "baseline", "techniques": "none"},
        {"name": "amp", "role": "treatment", "techniques": "amp"},
    ]
    units = [_unit("baseline", 0, 1e5, 0.0), _unit("amp", 0, 2e5, 100.0)]
    telemetry = [  # GPU 1 is the run's; GPU 0 belongs to someone else and must be ignored
        {
            "time": 5.0,
            "gpu0_util_percent": 1.0,
            "gpu1_util_percent": 40.0,
            "gpu1_power_w": 300.0,
            "gpu1_sm_clock_mhz": 1800.0,
        },
        {"time": 105.0, "gpu1_util_percent": 90.0, "gpu1_power_w": 600.0, "gpu1_sm_clock_mhz": 1900.0},
        {"time": 107.0, "gpu1_util_percent": 100.0, "gpu1_power_w": 650.0, "gpu1_sm_clock_mhz": 1700.0},
        {"time": 50.0, "gpu1_util_percent": 0.0},  # between the windows: no arm's
    ]
    base, amp = summarize(arms, units, planned_blocks=1, complete=True, telemetry=telemetry)
    assert base["tflops"] == pytest.approx(100.0) and amp["tflops"] == pytest.approx(200.0)
    assert amp["mfu_pct"] == pytest.approx(100 * 200 / 989.4)
    assert base["gpu_util_pct"] == 40.0 and amp["gpu_util_pct"] == 95.0
    assert amp["gpu_power_w"] == 625.0 and amp["sm_clock_mhz"] == 1800.0


def test_summary_on_cpu_has_tflops_but_no_mfu():
    arms = [{"name": "baseline", "role": "baseline", "techniques": "none"}]
    unit = _unit("baseline", 0, 1e5, 0.0, device_name="cpu")
    unit["result"]["nvml_gpus"] = []
    (row,) = summarize(arms, [unit], planned_blocks=1, complete=True, telemetry=[])
    assert row["tflops"] == pytest.approx(100.0)
    assert math.isnan(row["mfu_pct"]) and math.isnan(row["gpu_util_pct"])


def test_summary_says_when_the_gpu_has_no_peak():
    arms = [{"name": "baseline", "role": "baseline", "techniques": "none"}]
    (row,) = summarize(arms, [_unit("baseline", 0, 1e5, 0.0, "NVIDIA Mystery")], 1, True, [])
    assert math.isnan(row["mfu_pct"]) and "no MFU: no peak for 'NVIDIA Mystery'" in row["notes"]


def test_environment_gpu_line():
    env = {
        "workbench": "0",
        "python": "3.11",
        "platform": "linux",
        "cpu": "x",
        "usable_cores": 16,
        "logical_cores": 16,
        "torch": "2.13",
        "torch_threads": 16,
        "cupy": None,
        "dali": None,
        "cuda_available": True,
        "cuda_version": "13.0",
        "cudnn_version": 91000,
        "driver_version": "580",
        "gpus": ["NVIDIA H100 80GB HBM3"],
        "capability": "9.0",
        "gpu_memory_gib": 79.1,
    }
    line = next(line for line in format_environment(env).splitlines() if line.startswith("gpu "))
    assert line == (
        "gpu       NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.1 GiB; "
        "dense peak TFLOP/s: bfloat16 989.4, float16 989.4, tf32 494.7, float32 67)"
    )


def test_every_cpu_run_reports_its_flops():
    from helpers import train

    result = train("mlp", {"amp": {"dtype": "bfloat16"}}, steps=2, warmup=1, batch_size=16)
    spec = resolve_data(None, "mlp").spec
    inputs, targets = torch.zeros((16, *spec.shape)), torch.zeros(16, dtype=torch.long)
    per_sample = count_flops(lambda: build_model("mlp", spec), inputs, targets, default_loss) / 16
    assert result["flops_per_sample"] == per_sample
    assert (
        result["compute_dtype"] == "bfloat16" and result["device_name"] == "cpu" and result["nvml_gpus"] == []
    )


class NeedsRealData(torch.nn.Module):
    """Reads a value in its forward: it cannot run on the meta device (as Hugging Face's masks)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x):
        if x.sum().item() > 1e9:
            raise AssertionError
        return self.linear(x.flatten(1))


def test_a_model_that_cannot_run_on_meta_is_counted_on_the_cpu():
    """Two samples for real on the CPU, scaled to the batch: the Linear's 2*64*10 per sample
    forward, as much again backward (the weight's gradient; the input needs none)."""
    from helpers import train

    batches = [(torch.randn(8, 64), torch.randint(0, 10, (8,)))] * 4
    result = train(NeedsRealData, steps=2, warmup=1, data=batches)
    assert result["flops_per_sample"] == pytest.approx(2 * 2 * 64 * 10)
    assert not any(note.startswith("FLOPs not counted") for note in result["notes"])


def test_a_model_that_cannot_be_counted_gets_a_note_not_a_failure():
    from helpers import train

    class NeedsAFullBatch(NeedsRealData):
        def forward(self, x):
            if x.shape[0] < 8:  # and cannot run on a few samples on the CPU either
                raise ValueError("needs the whole batch")
            return super().forward(x)

    batches = [(torch.randn(8, 64), torch.randint(0, 10, (8,)))] * 4
    result = train(NeedsAFullBatch, steps=2, warmup=1, data=batches)
    assert "flops_per_sample" not in result
    assert any(note.startswith("FLOPs not counted") for note in result["notes"])
