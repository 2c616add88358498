"""Per-job parameter gradients for the layers without a batched formula (``layer_terms.py``).

``PerJobGradients`` reads each job's gradient terms off the deltas (the gradient of the summed loss
w.r.t. each layer's output, per row and so per job). For Linear, Conv2d, the norms and the ViT's
token embedding it has closed forms. Every other layer with parameters (PReLU, a layer scale, a
user's own module...) takes the same deltas through its vector-Jacobian product instead, one job
at a time *inside* ``torch.func.vmap``: for job j,

    g_j = vjp(p -> layer(p, inputs_j), p)(delta_j),

with inputs_j and delta_j the job's rows. vmap runs all jobs as one batched computation, and the
result stays differentiable in the inputs and the deltas, which the attack's second backward needs.
Layers without parameters (activations, pooling, reshapes) need nothing: deltas flow through them.

Parameters that are not read by their own leaf layer (a module that owns parameters and also runs
children, as timm's VisionTransformer with its ``cls_token`` and ``pos_embed``; a weight read
outside its layer) are watched op by op while the model runs (``ParamWatch``, a torch function
mode): each op that reads one is recorded with its inputs and output, and the op's output delta
gives the per-job gradient the same way, the op standing in for the layer.

Splitting a call into jobs: tensors holding one row per image (first dimension N = V * B) are cut
into the V jobs' rows, and for a watched op an integer argument equal to N (``expand(N, -1, -1)``)
becomes B. The first time a call is split, its per-job outputs are compared with the output the
model computed; where they differ (the call mixes rows in a way the split cannot see), the call
takes the masked form instead: the vjp of the whole call, applied to the delta with every other
job's rows zeroed, V times (also in one vmap): exact for any per-image computation, V times the
work. A call whose output has no row per image cannot be split by jobs at all
(``UnsupportedModelError``: the engine then runs such a model one job at a time by autograd).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten


class UnsupportedModelError(ValueError):
    """The model holds a layer whose per-job gradient cannot be assembled from a batch of several
    jobs (e.g. BatchNorm with batch statistics, which couples the images of a batch)."""


@dataclass
class Call:
    """One run of a layer, or one op that read a parameter outside its own layer: enough to run it
    again as a function of its parameters (``fn(flat_args, params)``) and split it into jobs."""

    fn: Callable[[list, tuple[Tensor, ...]], Tensor]
    flat: list
    spec: Any
    params: tuple[Tensor, ...]  # the parameters' values (detached): the vjp's primals
    # what each of them is: an int, the parameter's index in model.parameters() order, or ("derived", k),
    # the output of the k-th watched op when that op's output has no row per image (see ParamWatch)
    indices: list
    out: Tensor
    name: str
    rewrite_ints: bool = False  # an integer argument equal to N is the batch size (watched ops)
    derived: bool = False  # a watched op whose output has no row per image (e.g. fc.weight[0, 0], p.to(dtype))
    versions: list[tuple[Tensor, int]] = field(default_factory=list)  # what must not change in place later

    def changed(self) -> bool:
        return any(t._version != v for t, v in self.versions)


def _versions(tensors: list[Any]) -> list[tuple[Tensor, int]]:
    return [(t, t._version) for t in tensors if isinstance(t, Tensor)]


def module_call(
    module: nn.Module, keys: list[str], indices: list[int], args: tuple, kwargs: dict, out: Tensor, name: str
) -> Call:
    flat, spec = tree_flatten((args, kwargs))
    params = tuple(getattr(module, k).detach() for k in keys)

    def fn(vals: list, ps: tuple[Tensor, ...]) -> Tensor:
        a, k = tree_unflatten(vals, spec)
        return functional_call(module, dict(zip(keys, ps)), a, k)

    return Call(fn, flat, spec, params, indices, out, name, versions=_versions([*flat, out]))


def _has_rows(v: Any, N: int) -> bool:
    return isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == N


def _rows(t: Tensor, V: int) -> Tensor:
    return t.reshape(V, t.shape[0] // V, *t.shape[1:])


def derived_grads(call: Call, grads: Tensor) -> tuple[Tensor, ...]:
    """Each job's gradient of a derived call's inputs from each job's gradient of its output, (V, *out.shape):
    the vjp of the call (which reads parameters only, no image: linear in the per-job gradients, which
    alone depend on the images), for all jobs at once (autograd's batched cotangents)."""
    leaves = [p.detach().requires_grad_(True) for p in call.params]
    with torch.enable_grad():
        out = call.fn(list(call.flat), tuple(leaves))
        got = torch.autograd.grad(out, leaves, grads, create_graph=True, allow_unused=True, is_grads_batched=True)
    return tuple(
        torch.zeros(grads.shape[0], *p.shape, dtype=p.dtype, device=p.device) if g is None else g
        for g, p in zip(got, call.params)
    )


def _loop_grads(call: Call, d: Tensor, V: int, rows: list[int], ints: list[int]) -> tuple[Tensor, ...]:
    """The split form by plain autograd, one job after another: the reference the vmap form is
    checked against, and the form a call takes where vmap's second derivative differs from it."""
    B = d.shape[0] // V
    per_param: list[list[Tensor]] = [[] for _ in call.params]
    for j in range(V):
        vals = list(call.flat)
        for i in rows:
            vals[i] = vals[i][j * B : (j + 1) * B]
        for i in ints:
            vals[i] = B
        leaves = [p.detach().requires_grad_(True) for p in call.params]
        with torch.enable_grad():
            out_j = call.fn(vals, tuple(leaves))
            grads = torch.autograd.grad(out_j, leaves, d[j * B : (j + 1) * B], create_graph=True, allow_unused=True)
        for k, (g, p) in enumerate(zip(grads, call.params)):
            per_param[k].append(torch.zeros_like(p) if g is None else g)
    return tuple(torch.stack(gs) for gs in per_param)


def _masked_grads(call: Call, d: Tensor, V: int) -> tuple[Tensor, ...]:
    """The vjp of the whole call applied to the delta with every other job's rows zeroed, per job."""
    B = d.shape[0] // V
    leaves = [p.detach().requires_grad_(True) for p in call.params]
    with torch.enable_grad():
        out = call.fn(list(call.flat), tuple(leaves))
    per_param: list[list[Tensor]] = [[] for _ in call.params]
    for j in range(V):
        masked = torch.zeros_like(d)
        masked[j * B : (j + 1) * B] = d[j * B : (j + 1) * B]
        grads = torch.autograd.grad(out, leaves, masked, create_graph=True, retain_graph=True, allow_unused=True)
        for k, (g, p) in enumerate(zip(grads, call.params)):
            per_param[k].append(torch.zeros_like(p) if g is None else g)
    return tuple(torch.stack(gs) for gs in per_param)


def _agree(a: tuple[Tensor, ...], b: tuple[Tensor, ...], wrt: list[Tensor]) -> bool:
    """Whether two per-job gradients agree in value and in their derivative w.r.t. ``wrt`` (the call's
    inputs and delta): the attack differentiates them once more."""
    with torch.no_grad():
        for x, y in zip(a, b):
            if x.shape != y.shape or not torch.allclose(x, y, rtol=1e-4, atol=1e-5 * float(y.abs().max()) + 1e-12):
                return False
    if not wrt:
        return True
    gen = torch.Generator(device=a[0].device).manual_seed(0)
    probes = [torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype) for x in a]
    da = torch.autograd.grad(sum((x * r).sum() for x, r in zip(a, probes)), wrt, retain_graph=True, allow_unused=True)
    db = torch.autograd.grad(sum((y * r).sum() for y, r in zip(b, probes)), wrt, retain_graph=True, allow_unused=True)
    for x, y in zip(da, db):
        if (x is None) != (y is None):
            return False
        if x is not None and not torch.allclose(x, y, rtol=1e-4, atol=1e-5 * float(y.abs().max()) + 1e-12):
            return False
    return True


def per_job_grads(call: Call, d: Tensor, V: int, form: str | None) -> tuple[tuple[Tensor, ...], str]:
    """Each job's gradient of ``call``'s parameters, (V, *param.shape) each, from the delta ``d`` of
    its output. ``form``: "vmap", "loop" or "masked" (see the module docstring), or None the first
    time: the split form is tried and its per-job outputs checked against the model's; then vmap's
    gradients, and their derivative w.r.t. the inputs, against one job at a time by autograd (vmap's
    second derivative is wrong for some ops in this torch, e.g. instance_norm's w.r.t. its input).
    Returns the gradients and the form used."""
    N = call.out.shape[0] if call.out.dim() else 0
    if N != d.shape[0] or N % V:
        raise UnsupportedModelError(
            f"{call.name}: its output {tuple(call.out.shape)} does not hold one row per image, so its parameters' "
            "gradient cannot be split by jobs"
        )
    B = N // V
    rows = [i for i, v in enumerate(call.flat) if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == N]
    ints = [i for i, v in enumerate(call.flat) if call.rewrite_ints and type(v) is int and v == N]
    if form == "masked":
        return _masked_grads(call, d, V), form
    if form == "loop":
        return _loop_grads(call, d, V, rows, ints), form

    def one(d_j: Tensor, *xs: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        vals = list(call.flat)
        for i, xv in zip(rows, xs):
            vals[i] = xv
        for i in ints:
            vals[i] = B
        out_j, back = vjp(lambda *ps: call.fn(vals, ps), *call.params)
        return out_j, back(d_j)

    try:
        outs, grads = vmap(one)(_rows(d, V), *[_rows(call.flat[i], V) for i in rows])
    except (RuntimeError, NotImplementedError, ValueError, TypeError):  # an op vmap cannot batch
        if form == "vmap":
            raise
        outs, grads = None, None
    if form == "vmap":
        return grads, form
    if outs is not None and outs.shape == (V, B, *call.out.shape[1:]):
        with torch.no_grad():
            ref = _rows(call.out.detach(), V)
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            split = bool(torch.allclose(outs.detach(), ref, rtol=1e-4, atol=1e-5 * scale + 1e-12))
        if split:
            loop = _loop_grads(call, d, V, rows, ints)
            wrt = [v for v in call.flat if isinstance(v, Tensor) and v.requires_grad] + ([d] if d.requires_grad else [])
            if _agree(grads, loop, wrt):
                return grads, "vmap"
            return loop, "loop"
    return _masked_grads(call, d, V), "masked"


class ParamWatch(TorchFunctionMode):
    """Records every op of a forward pass that reads a watched parameter outside its own leaf layer.

    An op whose output has no row per image (N = ``rows`` rows, and an input with them or an integer
    N among its arguments) is a *derived* parameter: its output is watched in turn, and the per-job
    gradient reaches the parameter back through the op (``derived_grads``).
    ``owner``: id(parameter) -> id of its leaf layer (read freely while that layer runs), or None (a
    parameter of a module that also runs children: every read is recorded). ``running``: the leaf
    layers running now, innermost last (kept by the layers' hooks). Recorded ops run on a fresh leaf
    copy of each parameter they read (so that their output is in the autograd graph whether or not
    the parameter requires grad); ``clone_in`` / ``clone_out`` (op ordinals) copy an op's inputs or
    output that the model later changes in place."""

    def __init__(
        self, owner: dict[int, int | None], index: dict[int, int], names: list[str], running: list[int], rows: int
    ):
        super().__init__()
        self.owner, self.index, self.names, self.running, self.rows = owner, index, names, running, rows
        self.derived: dict[int, int] = {}  # id(derived tensor) -> the ordinal of the op that made it
        self.calls: list[Call] = []
        self.clone_in: set[int] = set()
        self.clone_out: set[int] = set()
        self.paused = False  # while the engine's own hooks run

    def _watched(self, v: Any) -> bool:
        if not isinstance(v, Tensor):
            return False
        if id(v) in self.derived:
            return True
        if id(v) not in self.owner:
            return False
        owner = self.owner[id(v)]
        return owner is None or not self.running or self.running[-1] != owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused or getattr(func, "__name__", "") == "__get__":  # attribute reads (shape, dtype...): no op
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        hits = [i for i, v in enumerate(flat) if self._watched(v)]
        if not hits:
            return func(*args, **kwargs)
        k = len(self.calls)
        if k in self.clone_in:
            flat = [v.clone() if isinstance(v, Tensor) and i not in hits else v for i, v in enumerate(flat)]
        params = tuple(flat[i].detach() for i in hits)
        indices = [
            ("derived", self.derived[id(flat[i])]) if id(flat[i]) in self.derived else self.index[id(flat[i])]
            for i in hits
        ]
        taps = [p.clone().requires_grad_(True) for p in params]
        vals = list(flat)
        for i, t in zip(hits, taps):
            vals[i] = t
        a, kw = tree_unflatten(vals, spec)
        out = func(*a, **kw)
        read = ", ".join(self.names[j] if isinstance(j, int) else f"op {j[1]}'s output" for j in indices)
        name = f"{read} (read by {getattr(func, '__name__', str(func))})"
        if not isinstance(out, Tensor):
            raise UnsupportedModelError(f"parameter {name}: the op returns a {type(out).__name__}, not one tensor")
        rest = [v for i, v in enumerate(flat) if i not in hits]
        N = self.rows
        per_image = (
            out.dim() >= 1 and out.shape[0] == N and any(_has_rows(v, N) or (type(v) is int and v == N) for v in rest)
        )

        def fn(vs: list, ps: tuple[Tensor, ...]) -> Tensor:
            vs = list(vs)
            for i, p in zip(hits, ps):
                vs[i] = p
            a2, k2 = tree_unflatten(vs, spec)
            return func(*a2, **k2)

        self.calls.append(
            Call(
                fn,
                list(flat),
                spec,
                params,
                indices,
                out,
                name,
                rewrite_ints=True,
                derived=not per_image,
                versions=_versions([*rest, out]),
            )
        )
        if not per_image:
            self.derived[id(out)] = k
        return out.clone() if k in self.clone_out else out
