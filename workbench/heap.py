"""The C heap a measuring process allocates from: glibc's malloc, held steady.

On CPU every tensor comes from the C library's ``malloc``. glibc adapts as it goes: a chunk
above its mmap threshold gets fresh pages from the kernel (zeroed, one page fault per 4 KiB)
and returns them when freed; freeing such a chunk raises the threshold to its size; and free
memory at the top of the heap past a trim threshold goes back to the kernel, to be faulted in
again by the next step. Where those thresholds stand depends on every allocation the process
has made so far. In a block, that history belongs to all the arms together.

Measured here (benchmarks/heap_faults.py; BENCHMARKS.md, "One heap for every arm"),
resnet-mini on textures, batch 32, 30 steps per arm: the baseline paid 51-229 minor page
faults per step alone, up to 2,244 beside an amp arm and 3,414-6,060 beside amp and
grad_accum, each fault a trip into the kernel for a zeroed 4 KiB page, because the other
arms' allocations and frees moved glibc's thresholds. So the baseline ran slower in a block
than alone, every speedup over it came out larger, and by an amount that differed from
process to process.

Held steady (the mmap threshold fixed at glibc's own ceiling for its adaptive one, 32 MiB,
and no trimming), the same baseline paid 34-43 faults per step alone and 154-262 beside the
others. Every arm is then measured without glibc's trim-and-refault cycle, the same way in
every process and beside any arms. A job of its own under glibc's defaults may or may not
pay that cycle: alone for 200 steps, the baseline still paid 229 and 367 faults per step over
its last 50 in two processes of three, and none in the third. To see what the defaults cost
a job, measure with ``heap="as-is"`` and ``isolate=True`` (every arm alone, as its own job).
The cost of holding the heap: freed memory stays with the process until it ends (workers are
short-lived), and its RSS stays at its high-water mark, which is what workbench reports.

``RunConfig.heap="as-is"`` leaves the heap alone, to measure with glibc's adaptive
behaviour (or with an allocator preloaded with LD_PRELOAD, which this never touches).
"""

from __future__ import annotations

import ctypes
import os

HEAP_CHOICES = ("steady", "as-is")

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for its adaptive mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and
# the largest value mallopt accepts: chunks up to here come from the heap, as they would once a
# long job's threshold had risen.
MMAP_THRESHOLD_BYTES = 32 * 2**20
_NO_TRIMMING = -1  # man mallopt: "Setting M_TRIM_THRESHOLD to -1 disables trimming completely"

_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard")


def hold_heap_steady(choice: str = "steady") -> str:
    """Fix glibc's malloc thresholds for this process (see the module docstring).

    Returns what was done, in words, for the block's record: ``steady: ...`` when the
    thresholds were set, ``as-is: <why>`` when the heap was left alone.
    """
    if choice not in HEAP_CHOICES:
        raise ValueError(f"heap must be one of {', '.join(HEAP_CHOICES)}, not {choice!r}")
    if choice == "as-is":
        return "as-is: asked for (heap='as-is')"
    preloaded = os.environ.get("LD_PRELOAD", "")
    other = next((name for name in _OTHER_ALLOCATORS if name in preloaded.lower()), None)
    if other is not None:
        return f"as-is: {other} is preloaded (LD_PRELOAD) and replaces glibc's malloc"
    try:
        libc = ctypes.CDLL("libc.so.6")
        version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "as-is: the C library is not glibc (macOS, musl), whose thresholds these are"
    version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, _NO_TRIMMING)):
        return f"as-is: glibc {version().decode()} refused the settings"
    return (
        f"steady: glibc {version().decode()}, chunks up to {MMAP_THRESHOLD_BYTES >> 20} MiB from the heap, "
        "no trimming"
    )
