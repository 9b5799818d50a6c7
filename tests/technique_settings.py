"""One row per registered technique: the settings the shared, parametrized tests use.

Adding a technique = adding its module under workbench/techniques/ and one row here, plus
its effect check in tests/test_technique_effects.py; test_every_registered_technique_has_a_row
and test_every_technique_has_an_effect_check fail until both exist.

config   what the tests pass as the technique's settings (small, fast values)
models   the built-in models it applies to (the trains-a-few-steps test runs each)
effect   what its effect test observes, which a no-op apply() would not show
         (tests/test_technique_effects.py holds the check that observes it)
slow     True when one run costs more than a few seconds (compilation, rank processes)
data     the built-in dataset to train on, when the model's own will not do (default: its own)
world_size  ranks, for techniques that need several (the run then uses fresh rank processes)
"""

ALL_MODELS = ("mlp", "resnet-mini", "gpt-mini")

TECHNIQUE_SETTINGS = {
    "dataloader": {
        "config": {"num_workers": 1},
        "models": ALL_MODELS,
        "effect": "the arm's DataLoader has the configured workers, and they (not the training process) load the samples",
    },
    "dali": {
        "config": {"threads": 1},
        "models": ("mlp", "resnet-mini"),
        "data": "jpeg",
        "effect": "every batch the model sees was produced by DALI's PyTorch iterator, and no DataLoader was built",
    },
    "prefetch": {
        "config": {"depth": 2},
        "models": ALL_MODELS,
        "effect": "the step's batches come from the side-stream prefetcher, already on the device, depth steps ahead",
    },
    "tf32": {
        "config": True,
        "models": ALL_MODELS,
        "effect": "TF32 matmul/cuDNN flags are on inside the model's forward, and as before after the arm's window",
    },
    "cupy_fusion": {
        "config": True,
        "models": ALL_MODELS,
        "effect": "fused modules and FusedAdamW replace the originals, and their CuPy kernels launch during a step",
    },
    "cuda_graphs": {
        "config": {"warmup_steps": 1},
        "models": ALL_MODELS,
        "effect": "after the eager warm-up the step is a CUDA graph replay: replays counted, Python forward not rerun",
    },
    "checkpointing": {
        "config": True,
        "models": ALL_MODELS,
        "effect": "fewer bytes saved for backward (saved_tensors_hooks) than the same model without it",
    },
    "channels_last": {
        "config": True,
        "models": ("resnet-mini",),
        "effect": "conv weights, the inputs reaching the model and its first activation are NHWC (channels_last)",
    },
    "amp": {
        "config": {"dtype": "bfloat16"},
        "models": ALL_MODELS,
        "effect": "autocast is enabled with the configured dtype inside the model's forward; outputs in that dtype",
    },
    "grad_accum": {
        "config": {"steps": 2},
        "models": ALL_MODELS,
        "effect": "the forward runs once per micro-batch before each optimizer step, and the summed gradient "
        "equals the full batch's",
    },
    "ddp_compression": {
        "config": {"hook": "fp16"},
        "models": ("mlp", "resnet-mini"),
        "world_size": 2,
        "slow": True,  # two rank processes per run
        "effect": "the bytes DDP's comm hook hands to all_reduce per step shrink (half of float32 for fp16/bf16)",
    },
    "compile": {
        "config": True,
        "models": ALL_MODELS,
        "slow": True,
        "effect": "the model that runs is an OptimizedModule, and TorchDynamo compiles its frames during a step",
    },
}
