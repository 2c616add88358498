"""Adam and the plateau rule for many victim jobs at once, on stacked tensors: row j of a parameter
belongs to job j.

Every job has its own learning rate (its plateau rule lowers it) and its own step count (jobs stop at
different iterations), so torch.optim.Adam, which has one learning rate per parameter group and steps
whole tensors, cannot do it in one call; one optimizer per job can, but 128 of them stepped one by one
cost 62% of a V = 128 MLP iteration on CPU (measured: 44 of 71 ms, mostly per-call overhead). Written
out here once: torch.optim.Adam's single-tensor arithmetic (its default on CPU; amsgrad, weight decay
and maximize off, the settings the attacks use), with the step size and bias correction given per row.
tests/test_job_adam.py checks it against one torch.optim.Adam per job, element for element.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

BETAS = (0.9, 0.999)
EPS = 1e-8


def _rows_view(vector: Tensor, like: Tensor) -> Tensor:
    """A per-row vector shaped to broadcast over the rows of ``like``."""
    return vector.view(-1, *([1] * (like.dim() - 1)))


def adam_factors(lr: list[float], steps: list[int], moving: list[bool]) -> tuple[Tensor, Tensor]:
    """Per row: Adam's signed step size -lr / (1 - beta1^t) (0 for rows that do not move) and
    sqrt(1 - beta2^t) (1 for those), computed in double precision like torch's."""
    beta1, beta2 = BETAS
    size = [-r / (1 - beta1**t) if m else 0.0 for r, t, m in zip(lr, steps, moving)]
    corr = [math.sqrt(1 - beta2**t) if m else 1.0 for t, m in zip(steps, moving)]
    return torch.tensor(size, dtype=torch.float32), torch.tensor(corr, dtype=torch.float32)


@torch.no_grad()
def adam_rows_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step_size: Tensor,
    bc2_sqrt: Tensor,
    moving: Tensor,
) -> None:
    """One Adam step of the rows of ``param`` where ``moving``; the others keep their values (their
    gradient is taken as zero, their step size must be 0). In place on param and the moments."""
    beta1, beta2 = BETAS
    if not bool(moving.all()):  # all rows move in most iterations: then no pass to zero any
        grad = torch.where(_rows_view(moving, grad), grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = exp_avg_sq.sqrt().div_(_rows_view(bc2_sqrt, exp_avg_sq)).add_(EPS)
    # torch's addcdiv computes param + (value * exp_avg) / denom: the same order, with value per row
    param.addcdiv_(_rows_view(step_size, exp_avg) * exp_avg, denom)


def plateau_step(
    lr: float, best: float, bad: int, loss: float, patience: int, factor: float
) -> tuple[float, float, int]:
    """One ``torch.optim.lr_scheduler.ReduceLROnPlateau.step(loss)`` of one job with torch's defaults
    (mode min, relative threshold 1e-4, no cooldown, min_lr 0, eps 1e-8): the new (lr, best, bad)."""
    if loss < best * (1.0 - 1e-4):
        best, bad = loss, 0
    else:
        bad += 1
    if bad > patience:
        lowered = max(lr * factor, 0.0)
        if lr - lowered > 1e-8:
            lr = lowered
        bad = 0
    return lr, best, bad


# -- learning-rate schedules, by name (AttackConfig.schedule) -------------------------------------
# Each takes a job's (lr, plateau best, plateau count), this iteration's loss and index, and its
# attack's settings, and returns the new (lr, best, count).
MULTISTEP_MILESTONES = (3 / 8, 5 / 8, 7 / 8)  # of the iteration cap (Geiping et al.'s inverting gradients)


def _plateau(lr: float, best: float, bad: int, loss: float, iteration: int, attack: Any) -> tuple[float, float, int]:
    """ReduceLROnPlateau on the job's loss (the paper's schedule)."""
    return plateau_step(lr, best, bad, loss, attack.plateau_patience, attack.plateau_factor)


def _multistep(lr: float, best: float, bad: int, loss: float, iteration: int, attack: Any) -> tuple[float, float, int]:
    """MultiStepLR: the base lr times plateau_factor at 3/8, 5/8 and 7/8 of the iteration cap, whatever the loss."""
    passed = sum(iteration + 1 >= round(attack.max_iterations * f) for f in MULTISTEP_MILESTONES)
    return attack.lr * attack.plateau_factor**passed, best, bad


SCHEDULES: dict[str, Callable[[float, float, int, float, int, Any], tuple[float, float, int]]] = {
    "plateau": _plateau,
    "multistep": _multistep,
}
