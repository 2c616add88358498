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
  Grouped / depthwise Conv2d: the Linear form per group (groups folded into the jobs' dimension).
  Eval-mode BatchNorm: an affine map per image, as LayerNorm with x_hat from the running statistics.
The double backward then flows through ordinary batched matrix products.

The per-layer hybrid: every other layer with parameters (PReLU, InstanceNorm, a layer scale, a
reflect-padded convolution, a user's own module), a parameter read outside its own layer (timm's ViT
cls token and position embedding), and a layer that runs more than once per pass take the same
deltas through their vector-Jacobian product, per job inside torch.func.vmap (``hybrid.py``).
Parameter-free layers need nothing. Only a layer that couples the images of a batch (BatchNorm with
batch statistics: train mode) makes the model unsupported here: the engine then runs it one job at
a time by ``autograd_terms``. ``PerJobGradients.paths`` names the path each layer took; the runner
writes it to the run's log and ``gradient_paths.json``.

Low-rank targets (the memory-bound regime left behind): a captured one-step gradient of a Linear
layer is itself sum_s delta*_s a*_s^T over the victim's rows, so its rank is at most B*T. Such a
target is factored once, exactly (G*_j = L_j R_j^T up to float rounding, see ``factor_targets``),
and <g_j, G*_j> = sum_t (L_j^T delta_t).(R_j^T a_t) never reads the weight-sized target again.
Each layer takes the factored or the dense form by a FLOP/bytes estimate (``_dot_costs``); the
dense form stays for targets whose rank is not small (early convolutions, ViT layers at B >= 4).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedsim.models.vit import TokenEmbedding

from .hybrid import Call, ParamWatch, UnsupportedModelError, derived_grads, module_call, per_job_grads

# The layers with a batched closed form (``_layer_terms``); every other layer with parameters takes
# the per-job vjp of hybrid.py.
SUPPORTED = (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.GroupNorm, TokenEmbedding, _BatchNorm)

# How each layer's per-job terms are computed (the run's log names them, ``PerJobGradients.paths``).
BATCHED, FACTORED, VJP, ONE_JOB = "batched", "batched-factored", "per-job vjp", "one-job autograd"
NOT_RUN = "not run (zero gradient)"

__all__ = ["UnsupportedModelError", "PerJobGradients", "MatchTerms", "autograd_terms", "factor_targets"]


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


def _batch_statistics(module: _BatchNorm) -> bool:
    """Whether a BatchNorm normalizes by the statistics of its batch (train mode, or no running
    statistics), as its forward decides: then it couples the images of a batch."""
    return module.training or module.running_mean is None or module.running_var is None


def _plain_forward(module: nn.Module) -> bool:
    """Whether the layer's forward is its torch base class's own (else it is checked once against it)."""
    for base in (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.GroupNorm, _BatchNorm):
        if isinstance(module, base):
            return type(module).forward is base.forward
    return True


def _kind(module: nn.Module) -> str:
    """The closed form a layer's per-job terms take (``_layer_terms``), or "vjp"."""
    if isinstance(module, TokenEmbedding):
        return "token"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d):
        plain = isinstance(module.padding, tuple) and module.padding_mode == "zeros"
        return "vjp" if not plain else "conv" if module.groups == 1 else "grouped_conv"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    if isinstance(module, _BatchNorm):
        return "batchnorm"
    return "vjp"


def _reference(module: nn.Module, kind: str, inp: Tensor) -> Tensor:
    """What the closed form assumes the layer computes (checked once for a layer with its own forward)."""
    m: nn.Module = module
    if kind == "linear":
        return F.linear(inp, m.weight, m.bias)
    if kind in ("conv", "grouped_conv"):
        return F.conv2d(inp, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups)
    if kind == "layernorm":
        return F.layer_norm(inp, m.normalized_shape, m.weight, m.bias, m.eps)
    if kind == "groupnorm":
        return F.group_norm(inp, m.num_groups, m.weight, m.bias, m.eps)
    return F.batch_norm(inp, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)


class PerJobGradients:
    """Computes ``MatchTerms`` for a batch holding V jobs of equal size, rows ordered job by job.

    Per layer with parameters (the hybrid): the batched closed forms for Linear, Conv2d (grouped and
    depthwise too), LayerNorm, GroupNorm, eval-mode BatchNorm and the ViT's token embedding; the
    per-job vjp of ``hybrid.py`` for any other layer, for a parameter read outside its own layer,
    and for a layer that runs more than once in a pass. Only a layer that couples the images of a
    batch (BatchNorm with batch statistics) makes the model unsupported: ``UnsupportedModelError``,
    and the engine runs it one job at a time by autograd (``autograd_terms``). ``paths`` says which
    path each layer took in the last ``compute``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        index = {id(p): i for i, (_, p) in enumerate(named)}
        self.index = index
        self.layers: list[tuple[nn.Module, dict[str, int]]] = []
        self.layer_names: list[str] = []
        self.kinds: list[str] = []
        self.checked: list[bool] = []  # the closed form is known to match the layer's forward
        # id(parameter) -> id(its leaf layer), or None for a parameter of a module that also runs children
        self.owner: dict[int, int | None] = {}
        self.loose: list[int] = []  # indices of the parameters read outside a leaf layer
        for mname, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            label = f"{mname or type(module).__name__} ({type(module).__name__})"
            if any(id(p) in self.owner for p in own.values()):
                raise UnsupportedModelError(f"layer {label} shares a parameter with another layer")
            if isinstance(module, _BatchNorm) and _batch_statistics(module):
                raise UnsupportedModelError(
                    f"layer {label} couples the images of a batch (BatchNorm with batch statistics): one job at a time"
                )
            if next(module.children(), None) is not None and not isinstance(module, TokenEmbedding):
                for p in own.values():
                    self.owner[id(p)] = None
                    self.loose.append(index[id(p)])
                continue
            self.layers.append((module, {k: index[id(p)] for k, p in own.items()}))
            self.layer_names.append(mname or type(module).__name__)
            self.kinds.append(_kind(module))
            self.checked.append(_plain_forward(module))
            self.owner.update({id(p): id(module) for p in own.values()})
        # Watch parameter reads (ParamWatch) while a pass may read one outside its leaf layer: always
        # with loose parameters, else in the first pass only (a model that finds none is not watched again).
        self.watch = True
        self.clone_in: set[int] = set()  # layers whose inputs / output the model changes in place later
        self.clone_out: set[int] = set()
        self.op_clone_in: set[int] = set()
        self.op_clone_out: set[int] = set()
        self.forms: dict[tuple, str] = {}  # per call: vmap, loop or masked (hybrid.per_job_grads)
        self.paths: dict[str, str] = {}
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
    def check(model: nn.Module, input_shape: tuple[int, ...] | None = None) -> str | None:
        """None when the model's jobs can share a batch, else the reason. With ``input_shape``, one
        probe pass (2 jobs of 2 random images, dropout off) also finds what only running shows."""
        try:
            ghost = PerJobGradients(model)
            if input_shape is not None:
                ghost.probe(input_shape)
        except UnsupportedModelError as err:
            return str(err)
        except Exception as err:  # anything else the batched pass cannot take: one job at a time, as before
            text = str(err).strip().splitlines()
            return f"the batched per-job pass fails on this model ({type(err).__name__}: {text[0] if text else ''})"
        return None

    def probe(self, input_shape: tuple[int, ...], num_classes: int | None = None) -> None:
        from fedsim.models import DropoutMode, dropout_mode

        params = list(self.model.parameters())
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        try:
            with torch.random.fork_rng(devices=[]), dropout_mode(self.model, DropoutMode.OFF):
                torch.manual_seed(0)
                x = torch.randn(4, *input_shape).requires_grad_(True)
                labels = torch.randint(0, num_classes or self.model(x.detach()).shape[1], (4,))
                factored, self.factored = self.factored, False
                self.set_targets([torch.randn(2, *p.shape) for p in params])
                terms = self.compute(x, labels, 2)
                self.factored = factored
                torch.autograd.grad(terms.norm2.sum(), x)
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)

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
        for (_, params), kind in zip(self.layers, self.kinds):
            if kind not in ("linear", "conv"):
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

    # -- one pass: the layers' calls, the watched parameter reads ---------------------------------------
    def _forward(self, x: Tensor) -> tuple[Tensor, list[list[Call]], list[Call], bool]:
        """The logits, each layer's calls, the recorded parameter reads, and whether the pass must be
        run again (a kept input or output was changed in place later: now marked to be copied)."""
        calls: list[list[Call]] = [[] for _ in self.layers]
        running: list[int] = []
        watch = ParamWatch(self.owner, self.index, self.names, running, x.shape[0]) if self.watch else None
        if watch is not None:
            watch.clone_in, watch.clone_out = self.op_clone_in, self.op_clone_out

        def enter(i: int, module: nn.Module, args: tuple, kwargs: dict):
            running.append(id(module))
            if i in self.clone_in:  # copies of the inputs (not parameter reads)
                return tuple(a.clone() if isinstance(a, Tensor) else a for a in args), kwargs
            return None

        def keep(i: int, module: nn.Module, args: tuple, kwargs: dict, out: Tensor):
            running.pop()
            if not isinstance(out, Tensor):
                raise UnsupportedModelError(
                    f"layer {self.layer_names[i]} returns a {type(out).__name__}, not one tensor"
                )
            keys = list(self.layers[i][1])
            indices = [self.layers[i][1][k] for k in keys]
            if watch is not None:
                watch.paused = True
            try:
                calls[i].append(module_call(module, keys, indices, args, kwargs, out, f"layer {self.layer_names[i]}"))
                return out.clone() if i in self.clone_out else None
            finally:
                if watch is not None:
                    watch.paused = False

        hooks = []
        for i, (module, _) in enumerate(self.layers):
            hooks.append(module.register_forward_pre_hook(partial(enter, i), with_kwargs=True))
            hooks.append(module.register_forward_hook(partial(keep, i), with_kwargs=True))
        try:
            with watch if watch is not None else nullcontext():
                logits = self.model(x)
        finally:
            for h in hooks:
                h.remove()
        ops = watch.calls if watch is not None else []
        again = False
        for i, layer_calls in enumerate(calls):
            for call in layer_calls:
                for t, v in call.versions[:-1]:
                    if t._version != v:
                        again = again or i not in self.clone_in
                        self.clone_in.add(i)
                if call.versions and call.versions[-1][0]._version != call.versions[-1][1]:
                    again = again or i not in self.clone_out
                    self.clone_out.add(i)
        for k, call in enumerate(ops):
            if call.changed():
                if any(t._version != v for t, v in call.versions[:-1]):
                    again = again or k not in self.op_clone_in
                    self.op_clone_in.add(k)
                if call.versions[-1][0]._version != call.versions[-1][1]:
                    again = again or k not in self.op_clone_out
                    self.op_clone_out.add(k)
        if not again and any(c.changed() for cs in calls for c in cs):
            raise UnsupportedModelError("a layer's input or output is changed in place even when copied")
        return logits, calls, ops, again

    def compute(self, x: Tensor, labels: Tensor, num_jobs: int) -> MatchTerms:
        logits, calls, ops, again = self._forward(x)
        if again:
            logits, calls, ops, again = self._forward(x)
            if again:
                raise UnsupportedModelError("a layer's input or output is changed in place, unstably")
        if self.watch and not ops and not self.loose:
            self.watch = False  # nothing read outside its layer: later passes need no watching
        read = {i for op in ops for i in op.indices if isinstance(i, int)}
        for i, (module, params) in enumerate(self.layers):
            if self.kinds[i] == "vjp":
                continue
            if len(calls[i]) != 1 or read & set(params.values()) or len(calls[i][0].flat) != 1:
                self.kinds[i] = "vjp"  # runs twice, or with more inputs, or its parameters are read elsewhere
            elif not self.checked[i]:
                (inp,) = calls[i][0].flat
                with torch.no_grad():
                    ref = _reference(module, self.kinds[i], inp)
                    out = calls[i][0].out
                    scale = float(ref.abs().max()) if ref.numel() else 0.0
                    same = ref.shape == out.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * scale + 1e-12)
                self.checked[i] = True
                if not same:
                    self.kinds[i] = "vjp"
        # Each job's loss is the mean cross-entropy over its own images, as the client computed it.
        loss = F.cross_entropy(logits, labels, reduction="none").view(num_jobs, -1).mean(1).sum()
        flat_calls = [c for cs in calls for c in cs] + [op for op in ops if not op.derived]
        outs = [c.out for c in flat_calls]
        grads = torch.autograd.grad(loss, outs, create_graph=True, allow_unused=True) if outs else ()
        deltas = {id(c): torch.zeros_like(c.out) if g is None else g for c, g in zip(flat_calls, grads)}
        self.used_factors = set()
        V = num_jobs
        dots: list[Tensor | None] = [None] * len(self.names)
        norms: list[Tensor | None] = [None] * len(self.names)
        # parameter index, or ("derived", k) -> its per-job gradients, (V, *shape)
        summed: dict[int | tuple[str, int], Tensor] = {}

        def add(call: Call, key: tuple) -> None:
            if call.derived:
                out_grads = summed.pop(("derived", key[1]), None)
                if out_grads is None:
                    return  # its output never reached the loss
                grads = derived_grads(call, out_grads)
            else:
                grads, form = per_job_grads(call, deltas[id(call)], V, self.forms.get(key))
                self.forms[key] = form
            for i, g in zip(call.indices, grads):
                summed[i] = g if i not in summed else summed[i] + g

        paths: dict[str, str] = {}
        for i, ((module, params), layer_calls) in enumerate(zip(self.layers, calls)):
            name = self.layer_names[i]
            if not layer_calls:
                paths[name] = NOT_RUN if not read & set(params.values()) else VJP
                continue
            if self.kinds[i] != "vjp":
                (inp,) = layer_calls[0].flat
                terms = self._layer_terms(module, params, inp, deltas[id(layer_calls[0])], V, self.kinds[i])
                factored = any(self.names[params[k]] in self.used_factors for k in terms)
                for key, (dot, norm2) in terms.items():
                    dots[params[key]], norms[params[key]] = dot, norm2
                paths[name] = FACTORED if factored else BATCHED
                continue
            for n, call in enumerate(layer_calls):
                add(call, ("layer", i, n))
            paths[name] = VJP
        for k in reversed(range(len(ops))):  # consumers first: a derived output's gradient is complete
            add(ops[k], ("op", k))
        for i in self.loose:
            paths[self.names[i]] = VJP if i in read else NOT_RUN
        for i in range(len(self.names)):
            if dots[i] is None:
                g = summed.get(i)
                if g is None:  # never read in this pass: a zero gradient
                    zero = x.new_zeros(V)
                    dots[i], norms[i] = zero, zero
                else:
                    dots[i], norms[i] = _dense_terms(g, self.targets[i])
        self.paths = paths
        assert self.target_norm2 is not None, "set_targets first"
        return MatchTerms(torch.stack(dots), torch.stack(norms), self.target_norm2, self.names)  # type: ignore[arg-type]

    def _weight_terms(self, d: Tensor, a: Tensor, target: Tensor, index: int) -> tuple[Tensor, Tensor]:
        dot, norm2, used = _linear_terms(d, a, target, self.factors.get(index) if self.factored else None)
        if used:
            self.used_factors.add(self.names[index])
        return dot, norm2

    def _layer_terms(self, module: nn.Module, params: dict[str, int], inp: Tensor, d: Tensor, V: int, kind: str):
        t = self.targets
        terms = {}
        if kind == "linear":
            a = inp.reshape(V, -1, inp.shape[-1])
            dd = d.reshape(V, -1, d.shape[-1])
            terms["weight"] = self._weight_terms(dd, a, t[params["weight"]], params["weight"])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif kind == "conv":
            cols = F.unfold(inp, module.kernel_size, module.dilation, module.padding, module.stride)
            a = cols.transpose(1, 2).reshape(V, -1, cols.shape[1])
            dd = d.flatten(2).transpose(1, 2).reshape(V, -1, d.shape[1])
            w = t[params["weight"]]
            terms["weight"] = self._weight_terms(dd, a, w.reshape(V, w.shape[1], -1), params["weight"])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif kind == "grouped_conv":
            # Each group is a convolution of its own: fold the groups into the jobs' dimension.
            G = module.groups
            cols = F.unfold(inp, module.kernel_size, module.dilation, module.padding, module.stride)
            N, L = cols.shape[0], cols.shape[2]
            a = cols.view(V, N // V, G, -1, L).permute(0, 2, 1, 4, 3).reshape(V * G, (N // V) * L, -1)
            dd = d.reshape(V, N // V, G, -1, L).permute(0, 2, 1, 4, 3).reshape(V * G, (N // V) * L, -1)
            w = t[params["weight"]]
            target = w.reshape(V * G, w.shape[1] // G, -1)
            dot, norm2, _ = _linear_terms(dd, a, target)
            terms["weight"] = dot.view(V, G).sum(1), norm2.view(V, G).sum(1)
            if "bias" in params:
                terms["bias"] = _dense_terms(d.reshape(V, N // V, d.shape[1], -1).sum((1, 3)), t[params["bias"]])
        elif kind == "layernorm":
            shape = module.normalized_shape
            x_hat = F.layer_norm(inp, shape, eps=module.eps).reshape(V, -1, *shape)
            dd = d.reshape(V, -1, *shape)
            if "weight" in params:
                terms["weight"] = _dense_terms((dd * x_hat).sum(1), t[params["weight"]])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum(1), t[params["bias"]])
        elif kind == "groupnorm":
            x_hat = F.group_norm(inp, module.num_groups, eps=module.eps)
            channels = inp.shape[1]
            dd = d.reshape(V, -1, channels, d[0, 0].numel())
            if "weight" in params:
                prod = (dd * x_hat.reshape(dd.shape)).sum((1, 3))
                terms["weight"] = _dense_terms(prod, t[params["weight"]])
            if "bias" in params:
                terms["bias"] = _dense_terms(dd.sum((1, 3)), t[params["bias"]])
        elif kind == "batchnorm":  # eval mode: x_hat from the running statistics, an affine map per image
            if _batch_statistics(module):
                raise UnsupportedModelError(
                    f"layer {type(module).__name__} switched to batch statistics (train mode) after the engine "
                    "chose to batch its jobs"
                )
            x_hat = F.batch_norm(inp, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)
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
