"""Per-job gradient-matching terms for V victim jobs that share one model, without ever building
a per-job weight-sized gradient where it can be avoided.

Why by hand: autograd gives the gradient of a sum over the whole batch, but every victim job has
its own target gradient, so each job needs its own <g_j, g*_j> and ||g_j||^2. vmap or stacked
weights cost as much as one job at a time (see docs/performance.md). Instead we take the gradient
of the summed loss w.r.t. each layer's OUTPUT (delta), which is per row and so per job, and
assemble each job's parameter-gradient terms from deltas and the layer inputs. The modules:

* ``layer_terms``: one registered batched formula per layer type (Linear, Conv2d, LayerNorm,
  GroupNorm, eval-mode BatchNorm, the ViT's token embedding);
* ``factoring``: low-rank targets factored once, and when the factored form pays;
* ``recording``: the model's layers with parameters, and one recorded forward pass;
* ``hybrid``: the per-job vjp (inside torch.func.vmap) for every other layer with parameters
  (PReLU, InstanceNorm, a layer scale, a reflect-padded convolution, a user's own module), for a
  parameter read outside its own layer (timm's ViT cls token and position embedding), and for a
  layer that runs more than once per pass;
* this module: ``PerJobGradients``, which routes each layer to its formula or the vjp and adds up
  the terms, and ``autograd_terms``, the one-job reference.

Parameter-free layers need nothing. Only a layer that couples the images of a batch (BatchNorm with
batch statistics: train mode) makes the model unsupported here: the engine then runs it one job at
a time by ``autograd_terms``. ``PerJobGradients.paths`` names the path each layer took; the runner
writes it to the run's log and ``gradient_paths.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .factoring import FACTOR_RTOL, factor_targets, useful_rank
from .hybrid import Call, UnsupportedModelError, derived_grads, per_job_grads
from .layer_terms import JobTargets, LayerFormula, batched_formula, dense_terms
from .recording import LayerMap, PassRecorder

# How each layer's per-job terms are computed (the run's log names them, ``PerJobGradients.paths``).
BATCHED, FACTORED, VJP, ONE_JOB = "batched", "batched-factored", "per-job vjp", "one-job autograd"
NOT_RUN = "not run (zero gradient)"

__all__ = [
    "FACTOR_RTOL",
    "MatchTerms",
    "PerJobGradients",
    "UnsupportedModelError",
    "autograd_terms",
    "factor_targets",
    "useful_rank",
]


@dataclass
class MatchTerms:
    """Per parameter p and job j: dot[p, j] = <g, g*>, norm2[p, j] = ||g||^2, target_norm2 = ||g*||^2."""

    dot: Tensor
    norm2: Tensor
    target_norm2: Tensor
    names: list[str]


def _forward_matches(entry: LayerFormula, module: nn.Module, call: Call) -> bool:
    """Whether the layer's recorded output is what its formula assumes it computes (to float rounding)."""
    (inp,) = call.flat
    with torch.no_grad():
        ref = entry.reference(module, inp)
        out = call.out
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        return ref.shape == out.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * scale + 1e-12)


class PerJobGradients:
    """Computes ``MatchTerms`` for a batch holding V jobs of equal size, rows ordered job by job.

    Per layer with parameters (the hybrid): its registered batched formula (``layer_terms.FORMULAS``);
    the per-job vjp of ``hybrid.py`` for any other layer, for a parameter read outside its own layer,
    and for a layer that runs more than once in a pass. Only a layer that couples the images of a
    batch (BatchNorm with batch statistics) makes the model unsupported: ``UnsupportedModelError``,
    and the engine runs it one job at a time by autograd (``autograd_terms``). ``paths`` says which
    path each layer took in the last ``compute``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        found = LayerMap.of(model)
        self.names, self.index, self.loose = found.names, found.index, found.loose
        self.layers, self.layer_names = found.layers, found.layer_names
        self.recorder = PassRecorder(model, found)
        # Each layer's batched formula, None for the per-job vjp. Only ``_settle_routes`` changes it,
        # once per pass before any term is computed, and only from a formula to the vjp.
        self.routes: list[LayerFormula | None] = [batched_formula(m) for m, _ in self.layers]
        # The formula is known to match the layer's forward (its class's own; else checked on a pass).
        self.checked = [r is None or r.plain_forward(m) for r, (m, _) in zip(self.routes, self.layers)]
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
        """Exact factors of every weight target whose formula allows them and whose rank makes them cheaper."""
        out: dict[int, tuple[Tensor, Tensor]] = {}
        for (module, _), route in zip(self.layers, self.routes):
            if route is None or not route.factorable(module):
                continue
            i = self.index[id(module.weight)]
            t = targets[i].reshape(targets[i].shape[0], targets[i].shape[1], -1)
            found = factor_targets(t, useful_rank(t.shape[1], t.shape[2]))
            if found is not None:
                out[i] = found
        return out

    def factored_layers(self) -> dict[str, int]:
        """Parameter name -> rank of its factored target, for the layers that have factors."""
        return {self.names[i]: f[0].shape[2] for i, f in self.factors.items()}

    def _settle_routes(self, calls: list[list[Call]], read: set[int]) -> None:
        """The explicit step between a pass's recording and its terms: a layer leaves its formula for
        the vjp, for good, where this pass shows the formula cannot take it (it ran other than once,
        or on more than one input, or its parameters were also read outside it), or where the first
        pass it runs in shows its own forward differs from what the formula assumes."""
        for i, (module, params) in enumerate(self.layers):
            route = self.routes[i]
            if route is None:
                continue
            if len(calls[i]) != 1 or read & set(params.values()) or len(calls[i][0].flat) != 1:
                self.routes[i] = None
            elif not self.checked[i]:
                self.checked[i] = True
                if not _forward_matches(route, module, calls[i][0]):
                    self.routes[i] = None

    def compute(self, x: Tensor, labels: Tensor, num_jobs: int) -> MatchTerms:
        logits, calls, ops = self.recorder.run(x)
        read = {i for op in ops for i in op.indices if isinstance(i, int)}
        self._settle_routes(calls, read)
        # Each job's loss is the mean cross-entropy over its own images, as the client computed it.
        loss = F.cross_entropy(logits, labels, reduction="none").view(num_jobs, -1).mean(1).sum()
        flat_calls = [c for cs in calls for c in cs] + [op for op in ops if not op.derived]
        outs = [c.out for c in flat_calls]
        grads = torch.autograd.grad(loss, outs, create_graph=True, allow_unused=True) if outs else ()
        deltas = {id(c): torch.zeros_like(c.out) if g is None else g for c, g in zip(flat_calls, grads)}
        V = num_jobs
        jobs = JobTargets(V, self.targets, self.index, self.factors if self.factored else {})
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
            route = self.routes[i]
            if route is not None:
                (inp,) = layer_calls[0].flat
                terms = route.terms(jobs, module, inp, deltas[id(layer_calls[0])])
                for k, (dot, norm2) in terms.items():
                    dots[k], norms[k] = dot, norm2
                paths[name] = FACTORED if any(k in jobs.used for k in terms) else BATCHED
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
                    dots[i], norms[i] = dense_terms(g, self.targets[i])
        self.paths = paths
        self.used_factors = {self.names[i] for i in jobs.used}
        assert self.target_norm2 is not None, "set_targets first"
        return MatchTerms(torch.stack(dots), torch.stack(norms), self.target_norm2, self.names)  # type: ignore[arg-type]


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
