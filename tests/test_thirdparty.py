"""The thirdparty tier: real Hugging Face and timm models, built from configs (no downloads),
in a small ablation each. Every arm must be ok, its loss parity reported, and checkpointing's
default selector must cut each model's activation memory by at least 40%.

timm needs a torchvision built for the installed torch. On a CPU-only torch, PyPI's
torchvision (a CUDA build) does not import, and these tests skip with that reason.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import workbench as wb

transformers = pytest.importorskip("transformers", reason="the thirdparty extra is not installed")
CHECKPOINTING_SAVES_AT_LEAST = 0.40  # of the activation memory, at the default selector
ARMS = {"amp": {"dtype": "bfloat16"}, "checkpointing": True, "grad_accum": {"steps": 2}}


def _timm_or_skip():
    try:
        import timm
    except Exception as error:  # an ImportError, or torchvision's RuntimeError when it does not fit torch
        pytest.skip(f"timm cannot be imported here ({type(error).__name__}: {str(error)[:160]})")
    return timm


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=3, n_head=2, n_embd=64, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def tiny_bert_classifier():
    config = transformers.BertConfig(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        num_labels=4,
    )
    return transformers.BertForSequenceClassification(config)


def tiny_vit():
    return _timm_or_skip().create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=4, num_classes=10
    )


def tiny_resnet():
    return _timm_or_skip().create_model("resnet18", pretrained=False, num_classes=10)


def _token_batches(labels_per_sequence: bool) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 128, (8, 32), generator=generator)
        labels = torch.randint(0, 4, (8,), generator=generator) if labels_per_sequence else ids
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return batches


def _image_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(4)
    ]


CASES = {
    "hf-causal-lm": (tiny_gpt2, lambda: _token_batches(labels_per_sequence=False)),
    "hf-encoder-classifier": (tiny_bert_classifier, lambda: _token_batches(labels_per_sequence=True)),
    "timm-vit": (tiny_vit, _image_batches),
    "timm-cnn": (tiny_resnet, _image_batches),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_library_model_ablates_as_it_is(case, tmp_path):
    build, data = CASES[case]
    build()  # skips here when the library cannot be imported
    results = wb.ablate(
        model=build,
        data=data(),
        techniques=ARMS,
        steps=4,
        warmup=1,
        blocks=1,
        batch_size=8,
        device="cpu",
        out=tmp_path / case,
        progress=False,
    )
    table = results.table.set_index("arm")
    assert set(table.status) == {"ok"}, table.reason.to_dict()
    assert table.loss_vs_baseline.map(math.isfinite).all(), "every arm's loss parity is reported"
    # Hugging Face's masks read values (no meta run): their FLOPs are counted on the CPU instead.
    assert (table.tflops > 0).all(), table.notes.to_dict()
    saved = 1 - table.loc["checkpointing", "activation_mb"] / table.loc["baseline", "activation_mb"]
    assert saved >= CHECKPOINTING_SAVES_AT_LEAST, (
        f"{case}: checkpointing saved {saved:.0%} of the activation memory "
        f"({table.loc['baseline', 'activation_mb']:.2f} -> {table.loc['checkpointing', 'activation_mb']:.2f} MiB)"
    )


def test_a_causal_lm_without_labels_is_refused_before_any_arm_runs():
    batches = [
        {key: value for key, value in batch.items() if key != "labels"} for batch in _token_batches(False)
    ]
    with pytest.raises(ValueError, match=r"CausalLMOutputWithCrossAttentions with fields logits.*'labels'"):
        wb.plan(model=tiny_gpt2, data=batches, batch_size=8, device="cpu")


def test_the_readmes_hugging_face_example_runs(tmp_path, monkeypatch, capsys):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("```python\nimport torch\nfrom transformers import")
    code = readme[start + len("```python\n") : readme.index("```", start + 10)]
    monkeypatch.chdir(tmp_path)  # its results folder goes under ./workbench-results
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    table = namespace["res"].table
    assert set(table.status) == {"ok"} and "activation_mb" in capsys.readouterr().out
