"""The fused operators of kernels/ as PyTorch autograd functions, modules and an optimizer.

- ``bias_gelu(x, bias)``: GELU(x + bias), the exact (erf) GELU of ``nn.GELU()``.
- ``residual_dropout_layer_norm(x, residual, weight, bias, eps, p)``: returns
  ``(h, y)`` with ``h = residual + dropout(x)`` and ``y = LayerNorm(h)``; ``layer_norm``
  is the same kernel with no residual and no dropout.
- ``FusedAdamW``: ``torch.optim.AdamW``'s update in one launch per parameter group (per device
  and dtype within it).
- ``fuse_model(model)``: swaps matching submodules for fused ones and reports each swap.

Each op runs one CUDA kernel forward and one backward, launched through CuPy on PyTorch's
current stream with tensors passed by address, without a copy (see workbench/raw_kernels.py).
The kernels accept float64, float32, float16 and bfloat16 tensors of any shape (non-contiguous
ones are made contiguous first) and accumulate in float32 (float64 for float64). Parameters of
LayerNorm and the bias of GELU are read in the accumulation type, so an fp16 activation under
autocast meets fp32 parameters without a cast kernel. Their backwards are written by the kernels,
so they are differentiable once (``create_graph=True`` is refused, not silently graph-less).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from workbench import raw_kernels
from workbench.models import TransformerBlock

# --- launch helpers ----------------------------------------------------------------------------


def _require_cuda(*tensors: torch.Tensor | None) -> torch.device:
    device = next(t.device for t in tensors if t is not None)
    for tensor in tensors:
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"the fused ops need all tensors on one device; got {device} and {tensor.device}"
            )
    if device.type != "cuda":
        raise RuntimeError(
            f"the fused CuPy kernels run on CUDA tensors only; these are on {device.type} "
            "(on CPU, use the unfused PyTorch ops)"
        )
    reason = raw_kernels.cupy_ready_reason()
    if reason:
        raise RuntimeError(reason)
    return device


def _launch(name: str, entry: str, dtype: torch.dtype, device: torch.device, grid, block, args) -> None:
    function = raw_kernels.kernel(name, entry, dtype, device)
    with raw_kernels.on_torch_stream(device):
        function(grid, block, tuple(raw_kernels.view(a) if _is_tensor_arg(a) else a for a in args))


def _is_tensor_arg(value) -> bool:
    return value is None or isinstance(value, torch.Tensor)


def _grid_stride_blocks(device: torch.device, work_items: int, threads: int, per_sm: int = 8) -> int:
    """Enough blocks to fill every multiprocessor, never more than there is work for."""
    return max(1, min(math.ceil(work_items / threads), raw_kernels.multiprocessors(device.index) * per_sm))


# --- bias + GELU -----------------------------------------------------------------------------


class BiasGELU(torch.autograd.Function):
    """GELU(x + bias) over the last dimension of x; backward fuses dx with the bias gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        device = _require_cuda(x, bias)
        if bias.dim() != 1 or x.shape[-1] != bias.numel():
            raise ValueError(
                f"bias_gelu: bias must have x.shape[-1] = {x.shape[-1]} values; got {tuple(bias.shape)}"
            )
        x = x.contiguous()
        bias_acc = bias.detach().to(raw_kernels.accumulate_dtype(x.dtype)).contiguous()
        y = torch.empty_like(x)
        if x.numel():
            threads = 256
            blocks = _grid_stride_blocks(device, x.numel(), threads)
            args = (x, bias_acc, y, np.int64(x.numel()), np.int32(bias.numel()))
            _launch("bias_gelu", "bias_gelu_forward", x.dtype, device, (blocks,), (threads,), args)
        ctx.save_for_backward(x, bias_acc)
        ctx.bias_dtype = bias.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        x, bias_acc = ctx.saved_tensors
        cols = bias_acc.numel()
        if not x.numel():  # nothing to launch (and no columns to size a grid by, when cols is 0)
            return torch.zeros_like(x), torch.zeros(cols, dtype=ctx.bias_dtype, device=x.device)
        grad_y = grad_y.contiguous().to(x.dtype)
        rows = x.numel() // cols
        grad_x = torch.empty_like(x)
        # Blocks of 32 columns x 8 rows; grid y is sized so the whole grid fills the device.
        grid_x = math.ceil(cols / 32)
        per_column = max(1, raw_kernels.multiprocessors(x.device.index) * 8 // grid_x)
        grid_y = max(1, min(math.ceil(rows / 8), per_column))
        partial = torch.empty((grid_y, cols), dtype=bias_acc.dtype, device=x.device)
        if rows:
            args = (grad_y, x, bias_acc, grad_x, partial, np.int64(rows), np.int32(cols))
            _launch("bias_gelu", "bias_gelu_backward", x.dtype, x.device, (grid_x, grid_y), (32, 8), args)
        else:
            partial.zero_()
        return grad_x, partial.sum(0).to(ctx.bias_dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x + bias)`` in one kernel (and one backward kernel)."""
    return BiasGELU.apply(x, bias)


# --- residual + dropout + LayerNorm --------------------------------------------------------------


class ResidualDropoutLayerNorm(torch.autograd.Function):
    """y = LayerNorm(h) with h = residual + dropout(x); returns (h, y), or y alone when h is x."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps: float, p: float, seed: int):
        device = _require_cuda(x, residual, weight, bias)
        cols = weight.numel()
        if x.shape[-1] != cols or bias.numel() != cols:
            raise ValueError(
                f"layer_norm: weight and bias must have x.shape[-1] = {x.shape[-1]} values; "
                f"got {weight.numel()} and {bias.numel()}"
            )
        if cols == 0:
            raise ValueError("layer_norm: the normalized dimension has no values (x.shape[-1] is 0)")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
        x = x.contiguous()
        residual = residual.contiguous() if residual is not None else None
        acc = raw_kernels.accumulate_dtype(x.dtype)
        gamma = weight.detach().to(acc).contiguous()
        beta = bias.detach().to(acc).contiguous()
        rows = x.numel() // cols
        materialize_h = residual is not None or p > 0
        h = torch.empty_like(x) if materialize_h else None
        y = torch.empty_like(x)
        mean = torch.empty(rows, dtype=acc, device=device)
        rstd = torch.empty(rows, dtype=acc, device=device)
        threads = _row_threads(cols)
        if rows:
            blocks = min(rows, raw_kernels.multiprocessors(device.index) * 8)
            args = (x, residual, gamma, beta, y, h, mean, rstd, np.int64(rows), np.int32(cols),
                    np.float32(p), np.uint64(seed), np.float64(eps))  # fmt: skip
            _launch("residual_dropout_layer_norm", "residual_dropout_layer_norm_forward", x.dtype, device,
                    (blocks,), (threads,), args)  # fmt: skip
        ctx.save_for_backward(h if materialize_h else x, gamma, mean, rstd)
        ctx.settings = (p, seed, residual is not None, materialize_h, weight.dtype, bias.dtype)
        return (h, y) if materialize_h else y

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        h, gamma, mean, rstd = ctx.saved_tensors
        p, seed, has_residual, materialize_h, weight_dtype, bias_dtype = ctx.settings
        grad_y = grads[-1]
        grad_y = torch.zeros_like(h) if grad_y is None else grad_y.contiguous().to(h.dtype)
        grad_h = grads[0] if materialize_h else None
        grad_h = grad_h.contiguous().to(h.dtype) if grad_h is not None else None
        cols = gamma.numel()
        rows = h.numel() // cols
        grad_x = torch.empty_like(h)
        grad_residual = torch.empty_like(h) if has_residual else None
        blocks = max(1, min(rows, raw_kernels.multiprocessors(h.device.index) * 4))
        # Each block adds its rows into its own row of these; the sum over blocks follows.
        dgamma_partial = torch.zeros((blocks, cols), dtype=gamma.dtype, device=h.device)
        dbeta_partial = torch.zeros((blocks, cols), dtype=gamma.dtype, device=h.device)
        if rows:
            args = (grad_y, grad_h, h, gamma, mean, rstd, grad_x, grad_residual, dgamma_partial, dbeta_partial,
                    np.int64(rows), np.int32(cols), np.float32(p), np.uint64(seed))  # fmt: skip
            _launch("residual_dropout_layer_norm", "residual_dropout_layer_norm_backward", h.dtype, h.device,
                    (blocks,), (_row_threads(cols),), args)  # fmt: skip
        grad_weight = dgamma_partial.sum(0).to(weight_dtype)
        grad_bias = dbeta_partial.sum(0).to(bias_dtype)
        return grad_x, grad_residual, grad_weight, grad_bias, None, None, None


def _row_threads(cols: int) -> int:
    """Threads per row: a warp per 128 values (4 per thread), up to 512; always whole warps."""
    return 32 * max(1, min(16, math.ceil(cols / 128)))


def residual_dropout_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + F.dropout(x, p)``; ``y = F.layer_norm(h, ...)``: returns ``(h, y)``.

    x and residual may differ in dtype (an fp16 sublayer output added to an fp32 residual
    stream under autocast); both are promoted first, as ``residual + x`` would be.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1); got {p}")
    p = p if training else 0.0
    if residual is not None and residual.dtype != x.dtype:
        common = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(common), residual.to(common)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if p > 0 else 0  # reproducible under manual_seed
    if residual is None and p == 0:
        return x, layer_norm(x, weight, bias, eps)
    return ResidualDropoutLayerNorm.apply(x, residual, weight, bias, eps, p, seed)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` over the last dimension, in one kernel (and one backward kernel)."""
    return ResidualDropoutLayerNorm.apply(x, None, weight, bias, eps, 0.0, 0)


# --- modules -------------------------------------------------------------------------------------


class FusedLinearGELU(nn.Module):
    """``nn.Linear`` then ``nn.GELU()``: the matmul without its bias, then bias + GELU fused.

    It shares the Linear's parameters (same objects, same state_dict keys).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is None:
            raise ValueError("FusedLinearGELU fuses the Linear's bias into the GELU; this Linear has no bias")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(F.linear(x, self.weight), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused=bias+GELU"


class FusedLayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dimension, sharing the original module's parameters."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        if len(norm.normalized_shape) != 1 or norm.weight is None or norm.bias is None:
            raise ValueError("FusedLayerNorm takes a LayerNorm over the last dimension with weight and bias")
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.weight = norm.weight
        self.bias = norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, fused=LayerNorm"


class FusedPreLNTransformerBlock(TransformerBlock):
    """The built-in pre-LayerNorm transformer block with its middle residual add fused:

    ``x = x + attn(ln1(x)); return x + mlp(ln2(x))`` becomes one kernel for the add and ln2.
    ``fuse_model`` gives a block this class in place (its modules and parameters stay): a class,
    not a forward closure stored on the instance, so that a deep copy (an EMA or eval copy)
    computes with its own parameters, and the model still pickles.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ln2 = self.ln2
        x, normalized = residual_dropout_layer_norm(self.attn(self.ln1(x)), x, ln2.weight, ln2.bias, ln2.eps)
        return x + self.mlp(normalized)


# --- swapping modules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Replacement:
    """One swap ``fuse_model`` made: where, what it was, what it became."""

    name: str
    before: str
    after: str


def fuse_model(
    model: nn.Module,
    *,
    bias_gelu: bool = True,
    layer_norm: bool = True,
    residual_layer_norm: bool = True,
    dry_run: bool = False,
) -> list[Replacement]:
    """Swap matching submodules of ``model`` (in place) for fused ones; return what was swapped.

    ``dry_run=True`` only reports what would be swapped and leaves the model as it is.

    The patterns, which built-in and user models alike are searched for:
    - bias_gelu: an ``nn.Linear`` with a bias directly followed by ``nn.GELU()`` (erf) inside
      an ``nn.Sequential``;
    - layer_norm: every ``nn.LayerNorm`` over the last dimension with weight and bias;
    - residual_layer_norm: the built-in pre-LN ``TransformerBlock`` (ln1, attn, ln2, mlp):
      its middle residual add and ln2 become one kernel. User blocks can call
      ``residual_dropout_layer_norm`` themselves; a forward cannot be pattern-matched safely.
    Swapping works on any device; running the fused modules needs CUDA and CuPy.
    """
    replaced: list[Replacement] = []
    absorbed: set[int] = set()  # LayerNorms that a fused residual kernel now computes
    if residual_layer_norm:
        for name, module in model.named_modules():
            if type(module) is TransformerBlock and _fusable_norm(module.ln2):
                absorbed.add(id(module.ln2))
                if not dry_run:
                    module.__class__ = FusedPreLNTransformerBlock  # this block only; the class is untouched
                replaced.append(Replacement(name, "residual add + ln2", "one fused kernel"))
    if bias_gelu:
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Sequential):
                continue
            children = list(module.named_children())
            for (first_name, first), (second_name, second) in zip(children, children[1:], strict=False):
                if type(first) is nn.Linear and first.bias is not None and _is_exact_gelu(second):
                    if not dry_run:
                        setattr(module, first_name, FusedLinearGELU(first))
                        setattr(module, second_name, nn.Identity())
                    where = f"{name}.{first_name}" if name else first_name
                    replaced.append(Replacement(where, "Linear + GELU", "matmul, then fused bias + GELU"))
    if layer_norm:
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is nn.LayerNorm and _fusable_norm(child) and id(child) not in absorbed:
                    if not dry_run:
                        setattr(module, child_name, FusedLayerNorm(child))
                    where = f"{name}.{child_name}" if name else child_name
                    replaced.append(Replacement(where, "LayerNorm", "fused LayerNorm"))
    return replaced


def _same_layout(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """The same shape and the same strides where they matter: a dimension of size 1 can have any
    stride (autograd gives a (1, 8) parameter's gradient strides (1, 1) where the parameter has
    (8, 1)), and both are walked in the same linear order."""
    return grad.shape == param.shape and all(
        size == 1 or a == b for size, a, b in zip(param.shape, grad.stride(), param.stride(), strict=True)
    )


def _is_exact_gelu(module: nn.Module) -> bool:
    return type(module) is nn.GELU and module.approximate == "none"


def _fusable_norm(norm: nn.Module) -> bool:
    return (
        isinstance(norm, (nn.LayerNorm, FusedLayerNorm))
        and len(norm.normalized_shape) == 1
        and norm.weight is not None
        and norm.bias is not None
    )


def describe_replacements(replaced: list[Replacement]) -> str:
    """``fused 4 Linear + GELU (blocks.0.mlp.0, ...), 9 LayerNorm (...)``, or what matched nothing."""
    if not replaced:
        return "no module matched a fused pattern"
    groups: dict[str, list[str]] = defaultdict(list)
    for swap in replaced:
        groups[swap.before].append(swap.name)
    parts = []
    for before, names in groups.items():
        shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        parts.append(f"{len(names)} {before} ({shown})")
    return "fused " + "; ".join(parts)


# --- the fused optimizer -------------------------------------------------------------------------

CHUNK = 16384  # elements per block: 64 per thread at 256 threads


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) in few kernel launches per step.

    One launch per parameter group and (device, dtype, step count) within it: one launch for a
    model with one group on one device in one dtype. The moments are kept in float32 (float64
    for float64 parameters). Not supported: amsgrad, maximize, sparse gradients; ``from_adamw``
    says so.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if not lr >= 0.0:
            raise ValueError(f"FusedAdamW: lr must be >= 0; got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
            raise ValueError(f"FusedAdamW: betas must be two values in [0, 1); got {betas}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"FusedAdamW: eps and weight_decay must be >= 0; got {eps}, {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pointers: dict[tuple, tuple[tuple[int, ...], torch.Tensor]] = {}  # see _pointer_table

    @classmethod
    def from_adamw(cls, optimizer: torch.optim.AdamW) -> FusedAdamW:
        """The fused twin of a ``torch.optim.AdamW`` (same groups and hyperparameters, fresh state)."""
        groups = []
        for group in optimizer.param_groups:
            for option in ("amsgrad", "maximize", "differentiable"):
                if group.get(option):
                    raise ValueError(f"FusedAdamW does not implement AdamW's {option}=True")
            groups.append({key: group[key] for key in ("params", "lr", "betas", "eps", "weight_decay")})
            groups[-1]["lr"] = float(groups[-1]["lr"])  # a tensor lr (capturable AdamW) becomes a number
        return cls(groups)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            launches: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not take sparse gradients")
                state = self.state[param]
                acc = raw_kernels.accumulate_dtype(param.dtype)
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=acc)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=acc)
                for moment in ("exp_avg", "exp_avg_sq"):
                    if state[moment].dtype != acc:  # load_state_dict casts state to the parameter's dtype
                        state[moment] = state[moment].to(acc)
                state["step"] = int(state["step"]) + 1
                launches[(param.device, param.dtype, state["step"])].append(param)
            for (device, dtype, step), params in launches.items():
                self._launch(group, device, dtype, step, params)
        return loss

    def _launch(self, group: dict, device: torch.device, dtype: torch.dtype, step: int, params: list) -> None:
        _require_cuda(*params)
        for param in params:
            if param.grad.dtype != param.dtype or not _same_layout(param.grad, param):
                raise RuntimeError(
                    "FusedAdamW needs each gradient in its parameter's dtype and memory layout"
                )
            if not (param.is_contiguous() or param.is_contiguous(memory_format=torch.channels_last)):
                raise RuntimeError("FusedAdamW walks each parameter's memory linearly; it must be dense")
        params = [p for p in params if p.numel()]  # an empty parameter has nothing to update
        if not params:  # and a grid of no blocks is not a launch CUDA accepts
            return
        beta1, beta2 = group["betas"]
        sizes, chunk_tensor, chunk_start = self._chunk_table(device, tuple(p.numel() for p in params))
        pointers = self._pointer_table(group, device, dtype, params)
        args = (
            pointers[0], pointers[1], pointers[2], pointers[3], sizes, chunk_tensor, chunk_start, np.int32(CHUNK),
            np.float64(group["lr"]), np.float64(beta1), np.float64(beta2), np.float64(group["eps"]),
            np.float64(group["weight_decay"]), np.float64(1 - beta1**step), np.float64(math.sqrt(1 - beta2**step)),
        )  # fmt: skip
        _launch("adamw", "adamw_step", dtype, device, (chunk_tensor.numel(),), (256,), args)

    def _pointer_table(
        self, group: dict, device: torch.device, dtype: torch.dtype, params: list
    ) -> torch.Tensor:
        """The addresses of the parameters, gradients and moments, as a (4, n) tensor on ``device``.

        Kept while the addresses stay the same (gradients that are zeroed in place, or that the
        caching allocator gives the same memory again). Otherwise copied from pinned memory without
        waiting: a copy from pageable memory would make the CPU wait for the GPU every step, for
        the backward to finish, which is the overlap this optimizer exists to keep.
        """
        states = [self.state[p] for p in params]
        addresses = (
            *(p.data_ptr() for p in params),
            *(p.grad.data_ptr() for p in params),
            *(s["exp_avg"].data_ptr() for s in states),
            *(s["exp_avg_sq"].data_ptr() for s in states),
        )
        key = (id(group), device, dtype, tuple(map(id, params)))  # one launch of the group's step
        cached = self._pointers.get(key)
        if cached is not None and cached[0] == addresses:
            return cached[1]
        host = torch.tensor(addresses, dtype=torch.int64).view(4, len(params)).pin_memory()
        table = host.to(device, non_blocking=True)  # the pinned buffer is kept until the copy ends
        self._pointers[key] = (addresses, table)
        return table

    def _chunk_table(self, device: torch.device, sizes: tuple[int, ...]):
        """Which tensor and which offset each block takes; depends only on the sizes, so cached."""
        key = (device, sizes)
        if key not in self._tables:
            tensor_of_chunk, start_of_chunk = [], []
            for index, size in enumerate(sizes):
                starts = range(0, size, CHUNK)
                tensor_of_chunk += [index] * len(starts)
                start_of_chunk += list(starts)
            self._tables[key] = (
                torch.tensor(sizes, dtype=torch.int64, device=device),
                torch.tensor(tensor_of_chunk, dtype=torch.int32, device=device),
                torch.tensor(start_of_chunk, dtype=torch.int64, device=device),
            )
        return self._tables[key]
