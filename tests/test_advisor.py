"""The advisor: it names the bottleneck of constructed jobs whose bottleneck is known, shows
its evidence in figures, and ranks what to try by the ceiling the measured shares allow."""

import json
import time

import pytest
import torch
from conftest import requires_cuda

import workbench as wb
from workbench.advisor import Facts, bound, build_advice, diagnose, suggestions
from workbench.devices import cpu_lacks_native
from workbench.profiling import summarize_events

EVERYTHING = {name: None for name in ("amp", "checkpointing", "compile", "dataloader", "grad_accum")}


def _facts(**changes) -> Facts:
    """A CPU step of 10 ms: 1 ms data, 3 ms overhead (it does not shrink with the batch), 6 ms work."""
    base = dict(
        device="cpu", step_ms=10.0, data_ms=1.0, comm_ms=0.0, overhead_ms=3.0, batch=16, half_batch_ms=5.0,
        full_batch_ms=7.0, busy_ms=6.0, matmul_ms=4.0, optimizer_ms=0.5,
        fp32_matmul_ms=0.0, forward_ms=3.0, ops=200.0, median_op_us=12.0, peak_mib=100.0,
        activation_mib=60.0, capacity_mib=1000.0, capacity_source="the run's memory cap", has_conv=False,
        world_size=1,
    )  # fmt: skip
    return Facts(**{**base, **changes})


def test_the_parts_add_up_to_the_step_and_the_largest_is_named():
    facts = _facts()
    assert sum(facts.parts_ms.values()) == pytest.approx(facts.step_ms)
    assert facts.parts_ms == {"data": 1.0, "launch": 3.0, "compute": 6.0, "communication": 0.0}
    assert diagnose(facts) == "compute"
    assert diagnose(_facts(overhead_ms=7.0, matmul_ms=1.0)) == "launch"
    assert diagnose(_facts(data_ms=7.0)) == "data"
    assert diagnose(_facts(peak_mib=850.0)) == "memory", "80% of the capacity is the limit, whatever the time"


def test_recommendations_are_ranked_by_their_ceiling_and_each_says_why():
    advice = build_advice(
        _facts(data_ms=0.5, overhead_ms=7.6, matmul_ms=1.5), EVERYTHING
    )  # launch: 7.6 of 10 ms
    assert advice.bottleneck == "launch"
    first = advice.recommendations.iloc[0]
    # compile takes the model, not the optimizer's step (0.5 ms): 7.1 of the 7.6 ms overhead.
    assert first.technique == "compile" and first.at_most == pytest.approx(bound(0.71))
    assert "71% of the step, outside the optimizer, does not grow with the batch" in first.why
    assert list(advice.recommended)[0] == "compile"
    ceilings = list(advice.recommendations[advice.recommendations.part == "launch"].at_most)
    assert ceilings == sorted(ceilings, reverse=True)
    rejected = advice.not_recommended.set_index("technique").why
    assert "memory is not the limit (peak 100 of 1,000 MiB, 10%)" in rejected["checkpointing"]
    assert "about 30% per step" in rejected["checkpointing"]  # the forward, recomputed: 3 of 10 ms
    assert "at most x1.05" in rejected["dataloader"]  # the data wait is 0.5 ms of 10
    assert "On a CPU" in advice.caveats[0]


def test_a_technique_for_two_parts_is_listed_for_its_higher_ceiling():
    """compile was listed at x1.07 for the compute part (the bottleneck's) although its ceiling on
    launch was x1.45: the tuner's pool follows that order."""
    advice = build_advice(_facts(data_ms=0.0, overhead_ms=4.0, matmul_ms=5.0), EVERYTHING)
    assert advice.bottleneck == "compute"
    compile_row = advice.recommendations.set_index("technique").loc["compile"]
    assert compile_row.part == "launch" and compile_row.at_most == pytest.approx(bound(0.35))


def test_a_split_of_launch_and_compute_that_was_not_measured_is_said_first():
    """At batch 1 the overhead was silently 0% (a verdict of compute for 311 operations of 4 us),
    and a half batch slower than the full one became 97% launch, without a word."""
    from workbench.advisor import _split_unknown

    assert _split_unknown({}).startswith("A batch of one sample cannot be halved")
    assert "(49.6 against 21.3 ms" in _split_unknown({"step_ms": 21.3, "half_batch_step_ms": 49.6})
    assert _split_unknown({"step_ms": 21.3, "half_batch_step_ms": 21.5}) == ""  # all fixed: launch-bound
    why = _split_unknown({})
    advice = build_advice(_facts(batch=1, overhead_ms=0.0, split_unknown=why), EVERYTHING)
    assert advice.caveats[0] == why
    rows = advice.evidence.set_index("figure")
    assert "step at batch 0" not in rows.index
    assert rows.loc["step at half the batch", "meaning"].startswith("not measured")


def test_a_memory_bound_job_with_no_remedy_for_memory_says_so_above_what_helps_elsewhere():
    advice = build_advice(_facts(peak_mib=900.0, activation_mib=1.0), EVERYTHING)
    assert advice.bottleneck == "memory" and not (advice.recommendations.part == "memory").any()
    said = " ".join(advice.summary().split())
    assert "nothing available here attacks this job's memory bottleneck; these help other parts" in said


def test_the_advice_as_text_wraps_its_reasons_and_speaks_the_command_lines_flags():
    """`workbench advise` printed each reason and caveat as one line of several hundred
    characters, with the API's keywords ("threads=1") where the user had typed flags."""
    from workbench.cli import _parser, in_cli_terms

    advice = build_advice(_facts(data_ms=0.5, overhead_ms=7.6, matmul_ms=1.5), EVERYTHING)
    advice.caveats.append("other processes ran; compare at one thread (threads=1)")
    advice.caveats.append("a flag or a path is never cut at its hyphen: " + "--data jpeg-folder:PATH " * 9)
    args = _parser().parse_args(["advise"])
    text = advice.summary(80, spell=lambda message: in_cli_terms(message, args))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not any(line.endswith("-") for line in text.splitlines()), text
    assert "(--threads 1)" in text and "threads=1" not in text
    said = " ".join(text.split())  # every reason is still there, whatever its line breaks
    for why in [*advice.recommendations.why, *advice.not_recommended.why]:
        assert " ".join(why.split()) in said
    unwrapped = advice.summary()  # the notebook's <pre>: as it always was
    assert "(threads=1)" in unwrapped and any(len(line) > 80 for line in unwrapped.splitlines())


def test_dataloader_workers_fit_the_cores_this_job_may_use(monkeypatch):
    facts = _facts(data_ms=7.0)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)  # taskset to 2 cores
    by_technique = {s.technique: s for s in suggestions(facts, EVERYTHING)}
    assert by_technique["dataloader"].settings["num_workers"] == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    by_technique = {s.technique: s for s in suggestions(facts, EVERYTHING)}
    assert by_technique["dataloader"].settings["num_workers"] == 4


def test_workers_are_weighed_by_the_feed_measured_after_the_run_not_by_amdahl_alone():
    """An in-memory Dataset on 2 cores: the step waited 35% of the time for data, Amdahl's
    bound said x1.53, and dataloader num_workers=1 then measured 0.30x: handing a batch over
    from a worker cost the step more than loading it in-process did."""
    in_memory = (
        {"workers": 1, "feed_ms": 4.2, "taking_ms": 1.7},
        {"workers": 2, "feed_ms": 2.5, "taking_ms": 1.3},
        {"workers": 4, "feed_ms": 2.2, "taking_ms": 1.2},
    )
    advice = build_advice(
        _facts(step_ms=1.8, data_ms=0.63, overhead_ms=1.0, loader_feeds=in_memory), EVERYTHING
    )
    assert "dataloader" not in advice.recommended
    why = advice.not_recommended.set_index("technique").why["dataloader"]
    # the best count is 4: the step would take max(1.17 + 1.2, 2.2) = 2.37 ms of 1.8
    assert "with 4 workers the loader alone delivers a batch every 2.20 ms" in why
    assert "taking one costs the step 1.20 ms" in why and "at most x0.76, slower than without it" in why
    slow_storage = (
        {"workers": 1, "feed_ms": 48.0, "taking_ms": 1.8},
        {"workers": 2, "feed_ms": 28.0, "taking_ms": 1.9},
        {"workers": 4, "feed_ms": 15.8, "taking_ms": 2.7},
    )
    facts = _facts(step_ms=50.0, data_ms=45.0, overhead_ms=1.0, loader_feeds=slow_storage)
    (dataloader,) = [s for s in suggestions(facts, EVERYTHING) if s.technique == "dataloader"]
    assert dataloader.settings["num_workers"] == 4 and dataloader.at_most == pytest.approx(50.0 / 15.8)
    without = [
        s for s in suggestions(_facts(step_ms=50.0, data_ms=45.0), EVERYTHING) if s.technique == "dataloader"
    ]
    assert without[0].at_most == pytest.approx(bound(0.9))  # no probe: Amdahl's bound on the wait
    failed = ({"workers": 1, "error": "RuntimeError: cannot pickle '_io.BufferedReader' object"},)
    advice = build_advice(_facts(step_ms=50.0, data_ms=45.0, loader_feeds=failed), EVERYTHING)
    assert advice.bottleneck == "data" and "dataloader" not in advice.recommended
    why = advice.not_recommended.set_index("technique").why["dataloader"]
    assert why.endswith("but DataLoader workers could not load this Dataset (RuntimeError: cannot pickle "
                        "'_io.BufferedReader' object)")  # fmt: skip


def test_the_loader_probe_measures_and_leaves_no_worker_behind():
    import multiprocessing

    from workbench.data import loader_feed, resolve_data

    source = resolve_data(torch.utils.data.TensorDataset(torch.randn(256, 8), torch.zeros(256)), lambda: None)
    for workers in (0, 2):
        fed = loader_feed(source, 16, 0, workers, budget_s=0.05)
        assert fed["workers"] == workers and fed["feed_ms"] > 0 and fed["taking_ms"] >= 0
    assert multiprocessing.active_children() == []


class _SlowToRead(torch.utils.data.Dataset):
    """A Dataset that takes a millisecond per sample: the step waits for it most of the time."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        time.sleep(0.001)
        return torch.randn(8), index % 4


def test_only_the_baseline_probes_the_loader_for_the_advisor():
    """The advisor reads the baseline's facts; a probe in every other arm cost seconds each."""
    from helpers import block_spec

    from workbench.worker import run_block

    spec = block_spec(
        lambda: torch.nn.Linear(8, 4),
        arms={"baseline": {}, "amp": {"amp": {}}},
        data=_SlowToRead(),
        profile_steps=1,
    )
    arms = run_block(spec)["arms"]
    assert [feed["workers"] for feed in arms["baseline"]["profile"]["loader_feeds"]] == [1, 2, 4]
    assert arms["amp"]["profile"]["loader_feeds"] == []


class _NotInAWorker(_SlowToRead):
    """Loads in the training process only, like a Dataset holding an open file handle."""

    def __getitem__(self, index):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("this handle does not survive a fork")
        return super().__getitem__(index)


def test_a_dataset_workers_cannot_load_is_probed_without_failing_the_baseline():
    """The probe is the advisor's, not the user's: a Dataset that fails in a worker process says
    so in the probe's record, and the baseline keeps its measurement."""
    from helpers import arm_result, block_spec

    from workbench.worker import run_block

    spec = block_spec(
        lambda: torch.nn.Linear(8, 4), arms={"baseline": {}}, data=_NotInAWorker(), profile_steps=1
    )
    baseline = arm_result(run_block(spec), "baseline")
    assert baseline["samples_per_s"] > 0
    (probe,) = baseline["profile"]["loader_feeds"]
    assert probe["workers"] == 1 and "this handle does not survive a fork" in probe["error"]
    # its type named once, and where it was raised
    assert (
        probe["error"] == "RuntimeError: this handle does not survive a fork (in DataLoader worker process 0)"
    )


def test_amp_is_not_suggested_for_speed_on_a_cpu_that_emulates_bfloat16():
    native = build_advice(_facts(), EVERYTHING)
    assert native.bottleneck == "compute" and "amp" in native.recommended
    reason = cpu_lacks_native("bfloat16", frozenset({"avx2", "fma"}), machine="x86_64")
    emulated = build_advice(_facts(emulated_bf16=reason), EVERYTHING)
    assert emulated.bottleneck == "compute" and "amp" not in emulated.recommended
    why = emulated.not_recommended.set_index("technique").why["amp"]
    assert "no bfloat16 instructions (AVX512-BF16 or AMX-BF16)" in why and "at most x1.00" in why
    # For memory it still halves the activations, and says what that costs in time here.
    memory = build_advice(
        _facts(peak_mib=900.0, activation_mib=400.0, emulated_bf16=reason), EVERYTHING
    ).recommendations
    assert "slower than float32" in memory.set_index("technique").why["amp"]


def test_a_remedy_for_the_bottleneck_with_no_headroom_is_not_recommended():
    # Launch-bound, but the optimizer's step is all of the overhead: compile, which takes only
    # the model's forward and backward, has nothing left to win (its ceiling is x1.00).
    advice = build_advice(_facts(data_ms=0.5, overhead_ms=7.6, matmul_ms=1.5, optimizer_ms=8.0), EVERYTHING)
    assert advice.bottleneck == "launch"
    assert "compile" not in advice.recommended
    assert "too little to be worth measuring" in advice.not_recommended.set_index("technique").why["compile"]


def test_memory_remedies_are_ranked_by_what_they_free_and_unavailable_ones_say_why():
    advice = build_advice(
        _facts(peak_mib=900.0, activation_mib=400.0), {**EVERYTHING, "checkpointing": "no repeated blocks"}
    )
    assert advice.bottleneck == "memory"
    memory = advice.recommendations[advice.recommendations.part == "memory"]
    assert list(memory.technique) == ["grad_accum", "amp"]  # checkpointing is unavailable here
    assert advice.not_recommended.set_index("technique").why["checkpointing"] == (
        "unavailable here: no repeated blocks"
    )
    # Strict JSON (no NaN: a figure that does not apply is null), which every JSON reader accepts.
    assert json.loads(json.dumps(advice.to_json(), default=str, allow_nan=False))["bottleneck"] == "memory"


def test_a_peak_of_weights_and_optimizer_state_gets_no_activation_remedy():
    """Memory is the limit, but activations are 8% of the peak: checkpointing, grad_accum and amp
    would free too little of it to be worth their time (once: "frees up to 0 MiB", ranked first)."""
    advice = build_advice(_facts(peak_mib=4.8, activation_mib=0.4, capacity_mib=5.0), EVERYTHING)
    assert advice.bottleneck == "memory"
    assert advice.recommendations[advice.recommendations.part == "memory"].empty
    assert not set(advice.recommended) & {"checkpointing", "grad_accum"}  # amp may still be there for speed
    why = advice.not_recommended.set_index("technique").why["checkpointing"]
    assert why.startswith("frees at most 0.3 MiB of the 4.8 MiB peak") and "optimizer state" in why


def test_amps_ceiling_counts_only_the_matmul_work_that_grows_with_the_batch():
    """Launch-bound: 4 of the 10 ms are matmuls, but only 0.4 ms grows with the batch."""
    facts = _facts(data_ms=0.5, overhead_ms=9.1, matmul_ms=4.0)
    amp = next(s for s in suggestions(facts, EVERYTHING) if s.technique == "amp")
    assert amp.at_most == pytest.approx(bound(0.04 / 2))
    assert "matmul/conv take 40% of the step, 4% in work that grows with the batch" in amp.why


def test_on_cuda_amps_ceiling_is_at_least_tf32s():
    """9 of 10 ms in fp32 matmul kernels without Tensor Cores: half precision runs them on
    Tensor Cores as tf32 does, so amp's "at most" is not the halving's 1.8x (an H100 measured
    amp at 1.95x on gpt-mini, above what halving could allow)."""
    facts = _facts(device="cuda", data_ms=0.2, overhead_ms=0.3, matmul_ms=9.0, fp32_matmul_ms=9.0)
    ceilings = {
        s.technique: s for s in suggestions(facts, {"amp": None, "tf32": None}) if s.part == "compute"
    }
    assert ceilings["amp"].at_most == pytest.approx(ceilings["tf32"].at_most) == pytest.approx(bound(0.9))
    assert "Tensor Cores" in ceilings["amp"].why
    bf16_already = _facts(device="cuda", matmul_ms=4.0, fp32_matmul_ms=0.0)  # no fp32 kernels: halving alone
    amp = next(s for s in suggestions(bf16_already, {"amp": None}) if s.part == "compute")
    assert amp.at_most == pytest.approx(bound(0.2)) and "Tensor Cores" not in amp.why


def test_the_fp32_matmul_share_is_scaled_as_the_matmul_share_and_never_exceeds_it():
    """The profiled step took 20 ms, the timed one 10: both matmul figures shrink by half; the
    fp32 part was left unscaled and read 60% of the step beside a matmul share of 30%."""
    from types import SimpleNamespace

    from workbench.advisor import facts_from

    profile = {
        "profiled_step_ms": 20.0, "kernel_ms": 15.0, "matmul_conv_kernel_ms": 6.0, "fp32_matmul_kernel_ms": 6.0,
        "kernels": 100, "median_kernel_us": 50.0, "batch_scaling": {},
    }  # fmt: skip
    result = {"step_s": [0.010] * 20, "wall_s": 0.2, "steps": 20, "peak_mem_mib": 100.0, "activation_mib": 10.0,
              "phase_ms": {"data": 0.1, "forward": 3.0, "backward": 6.0, "optimizer": 0.5}, "profile": profile}  # fmt: skip
    record = {
        "units": [{"arm": "baseline", "status": "ok", "result": result}],
        "environment": {"gpu_memory_gib": 80},
    }
    facts = facts_from(SimpleNamespace(record=record, warnings=lambda: []), "cuda", None)
    assert facts.matmul_ms == pytest.approx(3.0) and facts.fp32_matmul_ms == pytest.approx(3.0)


def test_the_profile_counts_dispatched_operations_and_matmul_time():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    batch = torch.randn(32, 64)

    def step():
        model(batch).sum().backward()

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            step()
    figures = summarize_events(profiler.events(), 3, no_work_us=1.0)
    # Forward: addmm, relu, addmm (linear is a composite that calls addmm), sum; then backward's ops.
    assert 4 <= figures["ops"] < 60
    assert 0 < figures["matmul_conv_ms"] <= figures["op_ms"]
    assert figures["op_overhead_ms"] <= figures["ops"] * 1e-3  # at most 1 us per operator
    assert figures["median_op_us"] > 0 and "kernels" not in figures


@pytest.mark.slow
@pytest.mark.timing
def test_a_data_starved_job_is_called_data_bound(tmp_path):
    class SlowDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, index):
            time.sleep(0.002)  # a slow decode: 32 ms per batch of 16
            return torch.randn(64), index % 10

    advice = wb.advise(
        lambda: torch.nn.Sequential(torch.nn.Linear(64, 10)), SlowDataset(), steps=20, warmup=2,
        batch_size=16, device="cpu", progress=False, trace_dir=str(tmp_path / "traces"),
    )  # fmt: skip
    assert advice.bottleneck == "data", advice.summary()
    assert advice.shares["data"] > 0.5  # the loading of the next batch overlaps the step in a thread
    assert list(advice.recommended)[0] == "dataloader"
    assert "(measured after the run)" in advice.recommendations.why[0]  # the loader probe's feed
    (trace,) = (tmp_path / "traces").glob("*.json")
    assert "traceEvents" in trace.read_text()[:2000]


@pytest.mark.slow
@pytest.mark.timing
def test_time_spent_loading_data_is_not_counted_as_launch_overhead():
    """The half batch was cut from a batch the loader had just made, so both step sizes paid the
    whole load: 2 t(b/2) - t(b) counted it as fixed, and a conv net whose step grows with its
    batch was called launch-bound, with 2% compute."""

    class SlowImages(torch.utils.data.Dataset):
        def __len__(self):
            return 512

        def __getitem__(self, index):
            time.sleep(0.001)  # a decode: 32 ms per batch of 32
            return torch.randn(3, 32, 32), index % 4

    def conv_net():
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3, padding=1),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 4),
        )  # fmt: skip

    advice = wb.advise(
        conv_net, SlowImages(), steps=10, warmup=2, batch_size=32, device="cpu", threads=1, progress=False
    )
    assert advice.shares["compute"] > advice.shares["launch"], advice.shares


def _tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )


@pytest.mark.slow
@pytest.mark.timing
def test_a_tiny_mlp_at_batch_8_is_launch_bound():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))] * 8
    phases = []
    advice = wb.advise(_tiny_mlp, batches, steps=100, warmup=5, batch_size=8, device="cpu", progress=False,
                       on_event=lambda event: phases.append(event.get("phase")) if event["type"] == "phase" else None)  # fmt: skip
    assert advice.bottleneck == "launch", advice.summary()
    assert list(advice.recommended)[0] == "compile"
    # The profile's seconds are said as such (the panel read "memory" all the while).
    assert phases[-2:] == ["memory", "profile"], phases


@pytest.mark.slow
@pytest.mark.timing
def test_gpt_mini_on_a_large_batch_is_compute_bound():
    # Compute or launch comes from the steps at batch 64 and at 32 that follow the profile (20 of
    # each, whatever the settings), not from the timed steps; one profiled step gives the matmul share.
    advice = wb.advise(
        "gpt-mini", steps=3, warmup=1, profile_steps=1, batch_size=64, device="cpu", progress=False
    )
    assert advice.bottleneck == "compute", advice.summary()
    emulated = cpu_lacks_native("bfloat16")
    assert advice.facts.emulated_bf16 == emulated
    if emulated:  # this CPU converts around every bfloat16 operator: amp is ruled out, and says why
        assert "amp" not in advice.recommended
        assert "has no bfloat16 instructions" in advice.not_recommended.set_index("technique").why["amp"]
    else:
        assert "amp" in advice.recommended


@pytest.mark.slow
def test_a_job_near_its_memory_cap_is_memory_bound():
    # Memory is the limit from the peak against the cap, whatever the step time: a small batch
    # (and one profiled step) keeps the two runs short, and the cap keeps the job near it.
    job = {"steps": 4, "warmup": 1, "profile_steps": 1, "batch_size": 4, "device": "cpu", "progress": False}
    free = wb.advise("gpt-mini", **job)
    peak = free.facts.peak_mib
    capped = wb.advise("gpt-mini", **job, memory_cap_mb=1.1 * peak)
    assert free.bottleneck != "memory" and capped.bottleneck == "memory", capped.summary()
    assert capped.facts.capacity_source == "the run's memory cap"  # the plot said memory_cap_mb to CLI users
    assert list(capped.recommended)[0] == "checkpointing"  # it frees the most activations
    # A baseline over the cap is the question itself: refused as out of memory, it left no advice.
    over = wb.advise("gpt-mini", **job, memory_cap_mb=0.8 * peak)
    assert over.bottleneck == "memory" and over.facts.memory_share > 1, over.summary()
    assert list(over.recommended)[0] == "checkpointing"


@pytest.mark.slow
def test_an_arm_over_the_memory_cap_is_recorded_out_of_memory():
    def run(**cap):
        return wb.ablate(
            model="gpt-mini", techniques={"checkpointing": True}, steps=3, warmup=1, blocks=1, batch_size=16,
            control=False, out=False, progress=False, **cap,
        )  # fmt: skip

    free = run().table.set_index("arm")
    between = (free.loc["baseline", "peak_mem_mb"] + free.loc["checkpointing", "peak_mem_mb"]) / 2
    results = run(memory_cap_mb=between)
    capped = results.table.set_index("arm")
    assert capped.loc["baseline", "status"] == "oom", capped[["status", "reason"]]
    assert f"more than memory_cap_mb={between:g} allows" in capped.loc["baseline", "reason"]
    assert capped.loc["checkpointing", "status"] == "ok"  # it fits: checkpointing is what makes it fit
    # Its peak is its own in any process: it was moved to one of its own and measured again, in
    # vain, and the peak it needs, the finding, was left out of the table.
    assert [u["process"] for u in results.record["units"] if u["arm"] == "baseline"] == ["block"]
    assert capped.loc["baseline", "peak_mem_mb"] == pytest.approx(
        free.loc["baseline", "peak_mem_mb"], rel=0.05
    )
    assert results.warnings()[0].startswith("the baseline needs more memory than the cap allows")


# --- on a GPU: the profile reads CUDA kernels, not CPU operators ------------------------------------


@pytest.mark.gpu
@requires_cuda
def test_on_cuda_a_tiny_mlp_at_batch_8_is_launch_bound_and_a_graph_is_suggested():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))] * 8
    advice = wb.advise(_tiny_mlp, batches, steps=100, warmup=5, batch_size=8, device="cuda", progress=False)
    facts = advice.facts
    assert facts.device == "cuda" and facts.ops > 0 and facts.busy_ms > 0, facts
    assert advice.bottleneck == "launch", advice.summary()
    assert "cuda_graphs" in advice.recommended, advice.summary()
    why = advice.recommendations.set_index("technique").why["cuda_graphs"]
    assert "kernels of" in why and "one graph replay launches them all" in why


@pytest.mark.gpu
@requires_cuda
def test_on_cuda_gpt_mini_profiles_its_float32_matmul_kernels_and_amp_is_worth_at_least_tf32():
    # The strict float32 baseline's matmuls run without Tensor Cores: the profile must find them
    # among the CUDA kernels (their names, not the CPU operators'), or tf32's ceiling reads 1.
    advice = wb.advise(
        "gpt-mini", steps=5, warmup=2, profile_steps=2, batch_size=1024, device="cuda", progress=False
    )
    facts = advice.facts
    assert 0 < facts.fp32_matmul_ms <= facts.matmul_ms <= facts.busy_ms, facts
    ceilings = {
        s.technique: s.at_most for s in suggestions(facts, {"amp": None, "tf32": None}) if s.part == "compute"
    }
    assert ceilings["amp"] >= ceilings["tf32"] > 1.0, ceilings


def test_the_advisors_progress_bar_is_named_advise(capsys):
    """The advisor runs an ablation of the baseline alone; its bar said "ablate", which the user
    never asked for."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))] * 8
    wb.advise(_tiny_mlp, batches, steps=10, warmup=2, batch_size=8, device="cpu", profile_steps=1)
    bar = capsys.readouterr().err
    assert "advise:" in bar and "ablate" not in bar, bar


def test_the_plots_legend_writes_a_long_step_in_plain_figures():
    """A 1,460 ms step's compute read "1.17e+03 ms" in the legend."""
    advice = build_advice(_facts(step_ms=1460.0, data_ms=0.7, overhead_ms=290.0), EVERYTHING)
    labels = [text.get_text() for text in advice.plot().legends[0].get_texts()]
    assert any("1,169 ms (80%)" in label or "1,170 ms (80%)" in label for label in labels), labels
    assert not any("e+" in label for label in labels), labels


def test_a_peak_over_the_capacity_is_drawn_whole():
    """advise measures a baseline over memory_cap_mb: its bar was cut at the capacity."""
    memory_axes = build_advice(_facts(peak_mib=1142.0), EVERYTHING).plot().axes[1]
    assert memory_axes.get_xlim()[1] > 1142.0
    assert any(text.get_text().strip() == "capacity" for text in memory_axes.texts)


def test_a_small_peak_is_named_on_the_plot_and_in_figures_that_do_not_round_it_away():
    """A 4.8 MiB peak of 24,106 MiB of RAM drew no visible bar, and the text said "0.0 %" where
    the plot's title said 0.02%; a count read "466.0" operations."""
    advice = build_advice(_facts(peak_mib=4.8, capacity_mib=24106.0), EVERYTHING)
    memory_axes = advice.plot().axes[1]
    assert any("peak 4.8 MiB" in text.get_text() for text in memory_axes.texts)
    lines = {
        line.split("  ")[1].strip(): line for line in advice.summary().splitlines() if line.startswith("  ")
    }
    assert " 0.02 % " in lines["peak / capacity"] and " 200 " in lines["operations per step"]
