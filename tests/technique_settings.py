"""One row per registered technique: the settings the shared, parametrized tests use.

Adding a technique = adding its module under workbench/techniques/ and one row here;
test_every_registered_technique_has_a_row fails until the row exists.

config   what the tests pass as the technique's settings (small, fast values)
models   the built-in models it applies to (the trains-a-few-steps test runs each)
slow     True when one run costs more than a few seconds (compilation)
data     the built-in dataset to train on, when the model's own will not do (default: its own)
world_size  ranks, for techniques that need several (the run then uses fresh rank processes)
"""

ALL_MODELS = ("mlp", "resnet-mini", "gpt-mini")

TECHNIQUE_SETTINGS = {
    "dataloader": {"config": {"num_workers": 1}, "models": ALL_MODELS},
    "dali": {"config": {"threads": 1}, "models": ("mlp", "resnet-mini"), "data": "jpeg"},
    "tf32": {"config": True, "models": ALL_MODELS},
    "cupy_fusion": {"config": True, "models": ALL_MODELS},
    "cuda_graphs": {"config": {"warmup_steps": 1}, "models": ALL_MODELS},
    "checkpointing": {"config": True, "models": ALL_MODELS},
    "channels_last": {"config": True, "models": ("resnet-mini",)},
    "amp": {"config": {"dtype": "bfloat16"}, "models": ALL_MODELS},
    "grad_accum": {"config": {"steps": 2}, "models": ALL_MODELS},
    "ddp_compression": {"config": {"hook": "fp16"}, "models": ("mlp", "resnet-mini"), "world_size": 2},
    "compile": {"config": True, "models": ALL_MODELS, "slow": True},
}
