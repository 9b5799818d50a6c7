"""16-bit floats on a CPU: whether this CPU computes them natively, and what amp says when not.

Without AVX512-BF16/AMX (x86) or BF16 (Arm), bfloat16 autocast converts around every operator and
runs slower than float32 (BENCHMARKS.md, "When the CPU has no bfloat16 instructions"). The arm's
notes and the advisor say so; these tests feed both answers through the same code.
"""

from __future__ import annotations

import pytest
import torch
from helpers import block_spec

import workbench.techniques.amp
from workbench.block import BlockArm
from workbench.devices import cpu_flags, cpu_lacks_native
from workbench.distributed import Rank

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16
"""
ARM_CPUINFO = """processor\t: 0
Features\t: fp asimd evtstrm aes asimdhp bf16
"""


def test_the_flags_are_read_from_x86_and_arm_cpuinfo(tmp_path):
    (tmp_path / "x86").write_text(X86_CPUINFO)
    (tmp_path / "arm").write_text(ARM_CPUINFO)
    assert cpu_flags(str(tmp_path / "x86")) >= {"avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "arm")) >= {"asimdhp", "bf16"}
    assert cpu_flags(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    ("machine", "flags", "dtype", "emulated"),
    [
        ("x86_64", {"avx2", "fma"}, "bfloat16", "AVX512-BF16 or AMX-BF16"),
        ("x86_64", {"avx2", "avx512_bf16"}, "bfloat16", None),
        ("x86_64", {"avx2", "amx_bf16"}, "bfloat16", None),
        ("x86_64", {"avx2", "avx512_bf16"}, "float16", "AVX512-FP16 or AMX-FP16"),
        ("x86_64", {"avx512_fp16"}, "float16", None),
        ("aarch64", {"asimd"}, "bfloat16", "BF16"),
        ("aarch64", {"asimd", "bf16"}, "bfloat16", None),
        ("riscv64", set(), "bfloat16", None),  # an architecture it does not know: no guess
    ],
)
def test_a_cpu_without_the_instructions_is_named_with_the_missing_ones(machine, flags, dtype, emulated):
    reason = cpu_lacks_native(dtype, frozenset(flags), machine=machine)
    if emulated is None:
        assert reason is None
    else:
        assert f"has no {dtype} instructions ({emulated})" in reason and "slower than float32" in reason


def _amp_notes(monkeypatch, flags: set[str], dtype: str = "bfloat16", level: str = "O1") -> list[str]:
    monkeypatch.setattr(workbench.techniques.amp, "cpu_lacks_native",
                        lambda d: cpu_lacks_native(d, frozenset(flags), machine="x86_64"))  # fmt: skip
    spec = block_spec("mlp", {"amp": {"dtype": dtype, "level": level}}, batch_size=8)
    arm = BlockArm(spec.arms[0], model=spec.model, data=spec.data, loss_fn=None, run=spec.run,
                   device=torch.device("cpu"), rank=Rank(), shared=False)  # fmt: skip
    arm.build()
    try:
        return arm.notes
    finally:
        arm.release()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_amp_arm_notes_that_this_cpu_emulates_its_dtype(monkeypatch, level):
    emulated = " ".join(_amp_notes(monkeypatch, {"avx2"}, level=level))
    assert "has no bfloat16 instructions (AVX512-BF16 or AMX-BF16)" in emulated
    native = " ".join(_amp_notes(monkeypatch, {"avx2", "avx512_bf16"}, level=level))
    assert "bfloat16" in native and "instructions" not in native
