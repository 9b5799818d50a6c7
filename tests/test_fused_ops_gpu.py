"""The fused CuPy kernels against PyTorch, on a GPU. Every test here skips cleanly without one.

Parity is judged against a float64 PyTorch reference computed from the same inputs, with a
tolerance per dtype: the kernels accumulate in float32 (float64 for float64), so fp16 and
bf16 results may differ from the reference by a rounding of the output.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from workbench import raw_kernels

REASON = raw_kernels.cupy_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

from helpers import train  # noqa: E402

from workbench.fused_ops import (  # noqa: E402
    FusedAdamW,
    bias_gelu,
    layer_norm,
    residual_dropout_layer_norm,
)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) per dtype for outputs; the gradients of reductions get a looser bound below.
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# Odd sizes on purpose: rows and columns that are not multiples of a warp or a block.
SHAPES = [(1, 1), (3, 7), (257, 129), (64, 1000), (2, 5, 33), (4096, 3000)]
CUDA = torch.device("cuda")


def close(actual, expected, dtype, scale=1.0):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale)


def param_dtype(dtype):
    """Parameters stay float32 beside fp16/bf16/fp32 activations (as under autocast); float64 with float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def inputs(shape, dtype, seed=0):
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(shape, device=CUDA, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bias_gelu_matches_pytorch(shape, dtype):
    x = inputs(shape, dtype).requires_grad_()
    bias = inputs(shape[-1:], param_dtype(dtype), seed=1).requires_grad_()
    grad_y = inputs(shape, dtype, seed=2)
    y = bias_gelu(x, bias)
    y.backward(grad_y)

    x64, bias64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    y64 = F.gelu(x64 + bias64)
    y64.backward(grad_y.double())
    assert y.dtype == dtype and y.shape == x.shape
    close(y, y64, dtype)
    close(x.grad, x64.grad, dtype)
    # The bias gradient is a float32 sum (float64 for float64) over rows of unrounded products.
    rows = x.numel() // shape[-1]
    close(bias.grad, bias64.grad, param_dtype(dtype), scale=4 * math.sqrt(rows))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_matches_pytorch(shape, dtype):
    x = (inputs(shape, dtype) * 3 + 1).requires_grad_()
    weight = inputs(shape[-1:], param_dtype(dtype), seed=1).requires_grad_()
    bias = inputs(shape[-1:], param_dtype(dtype), seed=2).requires_grad_()
    grad_y = inputs(shape, dtype, seed=3)
    y = layer_norm(x, weight, bias, eps=1e-5)
    y.backward(grad_y)

    ref = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    y64 = F.layer_norm(ref[0], shape[-1:], ref[1], ref[2], eps=1e-5)
    y64.backward(grad_y.double())
    assert y.dtype == dtype
    close(y, y64, dtype, scale=4)
    close(x.grad, ref[0].grad, dtype, scale=4)
    rows = x.numel() // shape[-1]
    close(weight.grad, ref[1].grad, param_dtype(dtype), scale=16 * math.sqrt(rows))
    close(bias.grad, ref[2].grad, param_dtype(dtype), scale=16 * math.sqrt(rows))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 7), (257, 129), (8, 16, 768)], ids=str)
def test_residual_layer_norm_matches_pytorch(shape, dtype):
    """Gradients reach x and residual through both outputs: y, and h (the residual stream)."""
    x, residual = inputs(shape, dtype).requires_grad_(), inputs(shape, dtype, seed=1).requires_grad_()
    weight = inputs(shape[-1:], param_dtype(dtype), seed=2).requires_grad_()
    bias = inputs(shape[-1:], param_dtype(dtype), seed=3).requires_grad_()
    grad_h, grad_y = inputs(shape, dtype, seed=4), inputs(shape, dtype, seed=5)
    h, y = residual_dropout_layer_norm(x, residual, weight, bias)
    torch.autograd.backward([h, y], [grad_h, grad_y])

    ref = [t.detach().double().requires_grad_() for t in (x, residual, weight, bias)]
    h64 = (ref[1] + ref[0]).to(dtype).double()  # the sum is rounded to dtype, as in eager
    y64 = F.layer_norm(h64, shape[-1:], ref[2], ref[3])
    torch.autograd.backward([h64, y64], [grad_h.double(), grad_y.double()])
    close(h, h64, dtype)
    close(y, y64, dtype, scale=4)
    close(x.grad, ref[0].grad, dtype, scale=4)
    close(residual.grad, ref[1].grad, dtype, scale=4)


def test_mixed_dtypes_are_promoted_like_eager():
    """Under autocast an fp16 sublayer output meets the fp32 residual stream."""
    x, residual = inputs((16, 64), torch.float16), inputs((16, 64), torch.float32, seed=1)
    weight, bias = torch.ones(64, device=CUDA), torch.zeros(64, device=CUDA)
    h, y = residual_dropout_layer_norm(x, residual, weight, bias)
    assert h.dtype == y.dtype == torch.float32
    close(h, residual + x, torch.float32)


def test_gradcheck_float64():
    x = inputs((5, 37), torch.float64).requires_grad_()
    residual = inputs((5, 37), torch.float64, seed=1).requires_grad_()
    weight = inputs((37,), torch.float64, seed=2).requires_grad_()
    bias = inputs((37,), torch.float64, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(bias_gelu, (x, bias))
    assert torch.autograd.gradcheck(lambda *t: layer_norm(*t, eps=1e-5), (x, weight, bias))
    assert torch.autograd.gradcheck(
        lambda a, r, w, b: residual_dropout_layer_norm(a, r, w, b), (x, residual, weight, bias)
    )


def test_dropout_statistics():
    p, n = 0.3, 1 << 22
    x = torch.ones((n // 1024, 1024), device=CUDA, requires_grad=True)
    residual = torch.zeros_like(x)
    weight, bias = torch.ones(1024, device=CUDA), torch.zeros(1024, device=CUDA)
    torch.manual_seed(0)
    h, y = residual_dropout_layer_norm(x, residual, weight, bias, p=p)
    kept = h != 0
    dropped_share = 1 - kept.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped_share - p) < 5 * sigma, dropped_share
    torch.testing.assert_close(h[kept], torch.full_like(h[kept], 1 / (1 - p)))  # inverted dropout scaling
    assert abs(h.mean().item() - 1.0) < 5 * math.sqrt(p / (1 - p) / n)  # expectation preserved
    # Columns and rows both see the rate (no pattern tied to the layout).
    assert (1 - kept.double().mean(0)).std().item() < 0.05 and (1 - kept.double().mean(1)).std().item() < 0.05
    # Backward regenerates the same mask from the seed: gradient flows exactly where x was kept.
    h.sum().backward()
    assert torch.equal(x.grad != 0, kept)
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 1 / (1 - p)))
    # The same torch seed gives the same mask; another gives another; eval mode drops nothing.
    torch.manual_seed(0)
    again, _ = residual_dropout_layer_norm(x, residual, weight, bias, p=p)
    torch.manual_seed(1)
    other, _ = residual_dropout_layer_norm(x, residual, weight, bias, p=p)
    evaluated, _ = residual_dropout_layer_norm(x, residual, weight, bias, p=p, training=False)
    assert torch.equal(again, h) and not torch.equal(other, h)
    assert torch.equal(evaluated, torch.ones_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_fused_adamw_equals_torch_adamw(dtype):
    """N steps of FusedAdamW equal torch.optim.AdamW's, for tensors below, at and above one chunk."""
    sizes = [(1,), (7, 3), (128, 129), (40_000,)]
    reference = [
        torch.nn.Parameter(inputs(size, torch.float32, seed=i).double()) for i, size in enumerate(sizes)
    ]
    fused = [torch.nn.Parameter(p.detach().to(dtype)) for p in reference]
    options = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    torch_adamw = torch.optim.AdamW(reference, **options)  # float64 master: the exact answer
    fused_adamw = FusedAdamW(fused, **options)
    for step in range(20):
        for ref, mine in zip(reference, fused, strict=True):
            grad = inputs(ref.shape, torch.float32, seed=100 + step)
            ref.grad, mine.grad = grad.double(), grad.to(dtype)
        torch_adamw.step()
        fused_adamw.step()
    for ref, mine in zip(reference, fused, strict=True):
        assert mine.dtype == dtype
        # bf16/fp16 parameters are rounded every step: 20 roundings of a ~1 value.
        close(mine, ref, dtype, scale=1 if dtype in (torch.float32, torch.float64) else 4)


def test_fused_adamw_skips_parameters_without_gradients_and_follows_lr_changes():
    used, unused = (
        torch.nn.Parameter(inputs((10,), torch.float32)),
        torch.nn.Parameter(inputs((3,), torch.float32)),
    )
    before = unused.detach().clone()
    optimizer = FusedAdamW([used, unused], lr=0.1)
    reference_param = torch.nn.Parameter(used.detach().clone())
    reference = torch.optim.AdamW([reference_param], lr=0.1)
    for lr in (0.1, 0.01):
        for group in (*optimizer.param_groups, *reference.param_groups):
            group["lr"] = lr
        used.grad = reference_param.grad = inputs((10,), torch.float32, seed=int(lr * 100))
        optimizer.step()
        reference.step()
    assert torch.equal(unused, before) and unused not in optimizer.state
    close(used, reference_param, torch.float32)


@pytest.mark.parametrize("amp", [None, {"dtype": "bfloat16"}], ids=["fp32", "bf16"])
def test_cupy_fusion_trains_gpt_mini_like_the_unfused_model(amp):
    """The technique end to end on CUDA: same seed, same data, the same losses up to rounding."""
    techniques = {"amp": amp} if amp else {}
    plain = train("gpt-mini", techniques, steps=8, warmup=1, device="cuda")
    fused = train("gpt-mini", {**techniques, "cupy_fusion": True}, steps=8, warmup=1, device="cuda")
    assert any("4 Linear + GELU" in note for note in fused["notes"]), fused["notes"]
    assert any("AdamW steps in one launch" in note for note in fused["notes"])
    tolerance = 2e-3 if amp is None else 3e-2
    for mine, theirs in zip(fused["losses"], plain["losses"], strict=True):
        assert abs(mine - theirs) <= tolerance * abs(theirs), (fused["losses"], plain["losses"])


def test_fused_adamw_state_survives_a_state_dict_round_trip():
    """torch.optim casts loaded state to the parameters' dtype; the moments go back to float32."""
    param = torch.nn.Parameter(inputs((1000,), torch.bfloat16))
    optimizer = FusedAdamW([param])
    param.grad = inputs((1000,), torch.bfloat16, seed=1)
    optimizer.step()
    restored = FusedAdamW([param])
    restored.load_state_dict(optimizer.state_dict())
    restored.step()
    state = restored.state[param]
    assert state["step"] == 2 and state["exp_avg"].dtype == torch.float32 and torch.isfinite(param).all()


def test_the_fused_ops_take_non_contiguous_and_empty_inputs():
    """A transposed input is made contiguous first; an empty one launches nothing, either way."""
    x = inputs((33, 64), torch.float32).t().requires_grad_()  # (64, 33), not contiguous
    bias = inputs((33,), torch.float32, seed=1).requires_grad_()
    y = bias_gelu(x, bias)
    close(y, F.gelu(x.double() + bias.double()), torch.float32)
    y.sum().backward()
    assert x.grad.shape == x.shape and bias.grad.shape == bias.shape
    empty = torch.empty((0, 8), device=CUDA, requires_grad=True)
    empty_bias = torch.zeros(8, device=CUDA, requires_grad=True)
    bias_gelu(empty, empty_bias).sum().backward()
    assert empty.grad.shape == (0, 8) and torch.equal(empty_bias.grad, torch.zeros(8, device=CUDA))
    with pytest.raises(ValueError, match="normalized dimension has no values"):
        layer_norm(torch.empty((4, 0), device=CUDA), torch.ones(0, device=CUDA), torch.zeros(0, device=CUDA))


def test_a_second_derivative_is_refused_not_silently_without_a_graph():
    x = inputs((4, 8), torch.float64).requires_grad_()
    bias = torch.zeros(8, device=CUDA, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(bias_gelu(x, bias).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


def test_fused_adamw_reuses_its_address_table_and_takes_size_one_dimensions_and_empty_parameters():
    """Gradients zeroed in place keep their addresses: the table is not copied (nor waited for)
    again. A (1, 8) parameter's gradient may have other strides; an empty parameter has nothing to do."""
    weight = torch.nn.Parameter(inputs((1, 8), torch.float32))
    empty = torch.nn.Parameter(torch.empty(0, device=CUDA))
    reference = torch.nn.Parameter(weight.detach().clone())
    fused, plain = FusedAdamW([weight, empty], lr=0.1), torch.optim.AdamW([reference], lr=0.1)
    tables = set()
    for step in range(3):
        for param, optimizer in ((weight, fused), (reference, plain)):
            optimizer.zero_grad(set_to_none=False)
            (torch.ones(4, 1, device=CUDA) @ param * (step + 1)).sum().backward()
        empty.grad = torch.empty(0, device=CUDA)
        fused.step()
        plain.step()
        tables |= {id(table) for _, table in fused._pointers.values()}
    close(weight, reference, torch.float32)
    assert len(tables) == 1, "the address table was rebuilt although no address changed"


def test_a_deep_copy_of_a_fused_model_computes_with_its_own_parameters():
    import copy

    from workbench.fused_ops import fuse_model
    from workbench.models import inspect_model

    model = inspect_model("gpt-mini")[0].to(CUDA)
    fuse_model(model)
    copied = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (2, 16), device=CUDA)
    torch.testing.assert_close(copied(tokens), model(tokens))
    copied(tokens).sum().backward()
    assert copied.blocks[0].ln2.weight.grad is not None and model.blocks[0].ln2.weight.grad is None
