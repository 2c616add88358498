"""Victim jobs (what the server has) and oracles (ground truth), kept apart in the types.

A ``VictimJob`` holds only what an honest-but-curious server sees: the model spec and weights,
what the client shared (the gradient of one local step, or the update of a whole local round with
the round's plan: schedule and optimizer, as the server sent them), the labels (assumed known, or
recovered), p and B. The client's real images and dropout masks live in an ``Oracle``, which the
engine hands only to WIIG (replayed masks) and to scoring, never to IG or DIA.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from fedsim.client_step import LocalPlan, one_step_plan, plan_batches, run_local_round
from fedsim.models import ModelSpec, build_model


@dataclass
class VictimJob:
    job_id: str
    spec: ModelSpec
    weights: dict[str, Tensor]  # the global weights the server sent (shared between jobs, not copied)
    gradient: list[
        Tensor
    ]  # what the client shared, in model.parameters() order: its gradient, or with a plan its update
    labels: Tensor  # (B,): for an update, the labels of the client's N images in order
    label_source: str = "known"  # "known" or "recovered"
    meta: dict = field(default_factory=dict)
    plan: LocalPlan | None = None  # an update job: the client's local round (the attacker replays it)
    # The adaptive attack on pruning: match only the entries the client kept, i.e. where ``gradient``
    # is nonzero (``support_mask``). Set from the capture's defense (attacker.captures), nowhere else.
    match_support: bool = False
    # An update job: the labels of the images in the order the client's steps used them (flattened),
    # as a client with known labels discloses them; what an unknown batch order needs (``unknown_order``).
    step_labels: Tensor | None = None
    copies: int = 1  # > 1: an unknown-order job whose B images are this many epoch copies of N images
    # An update job of a SecAgg+ mean of several clients' updates: each client's (images, weight), its
    # images consecutive in the job's; the replay runs each client's round from the shared start on its
    # own images and averages the updates by weight (attacker.engine.replay). Empty: one client's update.
    members: tuple[tuple[int, float], ...] = ()

    @property
    def kind(self) -> str:
        return "gradient" if self.plan is None else "update"

    @property
    def steps(self) -> list[list[int]]:
        """Which of the job's images each local step used (one step on all of them for a gradient); for
        an aggregate of several clients' rounds, each client's steps in turn (client-major)."""
        if self.plan is None:
            return [list(range(self.batch_size))]
        if self.members:
            steps, offset = [], 0
            for count, _ in self.members:
                steps += [[offset + i for i in batch] for batch in plan_batches(self.plan, count)]
                offset += count
            return steps
        return plan_batches(self.plan, self.batch_size)

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    @property
    def p(self) -> float:
        return self.spec.p


@dataclass(frozen=True)
class Oracle:
    """Ground truth of one job: the client's images and the dropout masks of its steps (step-major,
    one per dropout call in call order within a step)."""

    images: Tensor
    masks: tuple[Tensor, ...]


def support_mask(job: VictimJob) -> list[Tensor] | None:
    """Per parameter, where the shared gradient/update is nonzero, when the job matches only those
    entries (pruning); else None. The dummy's gradient is to be multiplied by it in the matching
    terms; the target is zero outside it, so only the dummy's norm changes."""
    return [g != 0 for g in job.gradient] if job.match_support else None


def exact_as_gradient(job: VictimJob) -> bool:
    """An update that IS one gradient: one plain SGD step on all of the job's images (Δ/lr = g). Under a
    defense it is the defended gradient (clipped, noised or pruned as the update was), attacked as such."""
    plan = job.plan
    return (
        plan is not None
        and len(job.steps) == 1
        and plan.optimizer.algorithm.step_is_gradient
        and not plan.optimizer.momentum
    )


def as_one_gradient(job: VictimJob) -> VictimJob:
    """An update job as the one-step gradient Δ/(lr·K) on all N images: exactly the client's gradient
    for one plain SGD step (``exact_as_gradient``), and the field's cheap baseline otherwise."""
    assert job.plan is not None
    # K: the local steps of one client (an aggregate's steps are its clients' in turn: their mean count)
    scale = job.plan.optimizer.lr * len(job.steps) / max(1, len(job.members))
    gradient = [(d.double() / scale).float() for d in job.gradient]
    return replace(job, gradient=gradient, plan=None, meta=dict(job.meta, as_gradient=True))


class BatchOrderError(ValueError):
    """An update job that the unknown-order replay cannot take."""


def unknown_order(job: VictimJob) -> VictimJob:
    """An update job for an attacker that does not know the batch order: the attacker optimizes one
    copy of the N images per epoch (B = E·N dummies), epoch e's steps running in order on copy e
    (indices e·N + i), and copy e's position i carries the label of the image the client used there
    (the per-step labels: assumed known, as the labels are). The copies are tied by the order-invariant
    prior (``objectives``, lambda_order); the reported reconstruction merges them (``merge_copies``)."""
    plan, n = job.plan, job.batch_size
    if plan is None or job.copies > 1:
        return job
    if job.members:
        raise BatchOrderError(
            f"job {job.job_id}: an unknown batch order is not built for a SecAgg+ mean of several clients' rounds"
        )
    if job.step_labels is None:
        raise BatchOrderError(
            f"job {job.job_id}: an unknown batch order needs the labels of every step's "
            "images, and this victim lacks per-step labels"
        )
    in_order = replace(plan, schedule=replace(plan.schedule, order="in-order"))
    sizes = [len(b) for b in plan_batches(in_order, n)]
    total = sum(sizes)
    if total % n or int(job.step_labels.numel()) != total:
        raise BatchOrderError(
            f"job {job.job_id}: an unknown batch order needs whole epochs and one label per "
            f"image of every step ({total} images in the steps, N = {n}, "
            f"{int(job.step_labels.numel())} step labels)"
        )
    batches, start = [], 0
    for size in sizes:
        batches.append(tuple(range(start, start + size)))
        start += size
    return replace(
        job,
        labels=job.step_labels.long().clone(),
        plan=replace(in_order, batches=tuple(batches)),
        copies=total // n,
        meta=dict(job.meta, replay_order="unknown"),
    )


def merge_copies(images: Tensor, copies: int) -> Tensor:
    """One set of N images from ``copies`` epoch copies (rows copy-major): each copy is matched to copy
    1 image by image (Hungarian assignment on squared distance), then the matched images are averaged."""
    if copies <= 1:
        return images
    sets = images.reshape(copies, -1, *images.shape[1:])
    first = sets[0].flatten(1)
    merged = [sets[0]]
    for other in sets[1:]:
        cost = torch.cdist(first.double(), other.flatten(1).double()) ** 2
        _, cols = linear_sum_assignment(cost.numpy())
        merged.append(other[torch.as_tensor(cols)])
    return torch.stack(merged).mean(0)


def model_from_job(job: VictimJob) -> nn.Module:
    model = build_model(job.spec)
    model.load_state_dict(job.weights)
    return model


def jobs_from_images(
    spec: ModelSpec,
    batches: list[tuple[Tensor, Tensor]],
    *,
    seed: int = 0,
    prefix: str = "victim",
    plan: LocalPlan | None = None,
) -> tuple[list[VictimJob], list[Oracle]]:
    """Build victim jobs the offline way: every batch is one client's data at the model's (seeded)
    initial weights, as in the paper ("all models are initialized randomly"). Without ``plan`` the
    client takes one step on it and shares its gradient (the paper); with ``plan`` it runs that local
    round on it and shares its update. The dropout masks are drawn from a generator seeded per
    batch, so a job is reproducible on its own."""
    model = build_model(spec)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    jobs, oracles = [], []
    names = [n for n, _ in model.named_parameters()]
    for i, (images, labels) in enumerate(batches):
        # The client's round, as in the federation (fedsim's client step).
        data, job_seed = TensorDataset(images, labels), seed * 100_003 + i
        if plan is None:  # one plain SGD step on the batch
            (step,) = run_local_round(
                model, data, one_step_plan(1.0, seed=job_seed, float64=False, keep_gradients=True)
            ).steps
            shared, masks, job_plan, step_labels = step.gradient, tuple(step.masks), None, None
        else:
            job_plan = replace(plan, seed=job_seed, record_masks=True)
            result = run_local_round(model, data, job_plan)
            shared = [result.update[n] for n in names]
            masks = tuple(m for step in result.steps for m in step.masks)
            step_labels = labels[torch.tensor([k for step in result.steps for k in step.indices])].long()
        jobs.append(
            VictimJob(
                f"{prefix}{i:03d}",
                spec,
                weights,
                shared,
                labels.clone(),
                "known",
                {"index": i},
                job_plan,
                step_labels=step_labels,
            )
        )
        oracles.append(Oracle(images.clone(), masks))
    return jobs, oracles


@dataclass
class JobResult:
    """One job's outcome: the engine's best iterate and how it got there (no ground truth here)."""

    job_id: str
    attack: str
    images: Tensor  # best-loss iterate, normalized space (an unknown batch order: its epoch copies merged, N images)
    masks: list[Tensor] | None  # learned masks at the best iterate (DIA only)
    best_loss: float
    best_iteration: int
    iterations: int
    status: str  # converged | no_improvement | max_iterations | diverged | running
    optimized_values: int
    losses: list[float] = field(default_factory=list)
    ssim_curve: list[tuple[int, float]] = field(default_factory=list)  # (iteration, SSIM): attacker.curves
    # a closed-form solve's rank and residual; what dia_hold's snaps did (metrics.json)
    extras: dict = field(default_factory=dict)
