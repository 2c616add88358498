"""Closed-form attacks in a run: which solver applies to which job (and why not), and their results.

A solve bypasses the optimization: it returns the same ``JobResult`` as the engine's attacks, with
0 iterations, status ``solved`` (exact: full rank, relative residual <= ``EXACT_RTOL``) or
``solved_inexact`` (rank-deficient, or a defense left a residual), and its rank and residual in
``extras`` (metrics.json).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedsim.data import box_bounds, get_spec

from ..jobs import JobResult, VictimJob, as_one_gradient, model_from_job
from .solvers import SOLVERS, NotApplicable, Solution, box_leaves_open, label_order, relabel

SOLVED, SOLVED_INEXACT = "solved", "solved_inexact"


def _spec_key(job: VictimJob) -> str:
    return json.dumps(job.spec.to_dict(), sort_keys=True, default=str)


def _fingerprint(job: VictimJob) -> str:
    """What a solve depends on besides the spec: the shared gradient or update (which the global weights
    shaped), the labels and the round."""
    digest = hashlib.sha256(job.job_id.encode())
    for t in (*job.gradient, job.labels):
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    digest.update(repr((job.plan, job.copies, job.members, job.match_support)).encode())
    return digest.hexdigest()


_RECENT: dict[tuple[str, str, str], tuple[Solution, float]] = {}
_RECENT_SIZE = 8


@dataclass(frozen=True)
class Guess:
    """A closed form's answer as an optimization's start: the images (the job's order) and, per image,
    whether its own check pinned it down exactly (a partial separation leaves others unresolved)."""

    images: Tensor
    held: Tensor  # (B,) bool


def _scale_free_reason(name: str, job: VictimJob) -> str | None:
    """Why a solver of one image's scale-free round (adam_eps) cannot take ``job``; None where it can."""
    plan = job.plan
    if plan is None:
        return (
            f"{name} reads an Adam round's update; job {job.job_id} holds a one-step gradient (first_linear solves it)"
        )
    optimizer = plan.optimizer.algorithm
    if not optimizer.scale_free_steps:
        return f"{name} reads an Adam round's update; job {job.job_id} holds an update of {optimizer.title}"
    if plan.dp is not None or plan.proximal_mu or job.copies > 1:
        why = (
            "DP-SGD's noise breaks"
            if plan.dp is not None
            else "FedProx's term breaks"
            if plan.proximal_mu
            else "an unknown batch order's copies break"
        )
        return f"{name} needs every step's gradient to be the image's times its own scale; in job {job.job_id} {why} it"
    open_ = box_leaves_open(job)
    if open_ is not None:
        return f"{name} cannot take job {job.job_id}: {open_}"
    if job.batch_size != 1:
        return (
            f"{name} takes one image per update, and job {job.job_id} has B = {job.batch_size}: "
            f"{SOLVERS[name].batch_reason}"
        )
    return None


def relabels(job: VictimJob) -> bool:
    """Whether the slots of an optimization of ``job`` can trade labels: only where every step used every
    image (a one-step gradient, or each step on the whole batch), so that two slots differ in nothing but
    their labels; one epoch copy each (an unknown order's copies share an image)."""
    everyone = list(range(job.batch_size))
    return job.copies == 1 and not job.members and all(sorted(step) == everyone for step in job.steps)


def scores_average_masks(job: VictimJob) -> bool:
    """Whether ``solvers.label_scores`` (dropout off) can be trusted for ``job`` as they are: a round's steps
    each draw a new mask per image, and their sum averages them out, while one step's single mask moves the
    scores. Measured with the true images: a one-step B = 64 gradient under p = 0.25 scores 44 of 64 at their
    labels (64 of 64 with the client's true masks), B = 32 and B = 64 SGD rounds of K = 4 steps 32 of 32 and
    63 of 64."""
    return len(job.steps) > 1


@dataclass
class ClosedForms:
    """Finds each solver's structure once per model (the jobs of a run share few models), says why a
    solver does not apply to a job, and solves the jobs it applies to."""

    _models: dict[str, nn.Module] = field(default_factory=dict)
    _found: dict[tuple[str, str], Any] = field(default_factory=dict)
    _solved: dict[tuple[str, str, str], tuple[Solution, float]] = field(default_factory=dict)

    def model(self, job: VictimJob) -> nn.Module:
        key = _spec_key(job)
        if key not in self._models:
            self._models[key] = model_from_job(job)
        return self._models[key]

    def _structure(self, name: str, job: VictimJob) -> Any:
        key = (name, _spec_key(job))
        if key not in self._found:
            spec = job.spec
            try:
                self._found[key] = SOLVERS[name].find(self.model(job), tuple(spec.input_shape), spec.num_classes)
            except NotApplicable as err:
                self._found[key] = err
        return self._found[key]

    def reason(self, name: str, job: VictimJob) -> str | None:
        """Why solver ``name`` cannot solve ``job``, in one line; None where it applies."""
        solver = SOLVERS[name]
        if solver.scale_free_updates:
            why = _scale_free_reason(name, job)
            if why is not None:
                return why
        elif job.plan is not None:
            optimizer = job.plan.optimizer.algorithm
            if not solver.updates:
                return (
                    f"{name} solves a one-step gradient; job {job.job_id} holds an update of {len(job.steps)} local "
                    "steps, whose gradients (each with its own masks) are mixed in one update"
                )
            if not optimizer.lowrank_replay or job.plan.dp is not None or job.copies > 1:
                why = (
                    "DP-SGD's noise"
                    if job.plan.dp is not None
                    else "an unknown batch order's copies"
                    if job.copies > 1
                    else f"{optimizer.title}'s elementwise steps"
                )
                return (
                    f"{name} needs the first Linear's update to span the client's images; in job {job.job_id} "
                    f"{why} take it out of that span"
                )
        if solver.scale_free_updates:
            pass  # its batch size was checked with the round
        elif solver.separates and job.batch_size == 1 and not (solver.single_updates and job.plan is not None):
            return f"{name} separates the images of a batch, and job {job.job_id} has B = 1: {solver.batch_reason}"
        if job.batch_size > 1 and not solver.separates:
            return (
                f"{name} takes one image per gradient, and job {job.job_id} has B = {job.batch_size}: "
                f"{solver.batch_reason}"
            )
        found = self._structure(name, job)
        if isinstance(found, NotApplicable):
            return f"{name} needs {solver.needs}; {job.spec.name} has none ({found})"
        return None

    def _applicable(self, job: VictimJob) -> list[str]:
        return [name for name in SOLVERS if self.reason(name, job) is None]

    def _start(self, job: VictimJob) -> str | None:
        """The solver an optimization starts from: the first that applies and solves ``job`` exactly; else, of
        those that apply, the one whose own checks pinned the most images down (the first at a tie). Two can
        take one job and pin down different shares (a one-step B = 64 gradient under p = 0.25: cocktail_party's
        plane search finds no plane, dark_background's background pins most digits), so the later ones are
        solved only where the first left images open."""
        best, most = None, -1
        for name in self._applicable(job):
            solution = self._solve(name, job)[0]
            if solution.exact:
                return name
            pinned = sum(solution.certain or ())
            if pinned > most:
                best, most = name, pinned
        return best

    def first_guess(self, job: VictimJob) -> Guess | None:
        """The images of the solver ``_start`` picks for ``job`` (its answer, exact or partial: a
        rank-deficient system's minimum-norm solution), for an optimization to start from, and which of them
        their own check pinned down exactly; None where none applies."""
        start = self._start(job)
        if start is None:
            return None
        for name in [start] + [n for n in self._applicable(job) if n != start]:
            solution, _ = self._solve(name, job)
            images = self._clamped(solution, job)
            certain = solution.certain or (solution.exact,) * images.shape[0]
            held = torch.tensor(certain, dtype=torch.bool)
            if SOLVERS[name].ordered:
                return Guess(images, held)
            # a separating solver's images come in an order of their own: put them in the labels'; an update's
            # last Linear: its round's gradients summed (as_one_gradient), which the labels still fix
            order = label_order(images, as_one_gradient(job) if job.plan else job, self.model(job))
            if order is not None:
                return Guess(images[order], held[order])
        return None

    def snap(self, job: VictimJob, images: Tensor, held: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
        """An optimization's images of ``job`` (its order) with those a solver can tell exactly replaced by the
        exact images, and which they are, of those not ``held`` (B,) already (default: none held)
        (``Solver.snap``): by the solver the optimization started from
        (``_start``) where it can snap, else, where that start left images open, by the first other that applies,
        can snap and pinned at least one image itself. None where none can, or its answer pinned no image down
        (data without what it reads, e.g. CIFAR-10's photos for dark_background: each snap would spend B
        programs for nothing)."""
        start = self._start(job)
        if start is None:
            return None
        names = [start]
        if not self._solve(start, job)[0].exact:  # an exact start holds every image: the others are not solved
            names += [n for n in self._applicable(job) if n != start]
        for name in names:
            solver = SOLVERS[name]
            if solver.snap is not None and any(self._solve(name, job)[0].certain or ()):
                if held is None:
                    held = torch.zeros(images.shape[0], dtype=torch.bool)
                return solver.snap(self._structure(name, job), job, self.model(job), images, held)
        return None

    def relabel(self, job: VictimJob, images: Tensor, held: Tensor, labels: Tensor) -> Tensor | None:
        """New labels for the slots of an optimization of ``job`` whose dummies are ``images`` and carry
        ``labels`` (B,), so that each ``held`` image sits at a label it scores (``solvers.relabel``); None where
        the slots cannot trade labels (``relabels``) or the model does not end in a Linear."""
        if not held.any() or not relabels(job):
            return None
        return relabel(images, held, labels, as_one_gradient(job) if job.plan else job, self.model(job))

    def _solve(self, name: str, job: VictimJob) -> tuple[Solution, float]:
        # A run solves a job for the closed-form attack and again for an optimization that starts from the
        # answer (dia_cf, dia_hold), each with its own ClosedForms: the solves are deterministic, so the last
        # few are kept by what the server shared (a large batch's separation takes minutes).
        # An instance keeps all its own solves besides: a run's snaps ask for every job's again and again.
        key = (name, _spec_key(job), _fingerprint(job))
        if key in self._solved:
            return self._solved[key]
        if key in _RECENT:
            self._solved[key] = _RECENT[key]
            return self._solved[key]
        started = time.perf_counter()
        solution: Solution = SOLVERS[name].solve(self._structure(name, job), job, self.model(job))
        self._solved[key] = _RECENT[key] = (solution, time.perf_counter() - started)
        while len(_RECENT) > _RECENT_SIZE:
            _RECENT.pop(next(iter(_RECENT)))
        return self._solved[key]

    @staticmethod
    def _clamped(solution: Solution, job: VictimJob) -> Tensor:
        low, high = box_bounds(get_spec(job.spec.dataset, job.spec.input_shape[0]))
        return solution.images.clamp(low, high)  # valid pixels, as every other attack's iterate

    def solve(self, name: str, job: VictimJob) -> JobResult:
        solution, seconds = self._solve(name, job)
        images = self._clamped(solution, job)
        return JobResult(
            job.job_id,
            name,
            images,
            None,
            best_loss=solution.residual,
            best_iteration=0,
            iterations=0,
            status=SOLVED if solution.exact else SOLVED_INEXACT,
            optimized_values=0,
            extras={**solution.metrics(), **solution.extra, "solve_seconds": seconds},
        )
