"""workbench: honest, controlled ablations of PyTorch training-acceleration techniques.

    import workbench as wb
    wb.list_techniques()
    res = wb.ablate(model="gpt-mini", techniques={"amp": {"dtype": "bfloat16"}, "compile": True})
    res.table, res.plot()

Public names are loaded on first use, so that the process which runs each arm imports
only what training needs (torch), not pandas or matplotlib.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

__version__ = "0.1.0"


def _find_subpackages_in_the_source_tree() -> None:
    """Installed, datasets/ and kernels/ become workbench.datasets and workbench.kernels
    (pyproject's package-dir). From a source tree on PYTHONPATH, with nothing installed (the GPU
    suite on a machine that has torch but not workbench), they sit beside the package instead:
    look for them there too."""
    source_tree = Path(__file__).resolve().parent.parent
    if (
        not (source_tree / "pyproject.toml").is_file()
        or not (source_tree / "datasets" / "__init__.py").is_file()
    ):
        return
    if importlib.util.find_spec("workbench.datasets") is None:
        __path__.append(str(source_tree))


_find_subpackages_in_the_source_tree()

_EXPORTS = {
    "ablate": "workbench.ablation",
    "plan": "workbench.ablation",
    "advise": "workbench.advisor",
    "Advice": "workbench.advisor",
    "list_techniques": "workbench.techniques",
    "describe": "workbench.techniques",
    "register_technique": "workbench.techniques",
    "Technique": "workbench.techniques",
    "Results": "workbench.results",
    "load_results": "workbench.results",
    "compare": "workbench.compare",
    "Comparison": "workbench.compare",
    "environment": "workbench.environment",
    "list_models": "workbench.models",
    "list_datasets": "workbench.data",
    "JpegFolder": "workbench.jpeg_folder",
    "panel": "workbench.widgets",
    "tune": "workbench.tuner",
}

__all__ = [
    "Advice",
    "Comparison",
    "JpegFolder",
    "Results",
    "Technique",
    "ablate",
    "advise",
    "compare",
    "describe",
    "environment",
    "list_datasets",
    "list_models",
    "list_techniques",
    "load_results",
    "panel",
    "plan",
    "register_technique",
    "tune",
]

if TYPE_CHECKING:
    from workbench.ablation import ablate, plan
    from workbench.advisor import Advice, advise
    from workbench.compare import Comparison, compare
    from workbench.data import list_datasets
    from workbench.environment import environment
    from workbench.jpeg_folder import JpegFolder
    from workbench.models import list_models
    from workbench.results import Results, load_results
    from workbench.techniques import Technique, describe, list_techniques, register_technique
    from workbench.tuner import tune
    from workbench.widgets import panel


def __getattr__(name: str):
    if name in _EXPORTS:
        if name == "panel":  # the one export that needs an optional package
            from workbench import optional

            reason = optional.missing("ipywidgets", "pip install 'workbench[notebook]'")
            if reason:  # named, so that `import *`, help() and hasattr work; calling it says why not
                return _panel_without_ipywidgets(reason)
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def _panel_without_ipywidgets(reason: str):
    def panel(*args, **kwargs):
        """The notebook control panel (workbench.widgets), which needs ipywidgets: not installed here."""
        raise ImportError(f"workbench.panel needs ipywidgets: {reason}")

    return panel


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
