"""The CPU-side check of kernels/: every .cu file compiles with NVRTC for sm_75, sm_80 and sm_90.

CI has no GPU, but NVRTC is a compiler library, so a syntax or type error in any kernel
(or a macro that stops instantiating an entry point) fails here, before a GPU ever sees it.
"""

import pytest

from workbench import raw_kernels


def test_nvrtc_loads():
    """Not a skip: the dev extra installs NVRTC, and a check that silently skipped would pass CI."""
    assert raw_kernels.nvrtc_unavailable_reason() is None, raw_kernels.nvrtc_unavailable_reason()


@pytest.mark.parametrize("arch", raw_kernels.ARCHITECTURES)
@pytest.mark.parametrize("name", raw_kernels.KERNELS)
def test_kernel_compiles_without_warnings(name, arch):
    result = raw_kernels.compile_kernel(name, arch)
    assert result.ok, f"kernels/{name}.cu does not compile for {arch}:\n{result.log}"
    assert "warning" not in result.log, f"kernels/{name}.cu compiles with warnings for {arch}:\n{result.log}"
    # four dtypes per kernel function: f64, f32, f16, bf16
    assert result.entry_points == len(raw_kernels.entry_points(name)) >= 4
    assert result.cubin_bytes > 0


def test_every_kernel_file_is_checked():
    """A new .cu file in kernels/ must be listed in raw_kernels.KERNELS, or it would go unchecked."""
    on_disk = {path.stem for path in raw_kernels.kernel_dir().glob("*.cu")}
    assert on_disk == set(raw_kernels.KERNELS)


def test_a_syntax_error_fails_the_check():
    broken = raw_kernels.source("bias_gelu").replace(
        "y[i] = Element<T>::store(", "y[i] = Element<T>::store((", 1
    )
    result = raw_kernels.compile_source(broken, "bias_gelu", "sm_90", raw_kernels.entry_points("bias_gelu"))
    assert not result.ok
    assert "error" in result.log and result.entry_points == 0


def test_a_missing_entry_point_fails_the_check():
    text = 'extern "C" __global__ void present() {}'
    result = raw_kernels.compile_source(text, "probe", "sm_80", ["present", "absent"])
    assert not result.ok
    assert "missing entry points: absent" in result.log


def test_compile_check_table_covers_every_kernel_and_architecture():
    table = raw_kernels.compile_check()
    assert len(table) == len(raw_kernels.KERNELS) * len(raw_kernels.ARCHITECTURES)
    assert table["ok"].all(), table[~table["ok"]]["log"].tolist()
    assert set(table["arch"]) == set(raw_kernels.ARCHITECTURES)


@pytest.mark.parametrize("name", raw_kernels.KERNELS)
def test_each_source_carries_the_header_it_includes(name):
    """CuPy's disk cache is keyed by the source text, not by the files it includes: with the
    #include left in, a kernel built from an older common.cuh was loaded again after an edit."""
    text = raw_kernels.compiled_source(name)
    assert raw_kernels.HEADER_INCLUDE not in text and "struct bfloat16" in text
    assert raw_kernels.HEADER_INCLUDE in raw_kernels.source(name)  # shown as written (notebooks/11)
