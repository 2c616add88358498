"""Closed-form attacks in a run: which solver applies to which job (and why not), and their results.

A solve bypasses the optimization: it returns the same ``JobResult`` as the engine's attacks, with
0 iterations, status ``solved`` (exact: full rank, relative residual <= ``EXACT_RTOL``) or
``solved_inexact`` (rank-deficient, or a defense left a residual), and its rank and residual in
``extras`` (metrics.json).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from fedsim.data import box_bounds, get_spec

from ..jobs import JobResult, VictimJob, as_one_gradient, model_from_job
from .solvers import SOLVERS, NotApplicable, Solution, label_order

SOLVED, SOLVED_INEXACT = "solved", "solved_inexact"


def _spec_key(job: VictimJob) -> str:
    return json.dumps(job.spec.to_dict(), sort_keys=True, default=str)


@dataclass
class ClosedForms:
    """Finds each solver's structure once per model (the jobs of a run share few models), says why a
    solver does not apply to a job, and solves the jobs it applies to."""

    _models: dict[str, nn.Module] = field(default_factory=dict)
    _found: dict[tuple[str, str], Any] = field(default_factory=dict)

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
        if job.plan is not None:
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
        if solver.separates and job.batch_size == 1 and not (solver.single_updates and job.plan is not None):
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

    def first_guess(self, job: VictimJob) -> Tensor | None:
        """The images of the first solver that applies to ``job`` (its answer, exact or partial: a
        rank-deficient system's minimum-norm solution), for an optimization to start from; None where
        none applies."""
        for name, solver in SOLVERS.items():
            if self.reason(name, job) is None:
                images = self.solve(name, job).images
                if solver.ordered:
                    return images
                # a separating solver's images come in an order of their own: put them in the labels'
                # an update's last Linear: its round's gradients summed (as_one_gradient), which the labels still fix
                order = label_order(images, as_one_gradient(job) if job.plan else job, self.model(job))
                if order is not None:
                    return images[order]
        return None

    def solve(self, name: str, job: VictimJob) -> JobResult:
        started = time.perf_counter()
        solution: Solution = SOLVERS[name].solve(self._structure(name, job), job, self.model(job))
        seconds = time.perf_counter() - started
        low, high = box_bounds(get_spec(job.spec.dataset, job.spec.input_shape[0]))
        images = solution.images.clamp(low, high)  # valid pixels, as every other attack's iterate
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
