"""Results read at a glance: verdicts, the formatted table (notebook and terminal), the report
and saved runs side by side. Built from synthetic records, so each figure is known."""

import html
import itertools
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import result_row, synthetic_results
from matplotlib.backends.backend_agg import FigureCanvasAgg

import workbench as wb
from workbench.cli import main
from workbench.config import RunConfig
from workbench.results import load_results
from workbench.results_folder import ResultsFolder
from workbench.results_view import plain_number, text_table, wrap_cell

SCIENTIFIC = re.compile(r"\d(\.\d+)?e[+-]?\d")


def _visible(page: str) -> str:
    """What a reader sees of an HTML page: no styles, no tags."""
    return re.sub(r"<[^>]+>", " ", re.sub(r"<style>.*?</style>", "", page, flags=re.S))


ROLES = {"baseline": "baseline", "baseline (control)": "control"}
_row, _results = result_row, synthetic_results


def _typical(control=(0.97, 1.04)):
    return _results(
        [
            _row("baseline", speedup=1.0, low=1.0, high=1.0),
            _row("baseline (control)", speedup=sum(control) / 2, low=control[0], high=control[1]),
            _row("amp", speedup=1.49, low=1.12, high=2.27, samples_per_s=6914.0),
            _row("channels_last", speedup=1.03, low=1.01, high=1.06),
            _row("checkpointing", speedup=0.7, low=0.65, high=0.75, loss_vs_baseline=1.3),
            _row("tf32", status="unavailable", reason="needs a CUDA device; this run is on cpu"),
            _row("compile", status="failed", reason="block 1: RuntimeError: the compiler crashed " * 4),
        ],
        ROLES,
    )


def test_the_verdict_is_the_interval_against_the_controls_band():
    table = _typical().table
    verdict = dict(zip(table.arm, table.verdict, strict=True))
    assert verdict["baseline"] == "reference" and verdict["baseline (control)"] == "control"
    assert verdict["amp"] == "faster" and verdict["checkpointing"] == "slower"
    # Above 1, but not clear of the band where an arm that does nothing lands.
    assert verdict["channels_last"] == "within noise"
    assert verdict["tf32"] == "unavailable" and verdict["compile"] == "failed"
    # A narrower control band: the same interval is now clear of it.
    narrow = _typical(control=(0.995, 1.005)).table
    assert narrow.set_index("arm").verdict["channels_last"] == "faster"


def test_without_a_control_the_band_is_one_and_best_follows_the_verdict():
    results = _results(
        [_row("baseline", speedup=1.0, low=1.0, high=1.0), _row("amp", speedup=1.05, low=1.01, high=1.1)],
        {"baseline": "baseline"},
    )
    assert list(results.table.verdict) == ["reference", "faster"]
    typical = _typical()
    typical.record["arms"][2]["settings"] = {"amp": {"dtype": "bfloat16"}}
    assert typical.best == {"amp": {"dtype": "bfloat16"}}  # channels_last is within noise


def _with_control_spread(low, high, between, within, blocks=3, path=None):
    control = _row("baseline (control)", speedup=1.0, low=low, high=high, speedup_blocks=blocks,
                   between_block_pct=between, within_block_pct=within)  # fmt: skip
    return _results([_row("baseline", speedup=1.0, low=1.0, high=1.0), control], ROLES, path=path)


def test_a_wide_noise_band_says_what_it_hides_and_about_how_many_blocks_would_narrow_it(tmp_path):
    # The quick preset on a noisy hour of the AVX2-only VM: 3 blocks spread by 3.7%.
    noisy = _with_control_spread(0.914, 1.099, between=3.71, within=3.0)
    note = "the control's band is ±9.2% wide"
    advice = "(a rough guess from 3 blocks), blocks=9 would narrow it to about ±3%."
    for shown in (
        noisy.summary(width=200),
        _visible(noisy._repr_html_()),
        _visible(noisy.to_html(tmp_path / "r.html").read_text()),
    ):
        shown = " ".join(html.unescape(shown).split())  # as read, whatever the line breaks
        assert note in shown and advice in shown, shown
    # So wide that no sensible count of blocks would do: a quieter machine, or one thread.
    hopeless = " ".join(_with_control_spread(0.6, 1.6, between=20.0, within=5.0).summary().split())
    assert "even blocks=30 would leave it about ±" in hopeless and "threads=1" in hopeless
    # A band of ±2%: nothing to add.
    assert "noise:" not in _with_control_spread(0.98, 1.02, between=1.0, within=0.8).summary(width=200)
    # A single block's ±24% went unremarked: no spread between blocks to project from, but more blocks measure it.
    single = " ".join(
        _with_control_spread(0.79, 1.27, between=math.nan, within=9.0, blocks=1).summary().split()
    )
    # ±23.7% (the log half-width) would read as -24% and +24%: the band is -21% and +27%
    assert "the control's band runs from 0.79× to 1.27×, so a change that lands inside it" in single
    assert (
        "from one block's rounds alone" in single
        and "blocks=3 or more would measure how processes differ" in single
    )


def test_the_command_line_spells_the_summarys_settings_as_flags(tmp_path, capsys):
    """`workbench show` said "Run it again with blocks=9 and the same out (...)", and its warnings
    "compare at one thread (threads=1)", which a shell user cannot type; the API's keywords stay
    in the notebook's and the report's. The wording is changed before the text is wrapped, so
    the lines still fit."""
    from workbench.cli import _parser, ablate_spelling, main
    from workbench.results_folder import ResultsFolder

    run = ResultsFolder(tmp_path / "run")
    run.lock()
    run.file("plan.json").write_text("{}")
    run.unlock()
    noisy = _with_control_spread(0.914, 1.099, 3.71, 3.0, path=run.path)
    noisy.record["load"] = {"warning": "other processes ran; compare at one thread (threads=1)"}
    noisy.save(tmp_path / "saved")
    capsys.readouterr()
    assert main(["show", str(tmp_path / "saved")]) == 0
    shown = capsys.readouterr().out
    assert "--blocks" in shown and max(len(line) for line in shown.splitlines()) <= 80
    said = " ".join(shown.split())
    assert "(--threads 1)" in said and "threads=1" not in said and "blocks=" not in said
    assert "--blocks 9 would narrow it to about ±3%" in said
    # In the folder a rerun resumes (a run's own, as `workbench ablate` prints it): its --out.
    spelling = ablate_spelling(_parser().parse_args(["show", str(run.path)]))
    said = " ".join(noisy.summary(width=200, spell=spelling).split())
    assert (
        f"Run it again with --blocks 9 and the same --out {shlex.quote(str(run.path))}: its 3 blocks count."
        in said
    )
    hopeless = _with_control_spread(0.6, 1.6, 20.0, 5.0)
    assert "blocks=30" in hopeless.summary() and "(threads=1)" in hopeless.summary()


def test_the_noise_note_says_a_rerun_into_the_same_folder_adds_blocks_where_it_would(tmp_path):
    from workbench.results_folder import ResultsFolder

    run = ResultsFolder(tmp_path / "run")  # a run's folder: its manifest lists its plan
    run.lock()
    run.file("plan.json").write_text("{}")
    run.unlock()
    copy = tmp_path / "copy"  # its results saved elsewhere: no plan to resume
    copy.mkdir()
    rerun = f"Run it again with blocks=9 and the same out={str(tmp_path / 'run')!r}: its 3 blocks count."
    said = " ".join(_with_control_spread(0.914, 1.099, 3.71, 3.0, path=run.path).summary(width=200).split())
    assert rerun in said
    said = " ".join(_with_control_spread(0.914, 1.099, 3.71, 3.0, path=copy).summary(width=200).split())
    assert "blocks=9 would narrow it" in said and "Run it again" not in said
    # The report's Reproduce starts afresh; for a run in its own folder, it says how to add blocks.
    from workbench.report import report_html

    own = report_html(_with_control_spread(0.914, 1.099, 3.71, 3.0, path=run.path))
    assert f"--blocks N --out {run.path}" in own and "afresh, into a new results folder" in own
    assert "To add blocks" not in report_html(_with_control_spread(0.914, 1.099, 3.71, 3.0, path=copy))
    # A stopped run is finished by the same command with its folder: more blocks are not the point.
    stopped = _with_control_spread(0.914, 1.099, 3.71, 3.0, path=run.path)
    stopped.record["complete"] = False
    page = report_html(stopped)
    assert "This run was stopped before it finished" in page and f"--out {run.path}" in page
    assert "To add blocks" not in page


def test_the_blocks_projection_follows_the_intervals_own_rule():
    from workbench.stats import BlockRatio, Side, combine_blocks, projected_half_width_pct

    side = Side(windows=[[0.01]], samples_per_step=1.0)
    for logs, within in (([0.05, -0.02, 0.01], 0.004), ([0.002, -0.001, 0.0005, 0.001], 0.01)):
        ratios = [BlockRatio(value, within, 200, side, side) for value in logs]
        speedup = combine_blocks(ratios)
        half = 50 * math.log(speedup.high / speedup.low)
        projected = projected_half_width_pct(speedup.between_block_pct, speedup.within_block_pct, len(logs))
        assert projected == pytest.approx(
            half, rel=0.01
        )  # the first set by its blocks, the second by its rounds


@pytest.mark.parametrize("value", [4640.2, 1e7, 123456.789, 0.000123, 1.5e-7, 48.213, 0.0])
def test_numbers_are_never_in_scientific_notation(value):
    text = plain_number(value)
    assert not SCIENTIFIC.search(text) and "e" not in text
    assert float(text.replace(",", "")) == pytest.approx(value, rel=0.01, abs=1e-9)


@pytest.mark.parametrize(
    ("low", "high"),
    [
        (0.11, 1.16),
        (0.95, 9.3),
        (0.62, 1.42),
        (0.98, 7.07),
        (1.0, 19.1),
        (1.68, 1.73),
        (5.4e-5, 1491.48),
        (0.0097, 62.75),
    ],
)
def test_the_speedup_axis_has_a_number_beyond_its_farthest_interval(low, high):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    from workbench.plots import readable_log_ticks

    figure, axes = pyplot.subplots()
    axes.set_xscale("log")
    readable_log_ticks(axes, [low], [high])
    left, right = axes.get_xlim()
    shown = [tick for tick in axes.get_xticks() if left <= tick <= right]
    pyplot.close(figure)
    assert 1.0 in shown
    # a labelled tick beyond each end of the intervals (0.11x once had none below 0.2, and the
    # tuner's winner at [1.68, 1.73] sat past the last tick, 1.5)
    assert min(shown) <= low and max(shown) >= high, (shown, left, right)
    assert len(shown) >= 3
    if high / low > 1000:  # across decades, only round ones: a lone 8 among them read as a misprint
        assert all(f"{tick:g}".lstrip("0.").startswith("1") for tick in shown), shown


def test_the_notebook_table_reads_at_a_glance():
    page = _typical()._repr_html_()
    reader = page.split("<details>")[0]
    assert "1.49× [1.12, 2.27]" in reader and "4,640" in reader and "6,914" in reader
    assert not SCIENTIFIC.search(_visible(page))  # the details table too
    for word in ("faster", "slower", "within noise", "unavailable", "failed"):
        assert f">{word}</span>" in reader
    assert "needs a CUDA device; this run is on cpu" in reader  # the reason, beside its arm
    assert "1.30× !" in reader  # a loss that drifted is marked
    # Only the reader's columns up front; the raw names wait behind the toggle.
    assert "samples_per_s_spread" not in reader and "samples_per_s_spread" in page
    assert re.search(r"<details><summary>All \d+ columns", page)


def test_the_terminal_table_fits_80_columns_and_aligns():
    text = _typical().summary()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not SCIENTIFIC.search(text)
    header = lines[0]
    assert header.startswith("arm") and "verdict" in header
    amp = next(line for line in lines if line.startswith("amp "))
    assert "faster" in amp and "1.49× [1.12, 2.27]" in amp and "6,914" in amp
    # Right-aligned numbers: the throughput column ends where its heading ends.
    heading_end = lines[1].index("samples/s") + len("samples/s") if "samples/s" in lines[1] else None
    heading_end = heading_end or header.index("samples/s") + len("samples/s")
    assert amp[:heading_end].endswith("6,914")
    assert "compile: failed: block 1: RuntimeError" in text.replace("\n    ", " ")


def test_a_data_parallel_run_shows_what_each_arm_sent():
    """The table of a DDP ablation left out every communication column: what a hook changes was
    only in table.csv and the report."""
    results = _results(
        [
            _row("baseline", speedup=1.0, low=1.0, high=1.0, comm_mb_per_step=1.08),
            _row("baseline (control)", speedup=0.99, low=0.97, high=1.02, comm_mb_per_step=1.08),
            _row("ddp_compression[hook=fp16]", speedup=1.1, low=1.05, high=1.15, comm_mb_per_step=0.542),
        ],
        ROLES,
    )
    text = results.summary(width=100)
    header = next(line for line in text.splitlines() if line.startswith("arm "))
    words = " ".join(text.split())
    assert (
        "comm" in header and "0.542" in text and "comm: what a rank's gradient synchronization sent" in words
    )
    assert "comm" not in _typical().summary(width=100).split("\n\n")[0]  # one process: no such column


def test_a_table_with_no_speedup_keeps_its_heading_within_80_columns():
    """With every arm out of memory or not compared, the speedup column holds dashes alone, and
    its heading's "[95% interval]" ran 5 columns past the 80 (and past the column)."""
    figures = dict(
        peak_mem_mb=10.8, samples_per_s=None, step_ms=None, activation_mb=None, loss_vs_baseline=None
    )
    results = _results(
        [
            _row("baseline", status="oom", reason="MemoryCapExceeded", **figures),
            _row("baseline (control)", status="oom", reason="MemoryCapExceeded", **figures),
            _row("checkpointing", status="oom", reason="MemoryCapExceeded", **figures),
            _row("grad_accum", peak_mem_mb=4.08),
        ],
        ROLES,
    )
    lines = results.summary(width=80).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    header = next(index for index, line in enumerate(lines) if line.startswith("arm "))
    speedup = lines[header].index("speedup")
    assert lines[header + 1][speedup:].lstrip().startswith("[95%") and "interval]" in lines[header + 2]


def test_long_text_wraps_in_its_column_left_aligned():
    rows = [["dataloader[num_workers=2, pin_memory=True]", "a summary " * 12, "12.5"]]
    text = text_table(["technique", "summary", "ms"], rows, [False, False, True], width=60)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 60
    assert len(lines) > 3  # wrapped
    summary_at = lines[0].index("summary")
    assert all(line[summary_at - 2 : summary_at] == "  " for line in lines[2:] if len(line) > summary_at)
    assert lines[2].startswith("dataloader")  # left-aligned, not right-aligned


def test_an_arm_named_by_its_settings_breaks_between_them_not_inside_a_word():
    assert wrap_cell("amp[dtype=bfloat16]", 10) == ["amp[dtype=", "bfloat16]"]
    assert wrap_cell("dataloader[num_workers=2, pin_memory=True]", 14) == [
        "dataloader[", "num_workers=2,", "pin_memory=", "True]"
    ]  # fmt: skip
    assert wrap_cell("baseline (control)", 9) == ["baseline", "(control)"]
    assert wrap_cell("leave-one-out x=-1.5", 7) == ["leave-", "one-out", "x=-1.5"]  # a minus stays
    assert wrap_cell("abcdefghijk", 4) == ["abcd", "efgh", "ijk"]  # a piece longer than a line: cut
    assert wrap_cell("digits: 1,797 images", 10) == ["digits:", "1,797", "images"]  # a number stays whole
    assert wrap_cell("", 5) == [""]
    # a search's candidate breaks where its techniques join, not inside one of them
    assert wrap_cell("amp[dtype=bfloat16]+channels_last+compile", 22) == [
        "amp[dtype=bfloat16]+", "channels_last+compile"
    ]  # fmt: skip
    assert wrap_cell("lr 1e+05", 6) == ["lr", "1e+05"]  # an exponent's plus stays


def test_a_table_too_wide_for_the_terminal_leaves_out_columns_rather_than_cut_names():
    # The H100 precision stage's table: with MFU it needs 86 characters at full-word widths.
    # Cutting words made "refere" / "nce" and "amp[" / "dtype=" / "bfloat16" / "]".
    figures = dict(samples_per_s=138948.0, step_ms=29.5, activation_mb=5224.0, mfu_pct=36.2)
    results = _results(
        [
            _row("baseline", speedup=1.0, low=1.0, high=1.0, **figures),
            _row("baseline (control)", speedup=0.99, low=0.97, high=1.01, **figures),
            _row("amp[dtype=bfloat16]", speedup=1.95, low=1.94, high=1.96, **figures),
            _row("dataloader[num_workers=8]", speedup=11.08, low=5.99, high=20.47, **figures),
        ],
        ROLES,
    )
    text = results.summary(width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "reference" in text and "refere\n" not in text  # the verdict whole
    assert any(line.startswith("amp[dtype=") for line in lines)  # broken only between settings
    assert "MFU %" not in lines[0] and "step" not in lines[0] and "activ." in lines[0]
    assert "Left out to fit 80 characters: step ms, MFU %" in " ".join(text.split())
    from workbench.cli import _parser, ablate_spelling  # a terminal has no summary(width=120)

    said = " ".join(
        results.summary(width=80, spell=ablate_spelling(_parser().parse_args(["show", "x"]))).split()
    )
    assert "step ms, MFU %; table.csv and `workbench report` show them." in said
    assert "communication) is in table.csv and `workbench report`." in said and "Results.table" not in said
    wide = results.summary(width=120)
    assert all(heading in wide.splitlines()[0] for heading in ("step", "MFU", "activ."))
    assert "Left out" not in wide


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "workbench", *args], capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "COLUMNS": "200", **(env or {})},
    )  # fmt: skip


def test_workbench_list_fits_80_columns_left_aligned():
    done = _cli("list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    names = [line.split()[0] for line in lines[2:] if line and not line.startswith(" ")]
    assert {"dataloader", "amp", "tf32"} <= set(names)  # each name starts its line: left-aligned
    models = _cli("list", "--models")
    assert models.returncode == 0 and max(len(line) for line in models.stdout.splitlines()) <= 80


def test_workbench_show_prints_the_readers_table(tmp_path):
    results = _typical()
    results.save(tmp_path / "run")
    done = _cli("show", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    assert "within noise" in done.stdout and "1.49× [1.12, 2.27]" in done.stdout
    assert "\033[" not in done.stdout  # no colour codes when the output is not a terminal


def test_the_report_is_one_file_that_opens_offline(tmp_path):
    results = _typical()
    folder = results.save(tmp_path / "run")
    results = wb.load_results(folder)
    done = _cli("report", str(folder))
    assert done.returncode == 0, done.stderr
    report = folder / "report.html"
    page = report.read_text()
    assert "report.html" in json.loads((folder / ".workbench-manifest.json").read_text())["files"]
    assert page.count('src="data:image/png;base64,') >= 1
    # Nothing fetched: no remote sources, styles or scripts.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script" not in page and "<link" not in page
    # a figure as wide as the page: its border inside that width (outside, it scrolled by 2 px)
    assert re.search(r"img \{[^}]*max-width: 100%[^}]*box-sizing: border-box", page)
    assert "within noise" in page and "1.49× [1.12, 2.27]" in page
    assert "2.13.0+cpu" in page and "test CPU" in page  # the environment
    assert "workbench ablate --model mlp --data digits" in page  # the command
    assert "the compiler crashed" in page  # a failed arm's reason
    # Written again over its own report; never over a file workbench did not write.
    assert results.to_html() == report
    mine = tmp_path / "notes.html"
    mine.write_text("<p>my notes</p>")
    with pytest.raises(ValueError, match="exists and workbench did not write it"):
        results.to_html(mine)
    assert mine.read_text() == "<p>my notes</p>"
    with pytest.raises(
        ValueError, match=r"the report is an HTML page: name it with \.html \(got '.*report\.pdf'\)"
    ):
        results.to_html(tmp_path / "report.pdf")  # HTML under a PDF's name would open as a broken PDF
    assert not (tmp_path / "report.pdf").exists()


def test_a_report_goes_into_no_other_runs_folder_and_its_own_folder_counts_it(tmp_path):
    """Written into another run's folder, a report replaced that run's own, or stood there as a
    file that run did not write and blocked its overwrite."""
    results, other = _typical(), _typical()
    folder, other_folder = results.save(tmp_path / "run"), other.save(tmp_path / "other")
    other_report = wb.load_results(other_folder).to_html()
    before = other_report.read_text()
    for inside in (other_report, other_folder / "extra.html", other_folder / "new" / "r.html"):
        with pytest.raises(
            ValueError, match=r"the report '.*' is inside the workbench results folder '.*other'"
        ):
            wb.load_results(folder).to_html(inside)
    assert other_report.read_text() == before and not (other_folder / "extra.html").exists()
    extra = wb.load_results(folder).to_html(folder / "extra.html")  # its own folder: entered in the manifest
    assert "extra.html" in json.loads((folder / ".workbench-manifest.json").read_text())["files"]
    assert extra.is_file() and not ResultsFolder(folder).foreign_files()


def test_the_report_names_the_gpu_and_its_driver(tmp_path):
    results = _typical()
    results.record["environment"].update(
        gpus=["NVIDIA H100 80GB HBM3"], driver_version="580.65", cuda_version="13.0", cudnn_version=91000
    )
    page = results.to_html(tmp_path / "r.html").read_text()
    for shown in ("NVIDIA H100 80GB HBM3", "580.65", "13.0", "91000"):
        assert f"<td>{shown}</td>" in page, shown
    other = _typical()
    other.record["environment"]["gpus"] = ["NVIDIA A100-SXM4-40GB"]
    assert wb.compare(results, other).differences == {
        "gpus": [["NVIDIA H100 80GB HBM3"], ["NVIDIA A100-SXM4-40GB"]]
    }


def test_the_report_shows_the_measuring_processes_threads_and_takes_a_folder_to_make(tmp_path):
    results = _typical()
    results.record["environment"]["torch_threads"] = 2  # the parent's: not what measured
    results.record["blocks"] = [{"block": b, "torch_threads": 1} for b in range(2)]
    page = results.to_html(str(tmp_path / "new") + "/").read_text()  # "new/": a folder, made
    assert (tmp_path / "new" / "report.html").is_file()
    assert "<th>torch threads</th><td>1</td>" in page


def test_the_report_says_the_controls_failure_and_a_busy_machine(tmp_path):
    results = _typical(control=(1.1, 1.3))
    results.record["load"] = {"warning": "other processes used 0.80 of this machine's 2 cores"}
    page = (results.to_html(tmp_path / "r.html")).read_text()
    assert "the control arm (the baseline measured again) came out at" in page
    assert "other processes used 0.80" in page


def test_the_reproduce_command_plans_the_same_arms():
    from workbench.ablation import prepare
    from workbench.cli import _parser, _techniques, run_settings
    from workbench.report import reproduce

    techniques = {"amp": {"dtype": "float16"}, "grad_accum": {"steps": [2, 4]}, "checkpointing": True}
    run = RunConfig(steps=12, warmup=2, blocks=2, batch_size=16, control=False, device="cpu")
    prepared = prepare("mlp", "digits", None, techniques, run)
    record = {"config": prepared.config, "arms": [arm.record() for arm in prepared.arms]}
    command, python = reproduce(record)
    words = shlex.split(command)
    assert words[:2] == ["workbench", "ablate"]
    args = _parser().parse_args(words[1:])
    again = prepare(args.model, args.data, None, _techniques(args, {}), RunConfig(**run_settings(args)))
    assert [arm.record() for arm in again.arms] == record["arms"]
    assert again.config == prepared.config
    # The Python form names the same techniques and settings.
    assert (
        "techniques={'checkpointing': True, 'amp': {'dtype': 'float16'}, 'grad_accum': {'steps': [2, 4]}}"
        in python
    )
    assert "control=False" in python and "batch_size=16" in python
    compile(python, "<reproduce>", "exec")


def test_a_users_model_gets_the_python_call_only():
    from workbench.report import reproduce

    command, python = reproduce(
        {"config": {"model": "make_model", "data": "MyDataset", "device": "cpu"}, "arms": []}
    )
    assert command is None
    assert "model=make_model" in python and "# model: your own factory" in python
    # A built-in model with the user's own loss: the CLI cannot give the loss, and a call without
    # it trained on plain cross-entropy.
    config = {"model": "mlp", "data": "digits", "device": "cpu", "loss_fn": "my_loss", "collate_fn": "pad"}
    command, python = reproduce({"config": config, "arms": []})
    assert command is None
    assert "loss_fn=my_loss" in python and "# loss_fn: your own, recorded as 'my_loss'" in python
    assert "collate_fn=pad" in python


def test_an_optimizer_factory_of_the_users_is_in_the_python_call_and_its_lr_is_not():
    import functools

    import torch

    from workbench.ablation import prepare
    from workbench.report import reproduce

    factory = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    prepared = prepare("mlp", "digits", None, {"amp": True}, RunConfig(device="cpu", optimizer=factory))
    assert prepared.config["optimizer"] == "partial(SGD, lr=0.1, momentum=0.9)"
    assert prepared.config["lr"] is None  # the factory's own, not the built-ins' 1e-3
    command, python = reproduce({"config": prepared.config, "arms": []})
    assert command is None  # the command line takes the built-in optimizers only
    assert "optimizer=partial(SGD, lr=0.1, momentum=0.9)," in python
    assert "# optimizer: your own, recorded as 'partial(SGD, lr=0.1, momentum=0.9)'" in python
    assert "lr=" not in python.replace("(SGD, lr=", "")


def _run(amp, amp_low, amp_high, control=(0.98, 1.02), extra=None, config=None):
    rows = [
        _row("baseline", speedup=1.0, low=1.0, high=1.0),
        _row("baseline (control)", speedup=1.0, low=control[0], high=control[1]),
        _row("amp", speedup=amp, low=amp_low, high=amp_high),
        *(extra or []),
    ]
    return _results(rows, ROLES, config)


def test_a_run_whose_threads_changed_state_warns_in_its_results():
    results = _typical()
    probes = [9.1] * 10 + [11.5] * 10
    results.record["blocks"] = [
        {"block": 0, "arms": ["baseline", "amp"], "rounds": 20, "window_steps": [1] * 20, "warmup": 2,
         "rss_growth_mib": 1.0, "core_sync_us": probes}
    ]  # fmt: skip
    results.record["units"] = [
        {"arm": arm, "block": 0, "process": "block", "status": "ok",
         "result": {"samples_per_s": 500.0, "windows": [{"round": r, "step_s": [0.05]} for r in range(20)]}}
        for arm in ("baseline", "amp")
    ]  # fmt: skip
    assert any("worked together at two speeds" in warning for warning in results.warnings())
    assert list(results.blocks.core_sync_slow_rounds) == [10]


def test_compare_notes_runs_whose_threads_worked_together_at_different_speeds():
    fast, slow, also_fast = _run(1.5, 1.45, 1.55), _run(1.46, 1.41, 1.51), _run(1.5, 1.45, 1.55)
    for run, probe in ((fast, 9.2), (slow, 11.6), (also_fast, 9.6)):
        run.record["blocks"] = [{"block": 0, "arms": ["baseline", "amp"], "core_sync_us": [probe] * 20}]
    notes = " ".join(wb.compare(fast, slow, names=["a", "b"])._notes())
    assert "worked together at different speeds" in notes and "a 9.2 us, b 11.6 us" in notes
    assert "worked together" not in " ".join(wb.compare(fast, also_fast, names=["a", "c"])._notes())
    assert "worked together" not in " ".join(wb.compare(fast, _run(1.5, 1.45, 1.55))._notes())  # not probed


def test_compare_in_80_columns_keeps_every_cell_in_its_column_and_breaks_no_name():
    extra = [_row("checkpointing", speedup=0.69, low=0.68, high=0.70)]
    runs = [_run(1.52, 1.43, 1.61, extra=extra), _run(1.48, 1.39, 1.58, extra=extra)]
    text = repr(wb.compare(*runs, names=["batch 32", "batch 64"]))
    lines = text.splitlines()
    rule = next(index for index, line in enumerate(lines) if line.startswith("---"))
    gaps = [i for i, char in enumerate(lines[rule]) if char == " "]  # between the columns
    table = lines[1 : next(i for i, line in enumerate(lines) if line.startswith("A run's speedup"))]
    for line in table:
        assert all(i >= len(line) or line[i] == " " for i in gaps), f"a cell runs past its column: {line!r}"
    assert max(len(line) for line in lines) <= 80
    assert any(line.startswith("checkpointing ") for line in lines), "the arm's name is not broken"
    assert "1.52× [1.43, 1.61]" in text and "0.97× [" in text  # a figure and its interval on one line


def test_compare_warns_first_of_different_jobs_and_of_each_runs_own_warnings(tmp_path):
    """mlp against resnet-mini read 'worse', with the difference in a note under the table; a run
    whose control failed its A/A check was compared without a word of it, in the text and the plot."""
    failed_control = _run(
        0.8, 0.7, 0.9, control=(0.40, 0.97), config={"model": "resnet-mini", "data": "textures"}
    )
    comparison = wb.compare(_run(1.2, 1.1, 1.3), failed_control, names=["int1", "int2"])
    text = " ".join(comparison.text().split())
    assert text.startswith(
        "WARNING: these runs measured different jobs (model: int1=mlp, int2=resnet-mini; data:"
    )
    assert "WARNING: run int2: the control arm (the baseline measured again) came out at" in text
    assert "The runs differ in model" not in text  # said once, first
    assert "these runs measured different jobs" in comparison._repr_html_()
    title = comparison.plot()._suptitle.get_text()
    assert "these runs measured different jobs (model, data)" in " ".join(title.split())
    assert "int2: the control arm" in " ".join(title.split())
    same_job = wb.compare(_run(1.2, 1.1, 1.3), _run(1.25, 1.1, 1.4))
    assert "WARNING" not in same_job.text() and same_job.plot()._suptitle is None


def test_the_compare_plot_keeps_every_runs_name_inside_the_figure(tmp_path):
    """Four runs under their folder names (27 characters): the legend, four columns wide, ran off
    the figure, the fourth run's entry was lost, and the axes were crushed to make room."""
    names = ["20261129-185559-mlp-amp-cl", "20261129-190323-mlp-resumed", "20261129-185730-resnet-mini",
             "20261128-153150-resnet-mini"]  # fmt: skip
    runs = [_run(1.2 + 0.1 * index, 1.1, 1.5) for index in range(4)]
    figure = wb.compare(*runs, names=names).plot(tmp_path / "compare.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    legend, axes = figure.axes[0].get_legend(), figure.axes[0]
    assert [text.get_text() for text in legend.get_texts()] == names
    box, whole = legend.get_window_extent(renderer), figure.bbox
    assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and box.y1 <= whole.y1, (box, whole)
    assert axes.get_position().width > 0.6  # of the figure: not squeezed into a strip


def test_compare_writes_intervals_as_the_results_table_does():
    nan = float("nan")
    one_step, wide = _run(1.05, nan, nan), _run(1.2, 0.000054, 30.0)
    text = repr(wb.compare(one_step, wide, names=["a", "b"]))
    assert "[no interval]" in text and "nan" not in text
    assert "[<0.001, 30.00]" in text, "a very wide interval's low end does not read as 0.00"
    huge = repr(wb.compare(_run(1.05, 0.0054, 3.0), _run(1.2, 7.6e-13, 1.06e14), names=["a", "b"]))
    assert "[0.0054, 3.00]" in huge and "[<0.001, >1000]" in huge and "105924" not in huge


def test_compare_matches_arms_and_gives_the_ratio_with_its_interval(tmp_path):
    before = _run(1.2, 1.1, 1.3)
    after = _run(1.8, 1.65, 1.95, extra=[_row("compile", speedup=1.1, low=1.05, high=1.15)])
    before.save(tmp_path / "before")
    comparison = wb.compare(tmp_path / "before", after, names=["before", "after"])
    table = comparison.table.set_index("arm")
    assert list(table.index) == ["baseline", "baseline (control)", "amp", "compile"]
    amp = table.loc["amp"]
    assert amp["after / before ratio"] == pytest.approx(1.5)
    # Log half-widths in quadrature: wider than either run's own interval, and around 1.5.
    half = math.hypot(math.log(1.3 / 1.1) / 2, math.log(1.95 / 1.65) / 2)
    assert amp["after / before low"] == pytest.approx(1.5 * math.exp(-half))
    assert amp["after / before high"] == pytest.approx(1.5 * math.exp(half))
    assert amp["after / before change"] == "better"
    assert table.loc["compile", "before verdict"] == "absent"
    assert table.loc["compile", "after / before change"] == "not compared"
    assert table.loc["baseline", "after / before change"] == "reference"
    text = repr(comparison)
    assert max(len(line) for line in text.splitlines()) <= 80 and "1.50× [" in text
    assert "better" in comparison._repr_html_()
    figure = comparison.plot(tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert len(figure.axes[0].get_legend().get_texts()) == 2
    # The last row had no room below it (its label sat on the x axis), and an absent arm's slot was blank.
    assert figure.axes[0].get_ylim() == (3.5, -0.5)
    assert [text.get_text() for text in figure.axes[0].texts] == ["before: absent"]


def test_compare_says_when_the_runs_differ_and_refuses_bad_input(tmp_path):
    same = wb.compare(_run(1.2, 1.1, 1.3), _run(1.25, 1.12, 1.35))
    assert same.table.set_index("arm").loc["amp", "run 2 / run 1 change"] == "within noise"
    differ = wb.compare(_run(1.2, 1.1, 1.3), _run(1.2, 1.1, 1.3, config={"batch_size": 64}))
    assert differ.differences == {"batch_size": [32, 64]}
    assert "The runs differ in batch_size" in repr(differ)
    with pytest.raises(ValueError, match="two runs or more"):
        wb.compare(_run(1.2, 1.1, 1.3))
    with pytest.raises(ValueError, match="one name per run"):
        wb.compare(_run(1.2, 1.1, 1.3), _run(1.2, 1.1, 1.3), names=["a"])
    with pytest.raises(FileNotFoundError, match="no results at"):
        wb.compare(_run(1.2, 1.1, 1.3), tmp_path / "missing")
    once = _run(1.2, 1.1, 1.3)
    once.record["created"] = "2026-11-28T03:05:28"
    with pytest.raises(ValueError, match=r"runs 1 and 3 are the same run \(created 2026-11-28T03:05:28\)"):
        wb.compare(once, _run(1.25, 1.12, 1.35), once)  # "within noise" with itself would say nothing
    # An arm without a rate (unavailable here) made it pass: NaN never equals itself.
    partly = _run(1.2, 1.1, 1.3, extra=[_row("cuda_graphs", status="unavailable", reason="needs CUDA")])
    with pytest.raises(ValueError, match=r"runs 1 and 2 are the same run"):
        wb.compare(partly, partly)


def test_compare_fits_80_columns_with_long_run_names_and_many_runs(tmp_path, capsys, monkeypatch):
    """Default folder names as headings, and a column per run, left the arms' column a few letters
    wide ("baselin"/"e") at 80 columns, and 97 characters wide at three runs."""
    runs = []
    for index, amp in enumerate((1.2, 1.3, 1.1)):
        run = _run(
            amp,
            amp - 0.1,
            amp + 0.1,
            extra=[_row("checkpointing+amp+grad_accum", speedup=0.7, low=0.6, high=0.8)],
        )
        runs.append(run.save(tmp_path / f"20261129-12084{index}-mlp"))
    text = wb.compare(*runs).text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "Runs: A = 20261129-120840-mlp; B = 20261129-120841-mlp; C = 20261129-120842-mlp." in text
    words = {word for line in text.splitlines() for word in line.split()}
    assert {"baseline", "(control)", "checkpointing+amp+", "grad_accum", "reference", "noise"} <= words
    monkeypatch.setenv("COLUMNS", "80")  # the command line's width is the terminal's
    assert main(["compare", *map(str, runs), "--plot", str(tmp_path / "c.png")]) == 0
    said = capsys.readouterr().out
    assert (
        "vs A" in said and max(len(line) for line in said.splitlines() if not line.startswith("Wrote")) <= 80
    )
    assert (tmp_path / "c.png").stat().st_size > 0
    (tmp_path / "mine.png").write_bytes(b"not ours")
    assert main(["compare", *map(str, runs), "--plot", str(tmp_path / "mine.png")]) == 2
    assert (tmp_path / "mine.png").read_bytes() == b"not ours"


def test_compare_names_other_technique_settings_and_other_caps_as_differences():
    """amp in bfloat16 against amp in float16 was compared as one arm, and a run under a memory cap
    against one without: neither was said."""
    first = _run(1.2, 1.1, 1.3, config={"techniques": {"amp": "amp(dtype=bfloat16, level=O1)"}})
    second = _run(
        1.1, 1.0, 1.2, config={"techniques": {"amp": "amp(dtype=float16, level=O1)"}, "memory_cap_mb": 2.0}
    )
    comparison = wb.compare(first, second, names=["a", "b"])
    assert comparison.differences == {
        "memory_cap_mb": [None, 2.0],
        "amp's settings": ["amp(dtype=bfloat16, level=O1)", "amp(dtype=float16, level=O1)"],
    }
    text = " ".join(comparison.text().split())
    assert (
        "The runs differ in amp's settings: a=amp(dtype=bfloat16, level=O1), b=amp(dtype=float16, level=O1)."
        in text
    )


def _with_blocks(results, steps_by_block: dict):
    results.record["units"] = [
        {"arm": "baseline", "block": block, "status": "ok", "result": {"step_s": steps}}
        for block, steps in steps_by_block.items()
    ]
    return results


def test_compare_keeps_a_stopped_runs_figures_and_refuses_a_copy_that_shares_its_blocks():
    """A stopped run's arms (interrupted, with their finished blocks' speedups) read "interrupted" /
    "not compared"; and a copy resumed with more blocks passed as a run measured apart."""
    stopped = _run(1.3, 1.1, 1.5)
    stopped.record["complete"] = False
    stopped.record["table"][2]["status"] = "interrupted"
    _with_blocks(stopped, {0: [0.011, 0.012], 1: [0.013, 0.012]})
    comparison = wb.compare(_run(1.2, 1.1, 1.3), stopped, names=["a", "b"])
    assert comparison.table.set_index("arm").loc["amp", "b speedup"] == pytest.approx(1.3)
    text = " ".join(comparison.text().split())
    assert "b was stopped before it finished (2 of 3 blocks)" in text
    extended = _with_blocks(_run(1.25, 1.15, 1.35), {0: [0.011, 0.012], 1: [0.013, 0.012], 2: [0.012, 0.011]})
    with pytest.raises(ValueError, match=r"runs 1 and 2 hold the same measurements \(block 1 of baseline\)"):
        wb.compare(stopped, extended)


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda r: r.update(blocks=[1, 2]), "its 'blocks' is not a list of the blocks' records"),
        (lambda r: r["config"].pop("model"), "its config has no model"),
        (lambda r: r["table"][2].update(blocks="two"), "row 2 of its table has blocks 'two', not a number"),
        (
            lambda r: r["table"][2].update(speedup_low=5, speedup_high=0.1),
            r"the interval \[5, 0.1\], which no",
        ),
        (lambda r: r["table"][2].update(speedup_low=-1), r"the interval \[-1, 1.3\], which no"),
        (lambda r: r["table"].append(dict(r["table"][2])), "its table has two rows for the arm 'amp'"),
    ],
)
def test_a_results_file_damaged_by_hand_is_refused_with_what_is_wrong(tmp_path, damage, said):
    """Each of these read, then failed in show or report with a traceback (or read an interval
    upside down as "faster")."""
    folder = _run(1.2, 1.1, 1.3).save(tmp_path / "run")
    record = json.loads((folder / "results.json").read_text())
    damage(record)
    (folder / "results.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=f"is a damaged workbench results file: .*{said}"):
        wb.load_results(folder)


def test_the_html_table_keeps_a_stopped_arms_figures_and_says_why_under_them():
    """An arm of a stopped run (its finished blocks' speedup) showed only its reason, across the
    figures' columns, while the plot beside it drew the speedup."""
    results = _run(1.3, 1.1, 1.5)
    results.record["table"][2].update(status="interrupted", reason="2 of 3 blocks finished; stopped")
    page = results._repr_html_()
    row = page[page.index(">amp<") :]
    assert row.index("1.30× [1.10, 1.50]") < row.index("2 of 3 blocks finished; stopped")


def test_the_plots_warning_title_is_wrapped_inside_the_figure():
    """Every warning at once (a control outside its band, a busy machine, blocks on different
    devices at different speeds): the title says each in its first clause, wrapped, and no line
    of it reaches past the figure's edges (a long one used to be cut off at both sides)."""
    results = _typical(control=(1.1, 1.3))
    results.record["load"] = {
        "warning": "other processes used 0.80 of this machine's 2 cores (median; 1.20 at the 90th "
        "percentile) while the arms ran: they slow the arms unevenly and widen every interval"
    }
    results.record["blocks"] = [
        {"block": 0, "host": "node0", "device_name": "AMD EPYC 7B13"},
        {"block": 1, "host": "node1", "device_name": "Intel Xeon Platinum 8481C"},
    ]
    results.record["units"] = [
        {"arm": "baseline", "block": b, "status": "ok", "result": {"samples_per_s": s}}
        for b, s in enumerate([1327.0, 2592.0])
    ]
    assert len(results.warnings()) == 4
    figure = results.plot()
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)  # laid out as it is saved
    title = figure._suptitle
    text = title.get_text()
    assert text.count("\n") >= 2, "the warnings should wrap onto lines of their own"
    for said in ("the control arm (the baseline measured again) came out at", "other processes used 0.80",
                 "2 kinds of device", "the blocks ran at very different speeds"):  # fmt: skip
        assert said in text.replace("\n", " ")
    assert "cancels in them" not in text, (
        "the figure gives each warning's first clause; the table says the rest"
    )
    extent = title.get_window_extent(renderer)
    assert extent.x0 >= 0 and extent.x1 <= figure.bbox.width, (extent, figure.bbox.width)


def test_a_very_wide_intervals_low_end_does_not_read_as_zero():
    from types import SimpleNamespace

    from workbench.results_view import speedup_text

    row = SimpleNamespace(speedup=1.2, speedup_low=0.0054, speedup_high=149.48)
    assert speedup_text(row).endswith("[0.0054, 149.48]")
    row = SimpleNamespace(speedup=1.2, speedup_low=0.000054, speedup_high=1491.48)
    assert speedup_text(row).endswith("[<0.001, >1000]")  # beyond 1000x either way, the digits mean nothing


def _search_record() -> dict:
    """A search as wb.tune records it: a winner, a runner-up, one dropped, one interrupted."""

    def candidate(name, rounds, blocks, speedup=None, interval=(None, None), dropped=""):
        return {
            "name": name,
            "rounds": rounds,
            "blocks": blocks,
            "speedup": speedup,
            "speedup_low": interval[0],
            "speedup_high": interval[1],
            "loss_vs_baseline": None if speedup is None else 1.0,
            "dropped": dropped,
        }

    winner = candidate("channels_last+amp[dtype=bfloat16,level=O1]", 3, 5, 1.76, (1.64, 1.90))
    runner = candidate("amp[dtype=bfloat16,level=O1]", 3, 5, 1.57, (1.40, 1.75))
    return {
        "candidates": [
            candidate(
                "checkpointing", 1, 1, 0.68, (0.60, 0.77), dropped="in the lower half of round 1: x0.68"
            ),
            candidate("grad_accum[steps=4]", 1, 0, dropped="interrupted: 0 of 1 blocks finished"),
            runner,
            winner,
        ],
        "fastest": winner,
        "runner_up": runner,
        "best": {"channels_last": {}, "amp": {"dtype": "bfloat16", "level": "O1"}},
    }


def test_a_search_reads_furthest_first_with_what_became_of_each_candidate():
    """The terminal printed the tuner's candidates as a 140-column pandas dump, with NaN and
    six-decimal figures; now the furthest first, in the reader's figures, within 80 columns."""
    from workbench.results_view import search_html, search_rows, search_text

    record = _search_record()
    rows = search_rows(record)
    assert [cells[0] for cells in rows][:2] == [
        "channels_last+amp[dtype=bfloat16,level=O1]",
        "amp[dtype=bfloat16,level=O1]",
    ]
    assert [cells[-1] for cells in rows][:2] == ["best", "runner-up"]
    assert rows[2][3] == "0.68× [0.60, 0.77]" and rows[3][3] == "-"
    not_screened = {**record["candidates"][1], "blocks": None}  # it printed "None"
    assert search_rows({**record, "candidates": [not_screened]})[0][2] == "-"
    text = search_text(record, "best: channels_last+amp, x1.76 [1.64, 1.90] over 5 blocks", 80)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, text
    assert "nan" not in text.lower() and "0.680000" not in text
    # What became of each candidate on the line under it, indented.
    assert "  in the lower half of round 1: x0.68" in lines
    assert lines[-1].startswith("best: channels_last+amp")
    page = search_html(record)
    assert page.count("<tr") == 5 and 'font-weight:600"><td class="wb-text' in page
    record["best"] = {}  # measured, but not a winner: the row must not say "best"
    assert search_rows(record)[0][-1].startswith("the fastest, but no winner")


def test_a_searchs_table_gives_the_round_a_candidate_left_as_a_whole_number():
    """A finalist left in no round: the column read 1.0 and NaN, as pandas makes of ints beside None."""
    import pandas as pd

    record = _search_record()
    record["candidates"][0]["dropped_in_round"] = 1
    for candidate in record["candidates"]:
        candidate["techniques"] = {}
    table = wb.Results({"tune": record}).tuning
    assert str(table.dropped_in_round.dtype) == "Int64"
    assert table.dropped_in_round.tolist()[:2] == [1, pd.NA]


def test_a_search_lists_what_it_could_not_run_here_with_the_reason_and_counts_what_it_left_out():
    """tune.json kept the combinations that cannot run here, but no table, report or panel showed
    them: a technique asked for and never measured vanished without a reason."""
    from workbench.results_view import NOT_SEARCHED_SHOWN, search_html, search_rows

    record = _search_record()
    cannot = [
        {"name": f"dali+t{i}", "why": "dali: needs JPEG files to decode"}
        for i in range(NOT_SEARCHED_SHOWN + 2)
    ]
    record["excluded"] = [*cannot, *({"name": f"c{i}", "why": "beyond max_candidates=24"} for i in range(30))]
    rows = search_rows(record)
    assert [cells[0] for cells in rows[:4]] == [cells[0] for cells in search_rows(_search_record())]
    left_out = rows[4:]
    assert left_out[0] == [
        "dali+t0",
        "0",
        "-",  # no blocks, as for a candidate not screened ("0" here, "None" there)
        "-",
        "-",
        "not searched: cannot run here: dali: needs JPEG files to decode",
    ]
    assert [cells[0] for cells in left_out[-2:]] == ["2 more combinations", "30 more combinations"]
    assert left_out[-1][-1] == "not searched: beyond max_candidates=24"
    assert len(left_out) == NOT_SEARCHED_SHOWN + 2
    assert "not searched: cannot run here: dali: needs JPEG files" in search_html(record)


def test_each_arm_is_drawn_over_the_noise_band_its_verdict_is_judged_against():
    """The plot shaded the control's raw interval, [0.975, 0.995], across every row: amp at
    [0.997, 1.02] sat right of it, outside the noise by the picture, while its verdict said
    "within noise" (the band holds 1). An arm in its own process is judged against 1 alone."""
    rows = [
        result_row("baseline", speedup=1.0, low=1.0, high=1.0),
        result_row("baseline (control)", speedup=0.985, low=0.975, high=0.995),
        result_row("amp", speedup=1.008, low=0.997, high=1.02),
        result_row("dataloader", speedup=1.3, low=1.2, high=1.4, process="own"),
    ]
    results = synthetic_results(rows, roles={"baseline": "baseline", "baseline (control)": "control"})
    assert list(results.table.verdict) == ["reference", "control", "within noise", "faster"]
    speed_axes = results.plot().axes[0]
    bands = [p for p in speed_axes.patches if p.get_facecolor()[:3] == pytest.approx((217 / 255,) * 3)]
    # Drawn bottom-up (the first arm on top): amp (row 1) and the control (row 2), not the
    # own-process arm (row 0) nor the baseline (row 3).
    spans = sorted(
        (round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_x() + p.get_width()) for p in bands
    )
    assert [row for row, _, _ in spans] == [1, 2]
    for _, low, high in spans:
        assert (low, high) == (pytest.approx(0.975), pytest.approx(1.0))


def test_the_plots_memory_and_share_labels_are_never_in_scientific_notation():
    """A loader-only arm's memory labels read 4.2e-05, and a full device's share 1e+02%."""
    from workbench.plots import _mib, _percent

    assert [_mib(v) for v in (4.2e-5, 0.0, 0.42, 4.83, 12.4, 1234.5)] == [
        "<0.001",
        "0",
        "0.42",
        "4.8",
        "12",
        "1,234",
    ]
    assert [_percent(v) for v in (100.0, 85.3, 0.123)] == ["100%", "85%", "0.12%"]


def test_a_searchs_plot_shades_the_noise_band_its_verdict_was_judged_against(tmp_path):
    """The verdict "reaches into the control's band [0.91, 1.09]" named a band that the plot did not
    draw: a reader saw x1.15 [1.02, 1.29] right of the dashed 1 and no reason it was no winner."""
    from matplotlib.colors import to_hex

    def history(round_, speedup, low, high, band, blocks=None):
        return {
            "round": round_,
            "blocks": blocks if blocks is not None else [1, 3][round_ - 1],
            "speedup": speedup,
            "speedup_low": low,
            "speedup_high": high,
            "noise_band": band,
        }

    fastest = {
        "name": "channels_last",
        # round 2 planned 3 blocks; the budget let 2 finish, which the legend says (it said 3)
        "history": [
            history(1, 1.21, 1.14, 1.27, [0.95, 1.05]),
            history(2, 1.15, 1.02, 1.29, [0.91, 1.09], 2),
        ],
        "speedup": 1.15,
        "dropped": "the fastest, but not measurably faster than the baseline",
        "dropped_in_round": None,
    }
    slower = {
        "name": "amp",
        "history": [history(1, 0.10, 0.09, 0.12, [0.95, 1.05])],
        "speedup": 0.10,
        "dropped": "clearly slower than channels_last",
        "dropped_in_round": 1,
    }
    tune = {
        "candidates": [slower, fastest],
        "rounds": [{"blocks": 1}, {"blocks": 3}],
        "spent_s": 65.0,
        "budget_s": 75.0,
        "best": None,
        "undecided": "not measurably faster than the baseline",
    }
    figure = wb.Results({"tune": tune}).plot_tuning(tmp_path / "tune.png")
    axes = figure.axes[0]
    shaded = [patch for patch in axes.patches if to_hex(patch.get_facecolor()) == "#d9d9d9"]
    assert len(shaded) == 1
    band = shaded[0]
    assert (band.get_x(), band.get_x() + band.get_width()) == pytest.approx((0.91, 1.09))
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert sorted(legend) == ["noise band in round 2", "round 1: 1 block", "round 2: 2 of 3 blocks"]
    assert (tmp_path / "tune.png").stat().st_size > 0


def test_the_plot_colours_each_bar_by_its_verdict_and_names_only_visible_phases():
    """An interval ending at the noise band's edge looked clear of it while its verdict was
    "within noise"; and a phase too short to draw had a legend entry but no bar."""
    from matplotlib.colors import to_hex

    from workbench.plots import VERDICT_COLORS

    figures = dict(activation_mb=3.0, peak_mem_mb=10.0, step_ms=400.0, forward_ms=150.0, backward_ms=247.0,
                   optimizer_ms=1.2, data_ms=0.6)  # fmt: skip
    rows = [
        _row("baseline", speedup=1.0, low=1.0, high=1.0, **figures),
        _row("baseline (control)", speedup=1.01, low=0.98, high=1.03, **figures),
        _row("amp", speedup=1.5, low=1.4, high=1.6, **figures),
        _row("slow", speedup=0.7, low=0.6, high=0.8, **figures),
        _row("noise", speedup=1.02, low=0.9, high=1.1, **figures),
    ]
    results = _results(rows, ROLES, config={"blocks": 1})
    assert list(results.table.verdict[2:]) == ["faster", "slower", "within noise"]
    figure = results.plot()
    speed, phases, _ = figure.axes
    bar_colour = {}  # each arm's speedup bar: the one starting at 1 on its row
    for patch in speed.patches:
        if patch.get_x() == 1 and patch.get_width() != 0:
            bar_colour[round(patch.get_y() + patch.get_height() / 2)] = to_hex(patch.get_facecolor())
    # rows are drawn bottom-up: noise 0, slow 1, amp 2
    assert bar_colour[2] == VERDICT_COLORS["faster"] and bar_colour[1] == VERDICT_COLORS["slower"]
    assert bar_colour[0] not in VERDICT_COLORS.values()
    legend = figure.legends[0]
    shown = [text.get_text() for text in legend.get_texts()]
    verdicts = [label for label in shown if label.endswith("(the verdict)")]
    assert verdicts == ["faster (the verdict)", "within noise (the verdict)", "slower (the verdict)"]
    within = legend.legend_handles[shown.index("within noise (the verdict)")]
    assert to_hex(within.get_facecolor()) == bar_colour[0]  # the key says what the blue bar means
    assert "x 1 block, batch" in figure.get_suptitle()  # not "1 blocks"
    assert "data" not in shown  # 0.15% of the step, under a pixel: no bar, no entry
    assert {"forward", "backward", "optimizer"} <= set(shown)  # 0.3%: a thin bar, named


def _drawn(figure):
    """The figure laid out and drawn, with the renderer that measures its text."""
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    return figure, renderer


def _tick_label_boxes(axes, renderer) -> list:
    """The x tick labels' boxes on the page, left to right."""
    boxes = [label.get_window_extent(renderer) for label in axes.get_xticklabels() if label.get_text()]
    return sorted(boxes, key=lambda box: box.x0)


@pytest.mark.parametrize("width", [6.0, 7.0, 10.0, 13.0])
def test_the_plot_at_any_width_keeps_its_legend_inside_and_its_tick_labels_apart(width):
    """plot(width=7) cut its legend at both sides and ran tick labels together ("0.250.33")."""
    figures = dict(activation_mb=3.0, peak_mem_mb=10.0, step_ms=400.0, forward_ms=150.0, backward_ms=247.0)
    rows = [
        _row("baseline", speedup=1.0, low=1.0, high=1.0, **figures),
        _row("baseline (control)", speedup=1.01, low=0.98, high=1.03, **figures),
        _row("grad_accum[steps=4]", speedup=0.67, low=0.3, high=1.9, **figures),
        _row("amp", speedup=1.5, low=1.4, high=1.6, **figures),
    ]
    figure, renderer = _drawn(_results(rows, ROLES).plot(width=width))
    page = figure.bbox
    for text in figure.legends[0].get_texts():
        box = text.get_window_extent(renderer)
        assert box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1, (width, text.get_text())
    for axes in figure.axes:
        for left, right in itertools.pairwise(_tick_label_boxes(axes, renderer)):
            assert left.x1 <= right.x0 + 0.5, (width, axes.get_title())
        label = axes.xaxis.label.get_window_extent(renderer)
        assert label.x0 >= page.x0 - 1 and label.x1 <= page.x1 + 1, (width, axes.xaxis.label.get_text())


def test_the_speedup_ticks_on_the_panels_narrow_axis_stay_apart():
    """In the panel (a 10-inch figure, a 2.7-inch throughput axis), an amp arm at 0.23x [0.16,
    0.33] and a control up to 1.27 gave ticks 0.25 and 0.33 that ran together ("0.250.33")."""
    figures = dict(activation_mb=0.4, peak_mem_mb=4.8, step_ms=7.0, forward_ms=2.0, backward_ms=3.0)
    rows = [
        _row("baseline", speedup=1.0, low=1.0, high=1.0, **figures),
        _row("baseline (control)", speedup=0.99, low=0.76, high=1.27, **figures),
        _row("amp", speedup=0.23, low=0.16, high=0.33, **figures),
        _row("grad_accum", speedup=0.69, low=0.59, high=0.81, **figures),
    ]
    figure, renderer = _drawn(_results(rows, ROLES).plot(width=10))
    speed = figure.axes[0]
    for left, right in itertools.pairwise(_tick_label_boxes(speed, renderer)):
        assert right.x0 - left.x1 >= 4, [label.get_text() for label in speed.get_xticklabels()]


def test_a_baseline_that_did_not_run_is_the_first_warning_and_the_plots_first_clause():
    """Every arm failed with the user's own error, and the run came back with no warning at all."""
    from workbench.plots import _results_title

    reason = "block 1: RuntimeError: boom in my forward"
    rows = [_row("baseline", status="failed", reason=reason), _row("amp", status="failed", reason=reason)]
    results = _results(rows, {"baseline": "baseline"})
    said = results.warnings()
    assert said[0].startswith(
        "the baseline did not run, so no arm has a speedup: failed, block 1: RuntimeError"
    )
    assert "res.record['units']" in said[0]
    title, warned = _results_title(results, 200)
    assert warned and "WARNING: the baseline did not run, so no arm has a speedup" in title
    ran = _results([_row("baseline", speedup=1.0, low=1.0, high=1.0), rows[1]], {"baseline": "baseline"})
    assert not any("baseline did not run" in warning for warning in ran.warnings())
    # Stopped before its first block ended: nothing to fix, and no traceback to read.
    stopped = _row("baseline", status="interrupted", reason="interrupted, 0 of 2 blocks finished")
    said = _results([stopped], {"baseline": "baseline"}).warnings()[0]
    assert said.endswith("Run the same command again (the same out) to resume it") and "Fix" not in said


def test_a_run_where_no_arm_measured_a_step_plots_each_arms_reason_not_empty_panels():
    """Every arm failed: the plot had an empty breakdown, a memory axis of +-0.04 MiB, and the
    reasons only in the table."""
    reason = "block 1: RuntimeError: boom in my forward on call 3"
    rows = [
        _row("baseline", status="failed", reason=reason),
        _row("baseline (control)", status="failed", reason=reason),
        _row("channels_last", status="unavailable", reason="mlp has no Conv2d layers"),
    ]
    for width in (13.0, 7.0):
        figure, renderer = _drawn(_results(rows, ROLES).plot(width=width))
        assert len(figure.axes) == 1 and not figure.axes[0].axison
        said = "\n".join(text.get_text() for text in figure.axes[0].texts)
        assert f"baseline: failed, {reason}" in said
        assert "channels_last: unavailable, mlp has no Conv2d layers" in said
        page = figure.bbox
        for text in figure.axes[0].texts:  # inside the figure, not cut off at its foot or side
            box = text.get_window_extent(renderer)
            assert box.y0 >= page.y0 and box.x1 <= page.x1 + 1, width
    ran = [_row("baseline", speedup=1.0, low=1.0, high=1.0), rows[2]]
    assert len(_results(ran, ROLES).plot().axes) == 3  # one arm measured: the usual three panels


def test_without_a_control_the_legend_does_not_speak_of_its_band():
    """With control=False the note under the table still said "outside the control arm's band"."""
    from workbench.results_view import legend, reader_rows

    alone = [
        result_row("baseline", speedup=1.0, low=1.0, high=1.0),
        result_row("amp", speedup=1.2, low=1.1, high=1.3),
    ]
    _, rows = reader_rows(synthetic_results(alone).table)
    assert "no control arm ran" in legend(rows) and "control arm's band" not in legend(rows)
    controlled = [*alone, result_row("baseline (control)", speedup=1.0, low=0.98, high=1.02)]
    _, rows = reader_rows(synthetic_results(controlled).table)
    assert "control arm's band" in legend(rows)


def test_an_arm_that_ran_without_a_baseline_is_drawn_not_compared_not_as_a_red_ok():
    rows = [
        result_row("baseline", "oom", "needs 37 MiB, more than memory_cap_mb=30 allows"),
        result_row("amp"),
    ]
    texts = {t.get_text(): t.get_color() for t in synthetic_results(rows).plot().axes[0].texts}
    assert texts["oom"] == "#c44e52" and texts["not compared"] == "#666666" and "ok" not in texts


def test_where_the_memory_cap_refused_an_arm_the_table_shows_each_arms_peak():
    """The cap is checked against the peak, which only Results.table showed: the table read
    'oom' beside activations alone."""
    over = "baseline needs 37 MiB at its peak, more than memory_cap_mb=30 allows"
    rows = [
        result_row("baseline", "oom", over, peak_mem_mb=37.3),
        result_row("checkpointing", peak_mem_mb=22.8),
    ]
    text = synthetic_results(rows).summary(width=100)
    assert "peak MiB" in text and "37.3" in text and "22.8" in text
    assert "peak: the most the arm's tensors held in a step" in text
    assert "peak MiB" not in synthetic_results([result_row("baseline"), result_row("amp")]).summary(width=100)


def test_a_record_from_before_blocks_reads_in_todays_terms():
    """A run saved by workbench before blocks (schema 1, made by ea06827^ with -t amp --repeats 2):
    the report's Reproduce dropped its technique (its arms kept their settings only in labels)
    and its repeats, and compare listed repeats, blocks, isolate, heap and amp's settings as
    differences that were not."""
    from workbench.report import reproduce

    old = load_results(Path(__file__).parent / "records" / "schema1-mlp-amp")
    assert old.record["schema"] == "workbench-results/1"
    assert old.config["blocks"] == 2 and "repeats" not in old.config
    command, python = reproduce(old.record)
    assert "-t amp" in command and "--blocks 2" in command and "techniques={'amp': True}" in python
    new = _run(
        1.2,
        1.1,
        1.3,
        config={"steps": 10, "blocks": 2, "techniques": {"amp": "amp(dtype=bfloat16, level=O1)"}},
    )
    assert set(wb.compare(old, new).differences) <= {"torch", "cpu", "gpus", "warmup", "timeout_s"}
