import os
import sys
from pathlib import Path

import pytest

# Built-in datasets are built once per test session into a private cache; the arms'
# processes inherit the variable, so no test touches the user's ~/.cache.
_CACHE = Path(
    os.environ.get(
        "WORKBENCH_TEST_CACHE", Path(__file__).resolve().parent.parent / ".pytest_cache" / "workbench"
    )
)
os.environ.setdefault("WORKBENCH_CACHE", str(_CACHE))

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device; this machine has none")


@pytest.fixture(autouse=True)
def _reset_compiler_state():
    """In-process tests share one interpreter: drop compiled graphs between tests."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
