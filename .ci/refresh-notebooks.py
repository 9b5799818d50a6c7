"""Re-execute notebooks in place, so their saved outputs match the code (nbval compares the
cells marked NBVAL_CHECK_OUTPUT with them). Widget views (the panel, tqdm bars) and widget
state are dropped: they are live objects, meaningless once saved.

    python .ci/refresh-notebooks.py notebooks/*.ipynb
"""

import sys
import time

import nbformat
from nbclient import NotebookClient

for path in sys.argv[1:]:
    started = time.time()
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}
    ).execute()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:
                continue  # the panel and tqdm bars: live widgets, meaningless once saved
            kept.append(output)
        cell.outputs = kept
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    print(f"{path}: {time.time() - started:.0f} s", flush=True)
