"""How long a run waits for its first worker: with the warm template kept from an earlier run
in the same Python process, against one started for each run (WORKBENCH_KEEP_WARM_S=0).

Each round runs the same small ablation twice in this process, once each way, in alternating
order; the figure is the time from the ``ablate`` call to its first process's "start" event
(everything before the first block: checks, planning, the template). The run's own work
after that is the same either way and is reported beside it, so a difference there would show.

    python benchmarks/template_reuse.py --rounds 5 --json benchmarks/results/template-reuse.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from record import write_record

import workbench as wb
from workbench.template import close_kept_template


def one_run(keep_warm: bool) -> tuple[float, float]:
    """Seconds to the first process's start, and from there to the end of the run."""
    os.environ["WORKBENCH_KEEP_WARM_S"] = "300" if keep_warm else "0"
    began = time.perf_counter()
    first_start: list[float] = []

    def on_event(event: dict) -> None:
        if event["type"] == "start" and not first_start:
            first_start.append(time.perf_counter())

    wb.ablate(model="mlp", techniques={"grad_accum": True}, steps=20, warmup=2, blocks=1,
              out=False, progress=False, on_event=on_event)  # fmt: skip
    ended = time.perf_counter()
    return first_start[0] - began, ended - first_start[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    one_run(keep_warm=False)  # imports torch and builds the dataset cache in this process first
    figures: dict[str, list[tuple[float, float]]] = {"kept": [], "started": []}
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for keep_warm in order:
            if keep_warm:  # the run before it (or the warm-up) closed its template: keep one first
                one_run(keep_warm=True)
            figures["kept" if keep_warm else "started"].append(one_run(keep_warm))
            close_kept_template()
    summary = {}
    for way, runs in figures.items():
        to_start = [round(a, 2) for a, _ in runs]
        work = [round(b, 2) for _, b in runs]
        summary[way] = {"to_first_start_s": to_start, "median_to_first_start_s": statistics.median(to_start),
                        "rest_of_run_s": work, "median_rest_of_run_s": statistics.median(work)}  # fmt: skip
        print(f"{way:8s} to the first process: {to_start} (median {statistics.median(to_start):.2f} s); "
              f"the rest of the run: median {statistics.median(work):.2f} s")  # fmt: skip
    if args.json:
        write_record(args.json, "template_reuse", rounds=args.rounds, **summary)


if __name__ == "__main__":
    main()
