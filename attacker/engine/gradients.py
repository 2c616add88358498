"""Per-job gradient-matching terms for V victim jobs that share one model, without ever building
a per-job weight-sized gradient where it can be avoided.

Why by hand: autograd gives the gradient of a sum over the whole batch, but every victim job has
its own target gradient, so each job needs its own <g_j, g*_j> and ||g_j||^2. vmap or stacked
weights cost as much as one job at a time (see docs/performance.md). Instead we take the gradient
of the summed loss w.r.t. each layer's OUTPUT (delta), which is per row and so per job, and
assemble each job's parameter-gradient terms from deltas and the layer inputs:
  Linear / Conv2d (via unfold):  g_j = sum_t delta_t a_t^T,
      <g_j, G*_j> = sum_t delta_t^T G*_j a_t,   ||g_j||^2 = sum_{t,t'} (delta_t.delta_t')(a_t.a_t')
      (the Gram form is used where it is cheaper than materializing g_j)
  LayerNorm / GroupNorm: g_w = sum delta * x_hat, g_b = sum delta   (materialized: they are small)
  TokenEmbedding (ViT cls token and position embedding): sums of delta over the job's images.
The double backward then flows through ordinary batched matrix products.

Low-rank targets (the memory-bound regime left behind): a captured one-step gradient of a Linear
layer is itself sum_s delta*_s a*_s^T over the victim's rows, so its rank is at most B*T. Such a
target is factored once, exactly (G*_j = L_j R_j^T up to float rounding, see ``factor_targets``),
and <g_j, G*_j> = sum_t (L_j^T delta_t).(R_j^T a_t) never reads the weight-sized target again.
Each layer takes the factored or the dense form by a FLOP/bytes estimate (``_dot_costs``); the
dense form stays for targets whose rank is not small (early convolutions, ViT layers at B >= 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedsim.models.vit import TokenEmbedding

SUPPORTED = (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.GroupNorm, TokenEmbedding)


class UnsupportedModelError(ValueError):
    """The model holds a layer whose per-job gradient this module cannot assemble (e.g. BatchNorm,
    which couples the images of a batch)."""


@dataclass
class MatchTerms:
    """Per parameter p and job j: dot[p, j] = <g, g*>, norm2[p, j] = ||g||^2, target_norm2 = ||g*||^2."""

    dot: Tensor
    norm2: Tensor
    target_norm2: Tensor
    names: list[str]


# Bytes are weighed as this many FLOPs in the per-layer choice: roughly the fp32 FLOPs a CPU or
# GPU core does in the time it streams one byte (GEMM peak / memory bandwidth); only the order of
# magnitude matters, the costs it separates differ by far more.
FLOPS_PER_BYTE = 8.0
# Relative Frobenius error a factored target may have against the dense one (float32 rounding of a
# sum is about 1e-7 per term); beyond it the layer stays dense.
FACTOR_RTOL = 1e-5


def _dot_costs(rows: int, out_f: int, in_f: int, rank: int | None, gram: bool) -> tuple[float, float]:
    """Estimated cost of <g, G*> per job for one layer: (dense, factored), in FLOPs plus weighted
    bytes (fp32), forward only (the double backward scales with it). Factored is inf without factors."""
    if gram:  # dense: (d @ G*) . a, streaming the target
        dense = 2.0 * rows * out_f * in_f + FLOPS_PER_BYTE * 4 * out_f * in_f
    else:  # dense: g (built anyway for ||g||^2) . G*
        dense = 2.0 * out_f * in_f + FLOPS_PER_BYTE * 4 * 2 * out_f * in_f
    if rank is None:
        return dense, float("inf")
    factored = 2.0 * rows * rank * (out_f + in_f) + FLOPS_PER_BYTE * 4 * (rows + rank) * (out_f + in_f)
    return dense, factored


def _linear_terms(
    d: Tensor, a: Tensor, target: Tensor, factors: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor, bool]:
    """d: (V, R, out), a: (V, R, in), target: (V, out, in) -> dot (V,), norm2 (V,), factors used.
    factors: (L, Rt) with target = L @ Rt^T, L: (V, out, k), Rt: (V, in, k), or None."""
    rows, out_f, in_f = d.shape[1], d.shape[2], a.shape[2]
    gram = rows * (out_f + in_f) < out_f * in_f
    dense, factored = _dot_costs(rows, out_f, in_f, None if factors is None else factors[0].shape[2], gram)
    g = None
    if gram:
        norm2 = ((d @ d.transpose(1, 2)) * (a @ a.transpose(1, 2))).sum((1, 2))
    else:
        g = d.transpose(1, 2) @ a
        norm2 = (g * g).sum((1, 2))
    if factors is not None and factored < dense:
        left, right = factors
        return ((d @ left) * (a @ right)).sum((1, 2)), norm2, True
    if g is None:
        return ((d @ target) * a).sum((1, 2)), norm2, False
    return (g * target).sum((1, 2)), norm2, False


def useful_rank(out_f: int, in_f: int) -> int:
    """The largest rank at which factors are cheaper to store and stream than the dense target."""
    return int(0.75 * out_f * in_f / (out_f + in_f))


@torch.no_grad()
def factor_targets(target: Tensor, max_rank: int, chunk: int = 16) -> tuple[Tensor, Tensor] | None:
    """Exact low-rank factors of V target matrices, or None when some job's rank exceeds max_rank.

    target: (V, out, in). Returns (L, R), L: (V, out, k), R: (V, in, k), with target[j] = L[j] R[j]^T
    up to float rounding (checked: relative Frobenius error <= FACTOR_RTOL for every job, else None;
    None as well when a target holds inf or nan).
    How: a randomized range finder (Halko, Martinsson & Tropp), in float64: Y = G Omega for a Gaussian
    Omega with K columns, Q = qr(Y), C = Q^T G; when the numerical rank of C is below K the sketch has
    caught the whole range of G, and the SVD of C (through a QR of C^T, so only a K x K matrix is
    decomposed) gives factors cut at that rank (singular values under 16 epsilons of the target's
    dtype, relative to the largest, are rounding noise). K grows 8, 32, ..., max_rank + 8 until a
    rank gap shows or the rank is past max_rank. Deterministic (fixed seed), on the target's device;
    ``chunk`` jobs at a time bound the float64 copies."""
    V, out_f, in_f = target.shape
    full = min(out_f, in_f)
    work = torch.float64 if target.device.type in ("cpu", "cuda") else target.dtype
    # Rounding noise: the target's own (float32 data), or the working precision's over a dot product.
    eps = max(torch.finfo(target.dtype).eps, torch.finfo(work).eps * max(out_f, in_f))
    gen = torch.Generator(device=target.device).manual_seed(0)
    lefts, rights = [], []
    for start in range(0, V, chunk):
        G = target[start : start + chunk].to(work)
        norm2 = torch.linalg.vector_norm(G, dim=(1, 2)).pow(2)
        if not bool(torch.isfinite(norm2).all()):
            return None  # a non-finite target stays dense: its job diverges as it would without factors
        K = 8
        while True:
            Kc = min(K, full)
            omega = torch.randn(in_f, Kc, generator=gen, device=G.device, dtype=work)
            Q, _ = torch.linalg.qr(G @ omega)  # (n, out, Kc): the sketched range
            # C = Q^T G (Kc x in) = R2^T Q2^T by a QR of C^T; the SVD is then of the small Kc x Kc R2^T.
            Q2, R2 = torch.linalg.qr(G.transpose(1, 2) @ Q)
            U, S, Wh = torch.linalg.svd(R2.transpose(1, 2))
            rank = int((S > 16 * eps * S[:, :1]).sum(1).max())
            if rank < Kc or Kc == full:
                break
            if Kc > max_rank:
                return None
            K = min(4 * K, max_rank + 8)
        if rank > max_rank:
            return None
        # ||G - L R^T||^2 = ||G||^2 - ||Q^T G||^2 (what the sketch missed) + the cut singular values^2
        # = ||G||^2 - sum of the kept S^2 (Q orthonormal); float64 resolves it to ~1e-8 relative.
        err2 = norm2 - S[:, :rank].pow(2).sum(1)
        if bool((err2 > FACTOR_RTOL**2 * norm2).any()):
            return None
        left = (Q @ U[:, :, :rank]) * S[:, None, :rank]
        right = Q2 @ Wh[:, :rank].transpose(1, 2)
        lefts.append(left)
        rights.append(right)
    k = max(t.shape[2] for t in lefts)  # pad every chunk to the largest rank (zero columns add nothing)
    pad = lambda t: F.pad(t, (0, k - t.shape[2])).to(target.dtype)  # noqa: E731
    return torch.cat([pad(t) for t in lefts]), torch.cat([pad(t) for t in rights])


def _dense_terms(g: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    g = g.reshape(g.shape[0], -1)
    return (g * target.reshape(g.shape[0], -1)).sum(1), (g * g).sum(1)


class PerJobGradients:
    """Computes ``MatchTerms`` for a batch holding V jobs of equal size, rows ordered job by job."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
        self.layers: list[tuple[nn.Module, dict[str, int]]] = []
        covered: set[int] = set()
        for mname, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            if not isinstance(module, SUPPORTED) or (isinstance(module, nn.Conv2d) and module.groups != 1):
                raise UnsupportedModelError(
                    f"layer {mname or type(module).__name__} ({type(module).__name__}) is not supported for "
                    "batched jobs"
                )
            self.layers.append((module, {k: index[id(p)] for k, p in own.items()}))
            covered.update(id(p) for p in own.values())
        self.targets: list[Tensor] = []
        self.target_norm2: Tensor | None = None
        # Factored low-rank targets (see factor_targets): on by default; off gives the dense path
        # (factors are made by set_targets while it is on, and kept when it is switched off and on).
        self.factored = True
        self.factors: dict[int, tuple[Tensor, Tensor]] = {}  # parameter index -> (L, R), active jobs
        self._factored_source: list[Tensor] | None = None  # the targets the cached factors are of
        self._all_factors: dict[int, tuple[Tensor, Tensor]] = {}
        self.used_factors: set[str] = set()  # parameters whose <g, G*> the last compute() took factored

    @staticmethod
    def check(model: nn.Module) -> str | None:
        """None when the model is supported, else the reason."""
        try:
            PerJobGradients(model)
        except UnsupportedModelError as err:
            return str(err)
        return None

    def set_targets(self, targets: list[Tensor], jobs: Tensor | None = None) -> None:
        """targets[p]: (V, *param_shape), the jobs' target gradients stacked per parameter; jobs: the
        indices of the jobs to compute (default all). Low-rank weight targets are factored once per
        set of target tensors: calling again with the same tensors and fewer jobs only selects rows."""
        if len(targets) != len(self.names):
            raise ValueError(f"expected {len(self.names)} target gradients, got {len(targets)}")
        factors: dict[int, tuple[Tensor, Tensor]] = {}
        if self.factored:
            source = self._factored_source
            if source is None or len(source) != len(targets) or any(a is not b for a, b in zip(source, targets)):
                self._all_factors = self._factor(targets)
                self._factored_source = list(targets)
            factors = self._all_factors
        if jobs is not None:
            targets = [t.index_select(0, jobs) for t in targets]
            factors = {i: (f[0].index_select(0, jobs), f[1].index_select(0, jobs)) for i, f in factors.items()}
        self.targets = targets
        self.factors = factors
        self.target_norm2 = torch.stack([t.reshape(t.shape[0], -1).pow(2).sum(1) for t in targets])

    def _factor(self, targets: list[Tensor]) -> dict[int, tuple[Tensor, Tensor]]:
        """Exact factors of every Linear / Conv2d weight target whose rank makes them cheaper."""
        out: dict[int, tuple[Tensor, Tensor]] = {}
        for module, params in self.layers:
            if not isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            i = params["weight"]
            t = targets[i].reshape(targets[i].shape[0], targets[i].shape[1], -1)
            found = factor_targets(t, useful_rank(t.shape[1], t.shape[2]))
            if found is not None:
                out[i] = found
        return out

    def factored_layers(self) -> dict[str, int]:
        """Parameter name -> rank of its factored target, for the layers that have factors."""
        return {self.names[i]: f[0].shape[2] for i, f in self.factors.items()}

    def compute(self, x: Tensor, labels: Tensor, num_jobs: int) -> MatchTerms:
        # Kept by layer, not by call order: a model may register its layers in another order than it runs
        # them (a user's own model); self.layers is in registration order.
        captured: list[tuple[Tensor, Tensor]] = [None] * len(self.layers)  # type: ignore[list-item]
        runs = [0]

        def keep(i: int, _m: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> None:
            captured[i] = (inp[0], out)
            runs[0] += 1

        hooks = [module.register_forward_hook(partial(keep, i)) for i, (module, _) in enumerate(self.layers)]
        try:
            logits = self.model(x)
        finally:
            for h in hooks:
                h.remove()
        if runs[0] != len(self.layers) or any(c is None for c in captured):
            raise UnsupportedModelError("a parametrized layer ran more or fewer than once per forward pass")
        # Each job's loss is the mean cross-entropy over its own images, as the client computed it.
        loss = F.cross_entropy(logits, labels, reduction="none").view(num_jobs, -1).mean(1).sum()
        deltas = torch.autograd.grad(loss, [out for _, out in captured], create_graph=True)
        self.used_factors = set()
        dots: list[Tensor | None] = [None] * len(self.names)
        norms: list[Tensor | None] = [None] * len(self.names)
        V = num_jobs
        for (module, params), (inp, _), d in zip(self.layers, captured, deltas):
            for key, (dot, norm2) in self._layer_terms(module, params, inp, d, V).items():
                dots[params[key]], norms[params[key]] = dot, norm2
        assert self.target_norm2 is not None, "set_targets first"
        return MatchTerms(torch.stack(dots), torch.stack(norms), self.target_norm2, self.names)  # type: ignore[arg-type]

    def _weight_terms(self, d: Tensor, a: Tensor, target: Tensor, index: int) -> tuple[Tensor, Tensor]:
        dot, norm2, used = _linear_terms(d, a, target, self.factors.get(index) if self.factored else None)
        if used:
            self.used_factors.add(self.names[index])
        return dot, norm2

    def _layer_terms(self, module: nn.Module, params: dict[str, int], inp: Tensor, d: Tensor, V: int):
        t = self.targets
        terms = {}
        if isinstance(module, nn.Linear):
            a = inp.reshape(V, -1, inp.shape[-1])
            dd = d.reshape(V, -1, d.shape[-1])
            terms["weight"] = self._weight_terms(dd, a, t[params["weight"]], params["weight"])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif isinstance(module, nn.Conv2d):
            cols = F.unfold(inp, module.kernel_size, module.dilation, module.padding, module.stride)
            a = cols.transpose(1, 2).reshape(V, -1, cols.shape[1])
            dd = d.flatten(2).transpose(1, 2).reshape(V, -1, d.shape[1])
            w = t[params["weight"]]
            terms["weight"] = self._weight_terms(dd, a, w.reshape(V, w.shape[1], -1), params["weight"])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif isinstance(module, nn.LayerNorm):
            shape = module.normalized_shape
            x_hat = F.layer_norm(inp, shape, eps=module.eps).reshape(V, -1, *shape)
            dd = d.reshape(V, -1, *shape)
            if "weight" in params:
                terms["weight"] = _dense_terms((dd * x_hat).sum(1), t[params["weight"]])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif isinstance(module, nn.GroupNorm):
            x_hat = F.group_norm(inp, module.num_groups, eps=module.eps)
            channels = inp.shape[1]
            dd = d.reshape(V, -1, channels, d[0, 0].numel())
            if "weight" in params:
                prod = (dd * x_hat.reshape(dd.shape)).sum((1, 3))
                terms["weight"] = _dense_terms(prod, t[params["weight"]])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum((1, 3)), t[params["bias"]])
        else:  # TokenEmbedding
            dd = d.reshape(V, -1, *d.shape[1:])
            terms["pos_embedding"] = _dense_terms(dd.sum(1), t[params["pos_embedding"]])
            terms["cls_token"] = _dense_terms(dd[:, :, 0].sum(1), t[params["cls_token"]])
        return terms


def autograd_terms(
    model: nn.Module, x: Tensor, labels: Tensor, targets: list[Tensor], support: list[Tensor] | None = None
) -> MatchTerms:
    """The same terms for ONE job by plain autograd: the reference, and the path for models that
    ``PerJobGradients`` does not support (BatchNorm) or for a job that matches only the entries in
    ``support`` (a pruned capture: the dummy gradient is cut to them too). targets[p]: (1, *param_shape)."""
    params = [p for p in model.parameters()]
    loss = F.cross_entropy(model(x), labels)
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    dots, norms, tnorms = [], [], []
    for g, p, tgt in zip(grads, params, targets):
        g = torch.zeros_like(p) if g is None else g
        if support is not None:
            g = g * support[len(dots)]
        dots.append((g * tgt[0]).sum().reshape(1))
        norms.append(g.pow(2).sum().reshape(1))
        tnorms.append(tgt.pow(2).sum().reshape(1))
    names = [n for n, _ in model.named_parameters()]
    return MatchTerms(torch.stack(dots), torch.stack(norms), torch.stack(tnorms), names)
