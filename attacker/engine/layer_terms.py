"""Each layer type's batched per-job gradient formula, as ONE registered entry per torch layer class.

``PerJobGradients`` (gradients.py) takes the gradient of the summed loss w.r.t. each layer's OUTPUT
(delta), which is per row and so per job, and an entry here assembles each job's parameter-gradient
terms <g_j, g*_j> and ||g_j||^2 from the deltas and the layer's input:

  Linear / Conv2d (via unfold):  g_j = sum_t delta_t a_t^T,
      <g_j, G*_j> = sum_t delta_t^T G*_j a_t,   ||g_j||^2 = sum_{t,t'} (delta_t.delta_t')(a_t.a_t')
      (the Gram form where it is cheaper than materializing g_j; low-rank targets: factoring.py)
  Grouped / depthwise Conv2d: the Linear form per group (groups folded into the jobs' dimension).
  LayerNorm / GroupNorm: g_w = sum delta * x_hat, g_b = sum delta   (materialized: they are small)
  Eval-mode BatchNorm: an affine map per image, as GroupNorm with x_hat from the running statistics.
  TokenEmbedding (the project's ViT cls token and position embedding): sums of delta over the job's images.

The double backward then flows through ordinary batched matrix products. Adding a layer type is one
function registered with :func:`formula` under its torch class; the entry says which modules of
that class it takes (``qualifies``), what it assumes the layer computes (``reference``: checked once
against a layer that overrides ``forward``), which weight target may be factored, and whether the
layer couples the images of a batch. A layer without an entry takes the per-job vjp (hybrid.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedsim.models.vit import TokenEmbedding

from .factoring import dot_costs
from .hybrid import UnsupportedModelError

Terms = dict[int, tuple[Tensor, Tensor]]  # parameter index -> (dot (V,), norm2 (V,))


@dataclass
class JobTargets:
    """What a formula reads in one pass: the V jobs' targets and the factors in use, by parameter."""

    V: int
    targets: list[Tensor]  # per parameter index, (V, *param_shape)
    index: dict[int, int]  # id(parameter) -> its index
    factors: dict[int, tuple[Tensor, Tensor]]  # parameter index -> (L, R); empty: dense only
    used: set[int] = field(default_factory=set)  # parameters whose <g, G*> took the factored form

    def of(self, param: Tensor) -> int:
        return self.index[id(param)]

    def target(self, param: Tensor) -> Tensor:
        return self.targets[self.of(param)]

    def dense(self, param: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """The terms of a materialized per-job gradient g: (V, *param_shape) (or any shape of V rows)."""
        return dense_terms(g, self.target(param))

    def weight(self, param: Tensor, d: Tensor, a: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """The Linear form of a weight, factored where its target has factors and they are cheaper."""
        dot, norm2, used = linear_terms(d, a, target, self.factors.get(self.of(param)))
        if used:
            self.used.add(self.of(param))
        return dot, norm2


def _always(module: nn.Module) -> bool:
    return True


def _never(module: nn.Module) -> bool:
    return False


@dataclass(frozen=True)
class LayerFormula:
    layer: type[nn.Module]  # the class it is registered under (subclasses find it through their MRO)
    terms: Callable[[JobTargets, nn.Module, Tensor, Tensor], Terms]  # (targets, module, input, delta)
    reference: Callable[[nn.Module, Tensor], Tensor]  # what the formula assumes the layer computes
    qualifies: Callable[[nn.Module], bool] = _always  # which modules of the class it takes
    factorable: Callable[[nn.Module], bool] = _never  # whether its weight target may be factored
    couples: Callable[[nn.Module], bool] = _never  # whether it mixes the images of a batch (as set now)

    def plain_forward(self, module: nn.Module) -> bool:
        """Whether the layer runs its registered class's own forward (else it is checked once)."""
        return type(module).forward is self.layer.forward


FORMULAS: dict[type[nn.Module], LayerFormula] = {}


def formula(layer: type[nn.Module], reference: Callable[[nn.Module, Tensor], Tensor], **options):
    """Register ``fn(targets, module, input, delta) -> Terms`` as the batched formula of ``layer``."""

    def register(fn: Callable[[JobTargets, nn.Module, Tensor, Tensor], Terms]):
        FORMULAS[layer] = LayerFormula(layer, fn, reference, **options)
        return fn

    return register


def formula_for(module: nn.Module) -> LayerFormula | None:
    """The entry of the nearest registered class of ``module`` (None: the layer takes the vjp)."""
    for cls in type(module).__mro__:
        entry = FORMULAS.get(cls)
        if entry is not None:
            return entry
    return None


def batched_formula(module: nn.Module) -> LayerFormula | None:
    """The entry that takes ``module`` as it is configured, or None."""
    entry = formula_for(module)
    return entry if entry is not None and entry.qualifies(module) else None


# -- the shared forms -------------------------------------------------------------------------------


# A batched product whose result has at most this many entries per job is taken as a broadcast
# multiply and a sum instead of a bmm: a bmm of (V, 1, n) by (V, n, 1), as B = 1 and a rank-1 target
# give, runs one tiny GEMM per job, and its backward two more (measured: 3-30x slower than the
# elementwise form on one CPU thread at V = 128, n = 512).
SMALL_PRODUCT = 4


def bmm(x: Tensor, y: Tensor) -> Tensor:
    """x: (V, m, n) @ y: (V, n, p), as a broadcast multiply and sum where m * p is tiny (same values
    up to float rounding)."""
    m, p = x.shape[1], y.shape[2]
    if m * p > SMALL_PRODUCT:
        return x @ y
    if m == 1:
        return (x.transpose(1, 2) * y).sum(1, keepdim=True)
    if p == 1:
        return (x * y.transpose(1, 2)).sum(2, keepdim=True)
    return (x.unsqueeze(3) * y.unsqueeze(1)).sum(2)


def linear_terms(
    d: Tensor, a: Tensor, target: Tensor, factors: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor, bool]:
    """d: (V, R, out), a: (V, R, in), target: (V, out, in) -> dot (V,), norm2 (V,), factors used.
    factors: (L, Rt) with target = L @ Rt^T, L: (V, out, k), Rt: (V, in, k), or None."""
    rows, out_f, in_f = d.shape[1], d.shape[2], a.shape[2]
    gram = rows * (out_f + in_f) < out_f * in_f
    dense, factored = dot_costs(rows, out_f, in_f, None if factors is None else factors[0].shape[2], gram)
    use_factors = factors is not None and factored < dense
    g = None
    if gram:
        norm2 = (bmm(d, d.transpose(1, 2)) * bmm(a, a.transpose(1, 2))).sum((1, 2))
    else:
        g = d.transpose(1, 2) @ a
        norm2 = (g * g).sum((1, 2))
    if use_factors:
        left, right = factors
        return (bmm(d, left) * bmm(a, right)).sum((1, 2)), norm2, True
    if g is None:
        return (bmm(d, target) * a).sum((1, 2)), norm2, False
    return (g * target).sum((1, 2)), norm2, False


def dense_terms(g: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    g = g.reshape(g.shape[0], -1)
    return (g * target.reshape(g.shape[0], -1)).sum(1), (g * g).sum(1)


def _channel_affine(t: JobTargets, m: nn.Module, inp: Tensor, d: Tensor, x_hat: Tensor) -> Terms:
    """A per-channel scale and shift of x_hat (GroupNorm, eval-mode BatchNorm)."""
    dd = d.reshape(t.V, -1, inp.shape[1], d[0, 0].numel())
    out: Terms = {}
    if m.weight is not None:
        out[t.of(m.weight)] = t.dense(m.weight, (dd * x_hat.reshape(dd.shape)).sum((1, 3)))
    if m.bias is not None:
        out[t.of(m.bias)] = t.dense(m.bias, dd.sum((1, 3)))
    return out


# -- the entries ------------------------------------------------------------------------------------


@formula(nn.Linear, lambda m, x: F.linear(x, m.weight, m.bias), factorable=_always)
def _linear(t: JobTargets, m: nn.Module, inp: Tensor, d: Tensor) -> Terms:
    a = inp.reshape(t.V, -1, inp.shape[-1])
    dd = d.reshape(t.V, -1, d.shape[-1])
    out = {t.of(m.weight): t.weight(m.weight, dd, a, t.target(m.weight))}
    if m.bias is not None:
        out[t.of(m.bias)] = t.dense(m.bias, dd.sum(1))
    return out


@formula(
    nn.Conv2d,
    lambda m, x: F.conv2d(x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups),
    # a string padding ("same") or another padding mode (reflect...) takes the vjp
    qualifies=lambda m: isinstance(m.padding, tuple) and m.padding_mode == "zeros",
    factorable=lambda m: m.groups == 1,
)
def _conv(t: JobTargets, m: nn.Module, inp: Tensor, d: Tensor) -> Terms:
    V, G = t.V, m.groups
    cols = F.unfold(inp, m.kernel_size, m.dilation, m.padding, m.stride)
    w = t.target(m.weight)
    out: Terms = {}
    if G == 1:
        a = cols.transpose(1, 2).reshape(V, -1, cols.shape[1])
        dd = d.flatten(2).transpose(1, 2).reshape(V, -1, d.shape[1])
        out[t.of(m.weight)] = t.weight(m.weight, dd, a, w.reshape(V, w.shape[1], -1))
        if m.bias is not None:
            out[t.of(m.bias)] = t.dense(m.bias, dd.sum(1))
        return out
    # Grouped / depthwise: each group is a convolution of its own; fold the groups into the jobs' dimension.
    N, L = cols.shape[0], cols.shape[2]
    a = cols.view(V, N // V, G, -1, L).permute(0, 2, 1, 4, 3).reshape(V * G, (N // V) * L, -1)
    dd = d.reshape(V, N // V, G, -1, L).permute(0, 2, 1, 4, 3).reshape(V * G, (N // V) * L, -1)
    dot, norm2, _ = linear_terms(dd, a, w.reshape(V * G, w.shape[1] // G, -1))
    out[t.of(m.weight)] = dot.view(V, G).sum(1), norm2.view(V, G).sum(1)
    if m.bias is not None:
        out[t.of(m.bias)] = t.dense(m.bias, d.reshape(V, N // V, d.shape[1], -1).sum((1, 3)))
    return out


@formula(nn.LayerNorm, lambda m, x: F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps))
def _layernorm(t: JobTargets, m: nn.Module, inp: Tensor, d: Tensor) -> Terms:
    shape = m.normalized_shape
    x_hat = F.layer_norm(inp, shape, eps=m.eps).reshape(t.V, -1, *shape)
    dd = d.reshape(t.V, -1, *shape)
    out: Terms = {}
    if m.weight is not None:
        out[t.of(m.weight)] = t.dense(m.weight, (dd * x_hat).sum(1))
    if m.bias is not None:
        out[t.of(m.bias)] = t.dense(m.bias, dd.sum(1))
    return out


@formula(nn.GroupNorm, lambda m, x: F.group_norm(x, m.num_groups, m.weight, m.bias, m.eps))
def _groupnorm(t: JobTargets, m: nn.Module, inp: Tensor, d: Tensor) -> Terms:
    return _channel_affine(t, m, inp, d, F.group_norm(inp, m.num_groups, eps=m.eps))


def batch_statistics(module: nn.Module) -> bool:
    """Whether a BatchNorm normalizes by the statistics of its batch (train mode, or no running
    statistics), as its forward decides: then it couples the images of a batch."""
    return module.training or module.running_mean is None or module.running_var is None


@formula(
    _BatchNorm,
    lambda m, x: F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps),
    couples=batch_statistics,
)
def _batchnorm(t: JobTargets, m: nn.Module, inp: Tensor, d: Tensor) -> Terms:
    """Eval mode: x_hat from the running statistics, an affine map per image."""
    if batch_statistics(m):
        raise UnsupportedModelError(
            f"layer {type(m).__name__} switched to batch statistics (train mode) after the engine "
            "chose to batch its jobs"
        )
    x_hat = F.batch_norm(inp, m.running_mean, m.running_var, None, None, False, 0.0, m.eps)
    return _channel_affine(t, m, inp, d, x_hat)


@formula(TokenEmbedding, lambda m, x: torch.cat([m.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + m.pos_embedding)
def _token_embedding(t: JobTargets, m: nn.Module, inp: Tensor, d: Tensor) -> Terms:
    dd = d.reshape(t.V, -1, *d.shape[1:])
    return {
        t.of(m.pos_embedding): t.dense(m.pos_embedding, dd.sum(1)),
        t.of(m.cls_token): t.dense(m.cls_token, dd[:, :, 0].sum(1)),
    }
