"""What checkpointing's default selector saves: activation memory with and without it, per model.

Run:  python benchmarks/checkpointing_memory.py [--json benchmarks/results/checkpointing-memory.json]

For the built-in models and for library models built from their configs (no downloads):
a Hugging Face causal LM (GPT-2 layout), a Hugging Face encoder classifier (BERT layout, dict
batches with labels), and, where timm imports, a timm ViT and a timm ResNet. Each is one
ablation (baseline and checkpointing, one block): ``activation_mb`` is what autograd saved for
backward during a step (saved-tensor hooks), so weights, gradients and optimizer state, which
dominate ``peak_mem_mb``, do not hide the saving. The models the library cannot build here are
listed with the reason.
"""

from __future__ import annotations

import argparse
import json
import time


def library_models() -> dict[str, tuple]:
    """name -> (factory, batches) for the library models that can be built here, or a reason."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (8, 64), generator=generator)
    lm_batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}] * 4
    classes = torch.randint(0, 4, (8,), generator=generator)
    classifier_batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": classes}] * 4
    images = [(torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,)))] * 4
    models: dict[str, tuple] = {}
    try:
        import transformers

        def gpt2():
            config = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=128, n_positions=64)
            return transformers.GPT2LMHeadModel(config)

        def bert():
            config = transformers.BertConfig(
                num_hidden_layers=4,
                hidden_size=128,
                num_attention_heads=4,
                intermediate_size=256,
                vocab_size=128,
                max_position_embeddings=64,
                num_labels=4,
            )
            return transformers.BertForSequenceClassification(config)

        models["hf-gpt2 (causal LM)"] = (gpt2, lm_batches)
        models["hf-bert (classifier)"] = (bert, classifier_batches)
    except Exception as error:  # noqa: BLE001 - any import failure is the reason
        models["hf-*"] = (None, f"transformers: {type(error).__name__}: {error}")
    try:
        import timm

        models["timm-vit"] = (
            lambda: timm.create_model(
                "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, num_classes=10
            ),
            images,
        )
        models["timm-resnet18"] = (lambda: timm.create_model("resnet18", num_classes=10), images)
    except Exception as error:  # noqa: BLE001 - torchvision built for another torch raises RuntimeError
        models["timm-*"] = (None, f"timm: {type(error).__name__}: {str(error)[:200]}")
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import workbench as wb
    from workbench.environment import machine_summary

    cases: dict[str, tuple] = {name: (name, None) for name in ("mlp", "resnet-mini", "gpt-mini")}
    cases.update(library_models())
    rows, started = [], time.time()
    for name, (model, data) in cases.items():
        if model is None:
            rows.append({"model": name, "unavailable": data})
            print(f"{name:24s} unavailable: {data}")
            continue
        results = wb.ablate(
            model=model,
            data=data,
            techniques={"checkpointing": True},
            steps=4,
            warmup=1,
            blocks=1,
            batch_size=8,
            control=False,
            device="cpu",
            out=False,
            progress=False,
        )
        table = results.table.set_index("arm")
        before, after = table.loc["baseline", "activation_mb"], table.loc["checkpointing", "activation_mb"]
        row = {
            "model": name,
            "activation_mb": before,
            "checkpointed_activation_mb": after,
            "saved_pct": 100 * (1 - after / before),
            "peak_mem_mb": table.loc["baseline", "peak_mem_mb"],
            "checkpointed_peak_mem_mb": table.loc["checkpointing", "peak_mem_mb"],
            "checkpointed": table.loc["checkpointing", "notes"].split(";")[0],
        }
        rows.append(row)
        print(
            f"{name:24s} activations {before:8.2f} -> {after:7.2f} MiB ({row['saved_pct']:.0f}% saved); "
            f"peak {row['peak_mem_mb']:.1f} -> {row['checkpointed_peak_mem_mb']:.1f} MiB; {row['checkpointed']}"
        )
    if args.json:
        record = {
            "benchmark": "checkpointing_memory",
            "rows": rows,
            "wall_s": time.time() - started,
            "machine": machine_summary(),
        }
        with open(args.json, "w") as file:
            json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()
