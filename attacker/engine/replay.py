"""Matching terms for an update: replay the client's local round differentiably, job by job.

A FedAvg client shares Δ = θ_global − θ_local after K local steps. The attacker runs the same round
(``fedsim.client_step.run_local_round``, the very code the client ran) on its dummy images with
per-step masks, keeping the graph through every step and through the optimizer's update rule, and
compares the resulting Δ with the captured one. The terms come out in the same form as the one-step
gradient terms (``MatchTerms``), so the distances and loss terms of ``objectives`` apply unchanged.

An all-Linear model under SGD (or momentum) replays all jobs at once (``replay_lowrank``): each job's
weights are the shared start plus a low-rank correction. Everything else runs job after job here:
a Conv layer's update is not low-rank, and Adam's elementwise step needs each job's own weights.

Adam captures are replayed with a smoothed update: the replay's ε follows a geometric schedule from a
larger value down to an end value (``annealed_eps``; the attack's ``replay_eps_*`` settings), since at
the client's ε the first step is ≈ lr·sign(g) and gives the dummies and masks almost no usable
gradient. The client's own step is never changed; with the end value None the schedule ends on it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from fedsim.client_step import LocalPlan, plan_batches, run_local_round

from ..attacks import AttackConfig
from .gradients import MatchTerms
from .replay_lowrank import batched_replay_applies, lowrank_replay_terms

# Bytes per float32 value kept for the backward pass of one replayed step, per parameter and per
# activation value: the double backward keeps the forward activations, their gradients, the weight
# gradients and the optimizer's state (measured roughly on the MLP; a planning figure, not a bound).
PARAM_FACTOR, ACTIVATION_FACTOR = 6 * 4, 6 * 4


def annealed_eps(client_eps: float, attack: AttackConfig, iteration: int) -> float:
    """The Adam ε the replay uses at ``iteration``: geometric from ``replay_eps_start`` to
    ``replay_eps_end`` (None: ``client_eps``, exactly, so the replay is then the client's own round)
    over the first ``replay_eps_anneal`` of ``max_iterations``, then the end value."""
    start, span = attack.replay_eps_start, attack.replay_eps_anneal * attack.max_iterations
    end = client_eps if attack.replay_eps_end is None else attack.replay_eps_end
    if start is None or end <= 0:  # off; a zero client ε has no geometric path
        return client_eps
    if iteration >= span:
        return end
    return start * (end / start) ** (iteration / span)


def smoothing_end(attack: AttackConfig) -> int | None:
    """The first iteration whose replay ε is the schedule's end value (None: no smoothing, or the
    schedule runs to the end of the budget)."""
    if attack.replay_eps_start is None:
        return None
    end = math.ceil(attack.replay_eps_anneal * attack.max_iterations)
    return end if end < attack.max_iterations else None


def replayed_update(
    model: nn.Module,
    start: dict[str, Tensor],
    plan: LocalPlan,
    images: Tensor,
    labels: Tensor,
    members: tuple[tuple[int, float], ...] = (),
) -> dict[str, Tensor]:
    """The update of ``plan`` (its masks: per step) replayed on ``images`` from ``start``; with
    ``members`` (a SecAgg+ mean of several clients' rounds: each one's image count and weight, images
    and steps client-major), each client's round from the same start on its own images, the updates
    averaged by weight as the secure aggregation averaged them."""
    if not members:
        return run_local_round(model, TensorDataset(images, labels), plan, start=start).update
    total = sum(weight for _, weight in members)
    mean: dict[str, Tensor] = {}
    offset = step = 0
    for count, weight in members:
        steps = len(plan_batches(plan, count))
        member = replace(plan, masks=plan.masks[step : step + steps] if plan.masks is not None else None)
        data = TensorDataset(images[offset : offset + count], labels[offset : offset + count])
        update = run_local_round(model, data, member, start=start).update
        for key, value in update.items():
            mean[key] = mean[key] + value * (weight / total) if key in mean else value * (weight / total)
        offset, step = offset + count, step + steps
    return mean


def replay_terms(
    model: nn.Module,
    start: dict[str, Tensor],
    plan: LocalPlan,
    images: list[Tensor],
    labels: list[Tensor],
    masks: list[list[list[Tensor]]],
    targets: list[list[Tensor]],
    supports: list[list[Tensor] | None] | None = None,
    eps: list[float] | None = None,
    members: tuple[tuple[int, float], ...] = (),
) -> MatchTerms:
    """For each job j: replay ``plan`` on ``images[j]`` with ``masks[j]`` (per step, per dropout
    layer) from the weights ``start``, and return <Δ_j, Δ*_j>, ||Δ_j||², ||Δ*_j||² per parameter.
    ``supports[j]`` (a pruned capture) cuts the replayed Δ_j to the entries the client kept;
    ``eps[j]`` (an Adam plan) is the ε job j's replay uses in place of the client's. ``members``: the
    jobs are SecAgg+ means of several clients' rounds (``replayed_update``), replayed job by job."""
    # An all-Linear model under SGD replays all jobs at once in low-rank form (replay_lowrank). The loop
    # stays for the rest: a Conv layer's update is not low-rank, and Adam's elementwise step needs each
    # job's own weights (~88% of its time scales with them, measured: batching could gain ~1.1x at most).
    if not members and batched_replay_applies(model, plan, images, masks):
        return lowrank_replay_terms(model, start, plan, images, labels, masks, targets, supports)
    names = [n for n, _ in model.named_parameters()]
    dots, norms, target_norms = [], [], []
    for j, (x, y, job_masks, target) in enumerate(zip(images, labels, masks, targets)):
        job_plan = replace(
            plan, dropout="learn", masks=job_masks, differentiable=True, keep_gradients=False, record_masks=False
        )
        if eps is not None and plan.optimizer.algorithm.smoothed_eps_replay:
            job_plan = replace(job_plan, optimizer=replace(plan.optimizer, eps=eps[j]))
        update = replayed_update(model, start, job_plan, x, y, members)
        delta = [update[n] for n in names]
        support = supports[j] if supports is not None else None
        if support is not None:
            delta = [d * s for d, s in zip(delta, support)]
        dots.append(torch.stack([(d * t).sum() for d, t in zip(delta, target)]))
        norms.append(torch.stack([(d * d).sum() for d in delta]))
        target_norms.append(torch.stack([(t * t).sum() for t in target]))
    return MatchTerms(torch.stack(dots, 1), torch.stack(norms, 1), torch.stack(target_norms, 1), names)


def activations_per_image(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Values the model's modules output for one image (a forward pass with hooks)."""
    total = 0

    def hook(_module, _inputs, output) -> None:
        nonlocal total
        if isinstance(output, Tensor):
            total += output.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    finally:
        for h in handles:
            h.remove()
    return total


def unroll_bytes(model: nn.Module, input_shape: tuple[int, ...], steps: list[list[int]], jobs: int = 1) -> int:
    """A planning estimate of the memory one replay keeps for the backward pass of ``jobs`` jobs."""
    params = sum(p.numel() for p in model.parameters())
    acts = activations_per_image(model, input_shape)
    per_job = sum(PARAM_FACTOR * params + ACTIVATION_FACTOR * acts * len(batch) for batch in steps)
    return per_job * jobs
