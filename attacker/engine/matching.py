"""What the dummies are matched against, and the match terms each iteration.

A group's jobs share the model and its weights; each has its own target (the captured gradient or
update) and labels. The terms (per-parameter dot products and squared norms, ``gradients.MatchTerms``)
come from one of four paths, chosen once from the jobs:

* a gradient capture: ``PerJobGradients``, per layer the batched closed form or the per-job vjp
  (gradients.py, hybrid.py), for every model whose layers do not couple the images of a batch;
* a gradient capture otherwise (train-mode BatchNorm, one job per group): autograd on the job's batch;
* a pruned capture (``match_support``): job by job by autograd, each gradient cut to the kept entries;
* an update capture: the client's local round replayed differentiably (``replay``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedsim.models import set_masks

from ..attacks import AttackConfig
from ..jobs import VictimJob, support_mask
from .gradients import ONE_JOB, MatchTerms, PerJobGradients, UnsupportedModelError, autograd_terms
from .replay import annealed_eps, replay_terms


class Matcher(nn.Module):
    def __init__(self, jobs: list[VictimJob], model: nn.Module) -> None:
        super().__init__()
        first = jobs[0]
        self.model, self.V, self.B = model, len(jobs), first.batch_size
        self.plan, self.steps = first.plan, first.steps  # an update job: the client's local round
        self.members = first.members  # a SecAgg+ mean of several clients' rounds (one job each: their images)
        self.register_buffer("labels", torch.cat([j.labels for j in jobs]), persistent=False)
        for i, param_targets in enumerate(zip(*[j.gradient for j in jobs])):
            self.register_buffer(f"target_{i}", torch.stack(param_targets).float(), persistent=False)
        self.num_params = len(first.gradient)
        # Pruned captures: only the entries the client kept are matched, so the dummy gradient is cut to
        # them; that needs it materialized, job by job.
        self.supports = [support_mask(j) for j in jobs]
        self.masked = any(s is not None for s in self.supports)
        self.ghost: PerJobGradients | None = None
        try:
            if self.plan is None and not self.masked:
                self.ghost = PerJobGradients(model)
        except UnsupportedModelError:
            if self.V > 1:
                raise ValueError(
                    "this model (BatchNorm) couples the images of a batch: run its jobs one per module"
                ) from None
        self._targets_for: tuple[int, ...] | None = None
        self._ghost_ran = False

    def gradient_paths(self) -> dict[str, str]:
        """Which path each layer's per-job terms took (the last pass's): ``gradients.PerJobGradients.paths``
        for the per-layer hybrid; every layer one job at a time by autograd otherwise (a layer that couples
        the images of a batch, a pruned capture) or through the replay of the client's round (an update)."""
        if self.ghost is not None:
            return dict(self.ghost.paths)
        path = ONE_JOB if self.plan is None else "replay (autograd per job)"
        names: dict[str, str] = {}
        for mname, module in self.model.named_modules():
            own = [k for k, _ in module.named_parameters(recurse=False)]
            if own:
                names[mname or type(module).__name__] = path
        return names

    def targets(self, rows: list[int] | slice) -> list[Tensor]:
        return [getattr(self, f"target_{i}")[rows] for i in range(self.num_params)]

    def job_labels(self, j: int) -> Tensor:
        return self.labels.view(self.V, self.B)[j]

    def _support(self, j: int, device: torch.device) -> list[Tensor] | None:
        support = self.supports[j]
        if support is not None and support[0].device != device:  # moved once, with the module
            self.supports[j] = support = [s.to(device) for s in support]
        return support

    def _with_weight_grads(self, fn):
        for param in self.model.parameters():
            param.requires_grad_(True)
        try:
            return fn()
        finally:
            for param in self.model.parameters():
                param.requires_grad_(False)

    def terms(self, x: Tensor, active: list[int], layers: list[Tensor]) -> MatchTerms:
        """A gradient capture's terms for the active jobs' dummies ``x`` (masks already set on the model)."""
        if self.masked:
            return self._with_weight_grads(lambda: self._pruned_terms(x, active, layers))
        labels = self.labels.view(self.V, self.B)[active].reshape(-1)
        if self.ghost is None:
            return self._with_weight_grads(lambda: autograd_terms(self.model, x, labels, self.targets(active)))
        key = tuple(active)
        if self._targets_for != key:  # jobs stopped: compact the targets once, not every step
            index = torch.tensor(active, device=self.labels.device) if len(active) < self.V else None
            self.ghost.set_targets(self.targets(slice(None)), jobs=index)  # low-rank targets factored once
            self._targets_for = key
        if self._ghost_ran or self.V > 1:
            return self.ghost.compute(x, labels, len(active))
        try:  # a single job: where the batched pass fails on the model, plain autograd takes the job
            terms = self.ghost.compute(x, labels, len(active))
        except Exception:  # the runner's probe (PerJobGradients.check) sends such models here alone
            self.ghost = None
            return self._with_weight_grads(lambda: autograd_terms(self.model, x, labels, self.targets(active)))
        self._ghost_ran = True
        return terms

    def _pruned_terms(self, x: Tensor, active: list[int], layers: list[Tensor]) -> MatchTerms:
        parts = []
        for k, j in enumerate(active):
            rows = slice(k * self.B, (k + 1) * self.B)
            if layers:
                set_masks(self.model, [layer[rows] for layer in layers])
            parts.append(
                autograd_terms(
                    self.model, x[rows], self.job_labels(j), self.targets(slice(j, j + 1)), self._support(j, x.device)
                )
            )
        return MatchTerms(
            torch.cat([t.dot for t in parts], 1),
            torch.cat([t.norm2 for t in parts], 1),
            torch.cat([t.target_norm2 for t in parts], 1),
            parts[0].names,
        )

    def replay(
        self,
        active: list[int],
        dummies: list[Tensor],
        masks: dict[int, list[Tensor]],
        attacks: list[AttackConfig] | None = None,
        iteration: int = 0,
    ) -> MatchTerms:
        """An update capture's terms: each job's round replayed with its dummies and its masks (a list
        over local steps, then dropout layers). ``attacks`` (the active jobs', in order) and the
        attack's ``iteration`` set an Adam replay's smoothing; without them, the client's ε."""
        per_layer = len(next(iter(masks.values()))) // len(self.steps) if masks else 0
        per_step = [[masks[j][t * per_layer : (t + 1) * per_layer] for t in range(len(self.steps))] for j in active]
        targets = [[getattr(self, f"target_{i}")[j] for i in range(self.num_params)] for j in active]
        start = dict(self.model.named_parameters())
        return replay_terms(
            self.model,
            start,
            self.plan,
            [dummies[j] for j in active],
            [self.job_labels(j) for j in active],
            per_step,
            targets,
            [self._support(j, self.labels.device) for j in active],
            [annealed_eps(self.plan.optimizer.eps, a, iteration) for a in attacks] if attacks is not None else None,
            self.members,
        )
