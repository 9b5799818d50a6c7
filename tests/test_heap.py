"""Measuring processes hold glibc's malloc steady (workbench.heap), and say so in the results."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.heap import hold_heap_steady

# In a fresh interpreter: put 10 MiB on the heap in 100 KiB chunks (below glibc's initial mmap
# threshold, so they come from the heap), touch it, free it all, then do the same again and count
# the page faults of the second round. glibc as it is trims the freed top of the heap back to
# the kernel, so the second round faults its pages in again; held steady, it reuses them.
REFAULTS = """
import ctypes, json, resource, sys
sys.path.insert(0, {root!r})
from workbench.heap import hold_heap_steady
held = hold_heap_steady({choice!r})
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
CHUNK, COUNT = 100 * 1024, 100

def fill():
    chunks = [libc.malloc(CHUNK) for _ in range(COUNT)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, CHUNK)
    for chunk in reversed(chunks):
        libc.free(chunk)

fill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fill()
print(json.dumps({{"held": held, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}}))
"""


def _is_glibc() -> bool:
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018 (only glibc has it)
    except (OSError, AttributeError):
        return False
    return True


needs_glibc = pytest.mark.skipif(not _is_glibc(), reason="the thresholds held steady are glibc's")


def _second_round(choice: str) -> dict:
    root = str(Path(wb.__file__).parents[1])
    script = REFAULTS.format(root=root, choice=choice)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)


@needs_glibc
def test_a_steady_heap_keeps_freed_pages_instead_of_faulting_them_in_again():
    pages = 100 * 100 * 1024 // 4096  # 2,500 pages in each round
    as_is, steady = _second_round("as-is"), _second_round("steady")
    if not steady["held"].startswith("steady"):
        pytest.skip(f"the heap could not be held here: {steady['held']}")
    assert as_is["faults"] > pages / 2, f"glibc as it is should have trimmed and refaulted: {as_is}"
    assert steady["faults"] < pages / 10, f"a steady heap should reuse its pages: {steady}"


def test_a_bad_heap_choice_names_the_valid_ones():
    with pytest.raises(ValueError, match="steady, as-is"):
        hold_heap_steady("jemalloc")
    with pytest.raises(ValueError, match="steady"):
        wb.plan(model="mlp", heap="jemalloc")


def test_a_preloaded_allocator_is_left_alone(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert (
        hold_heap_steady("steady") == "as-is: jemalloc is preloaded (LD_PRELOAD) and replaces glibc's malloc"
    )


@pytest.mark.parametrize("choice", ["steady", "as-is"])
def test_every_block_records_what_was_done_to_its_heap(choice):
    res = wb.ablate(
        model="mlp",
        techniques={},
        steps=2,
        warmup=1,
        blocks=2,
        control=False,
        out=False,
        progress=False,
        heap=choice,
    )
    assert res.config["heap"] == choice
    held = list(res.blocks.heap)
    assert len(held) == 2 and all(h.split(":")[0] == choice for h in held), held
