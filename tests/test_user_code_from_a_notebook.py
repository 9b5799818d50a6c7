"""A model, dataset and loss defined in notebook cells (in __main__) run in every arm's process."""

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    """
import torch
from torch import nn
import workbench as wb

class TinyNet(nn.Module):          # defined in __main__: no file to import it from
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    def forward(self, x):
        return self.layers(x)

class NoisyBlobs(torch.utils.data.Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 6, generator=g) + self.y[:, None].float()
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

def my_loss(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, label_smoothing=0.1)
""",
    """
res = wb.ablate(model=TinyNet, data=NoisyBlobs(), loss_fn=my_loss,
                techniques={"checkpointing": {"select": "layers.*"}, "grad_accum": {"steps": 2}, "dataloader": {"num_workers": 1}},
                steps=4, warmup=1, blocks=1, batch_size=16, out=False, progress=False)
table = res.table.set_index("arm")
print(dict(table.status))
assert set(table.status) == {"ok"}, table[["status", "reason"]]
assert "checkpointed layers.0" in table.loc["checkpointing", "notes"]
""",
]


@pytest.mark.slow
def test_factories_defined_in_a_notebook_cell(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    printed = "".join(output.get("text", "") for output in notebook.cells[1].outputs)
    assert "'checkpointing': 'ok'" in printed and "'dataloader': 'ok'" in printed
