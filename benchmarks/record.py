"""What a benchmark script writes: its figures as JSON, with the machine they came from.

Imported by the scripts beside it (``python benchmarks/NAME.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import json
from pathlib import Path


def table_rows(results, columns: list[str]) -> list[dict]:
    """The given columns of a Results table, one JSON-ready dict per arm (NaN as null)."""
    return json.loads(results.table[columns].to_json(orient="records"))


def write_record(path: str | Path, benchmark: str, **figures) -> None:
    """``{"benchmark": ..., **figures, "machine": ...}`` to ``path``: the machine summary names the
    CPU, torch, Python and the git revision measured."""
    from workbench.environment import machine_summary

    record = {"benchmark": benchmark, **figures, "machine": machine_summary()}
    Path(path).write_text(json.dumps(record, indent=1, default=str))


def link_conditions(bandwidths: list[float], latency_ms: float) -> list[tuple[str, dict | None]]:
    """``(label, link)`` for the real connection between the ranks (loopback), then each
    simulated bandwidth in Gbit/s: the ``link=`` values a sweep over networks passes to ablate."""
    conditions: list[tuple[str, dict | None]] = [("loopback", None)]
    conditions += [
        (f"{gbps:g} Gbit/s", {"bandwidth_gbps": gbps, "latency_ms": latency_ms}) for gbps in bandwidths
    ]
    return conditions
