"""The attack optimizers as one table: ``ATTACK_OPTIMIZERS[AttackConfig.optimizer]``.

An entry says what the rest of the engine must know of its optimizer (whether many jobs share one
optimization: ``batches_jobs``; whether the masks stay at their init: ``needs_fixed_masks``) and runs
ONE engine iteration of a module's active jobs (``step``), which the LightningModule's
``training_step`` calls. Adding an optimizer is one entry here; no other code names one.

* adam: each job's own Adam on its rows of the stacked unknowns (``job_adam``, ``Unknowns.step``),
  its own learning-rate schedule, many jobs in one batched optimization; its moments are buffers of
  ``Unknowns``, so a resumed run continues them.
* lbfgs: L-BFGS on the images of one job at a time, masks held at their init (``lbfgs.ImageLBFGS``);
  its curvature history lives beside the module (``stepper``) and a resumed run restarts it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
from torch import Tensor

from .lbfgs import ImageLBFGS


class Engine(Protocol):
    """What a step reads and moves of the engine's LightningModule (``inversion.InversionModule``,
    not imported here: it imports this table through ``attacker.attacks``)."""

    attacks: list[Any]  # the jobs' AttackConfigs
    unknowns: Any  # unknowns.Unknowns: the stacked dummies and masks
    state: Any  # state.JobState: each job's stopping and schedule state
    smoothing_ends: list[int | None]
    stepper: Any  # an optimizer's own state beside the unknowns (None until its first step)
    trainer: Any

    def active(self) -> list[int]: ...

    def job_losses(self, active: list[int]) -> tuple[Tensor, Tensor]: ...

    def manual_backward(self, loss: Tensor) -> None: ...

    def step_jobs(self, jobs: list[int], losses: list[float]) -> None: ...

    def log(self, name: str, value: float, **kwargs: Any) -> None: ...


class AttackOptimizer(ABC):
    name: str
    batches_jobs: bool  # many jobs in one module; False: each job runs in a module of its own
    needs_fixed_masks: bool  # the masks are not optimized: they stay at their init

    @abstractmethod
    def step(self, module: Engine, active: list[int]) -> None:
        """One engine iteration of the active jobs: the loss at the iterate it starts from, the best
        iterate and the stopping rules (``JobState``), the move, then ``state.iteration`` + 1."""


class JobAdam(AttackOptimizer):
    name, batches_jobs, needs_fixed_masks = "adam", True, False

    def step(self, module: Engine, active: list[int]) -> None:
        state = module.state
        ended = [j for j in active if module.smoothing_ends[j] == state.iteration]
        if ended:  # the best iterate and the plateau rule restart on the final objective
            state.restart_tracking(ended)
        module.unknowns.zero_grad_rows()
        losses, _ = module.job_losses(active)
        module.manual_backward(losses.sum())
        values = losses.detach().cpu().tolist()
        improved, stepping = state.observe(active, values, module.attacks)
        if improved:
            module.unknowns.keep_best(improved)
        if stepping:
            module.step_jobs([j for j, _ in stepping], [v for _, v in stepping])
        state.iteration += 1
        running = module.active()
        module.log("active_jobs", float(len(running)), prog_bar=True, on_step=True, batch_size=1)
        module.log("loss_mean", float(sum(values) / len(values)), prog_bar=True, on_step=True, batch_size=1)
        if not running:
            module.trainer.should_stop = True


class LBFGS(AttackOptimizer):
    """L-BFGS cannot step many jobs' rows independently (one curvature history, one line search over
    one objective): one job per module, and its masks are not optimized (engine/lbfgs.py)."""

    name, batches_jobs, needs_fixed_masks = "lbfgs", False, True

    def step(self, module: Engine, active: list[int]) -> None:
        """One L-BFGS iteration of the module's one job: the same bookkeeping as an Adam iteration (the
        loss at the iterate it starts from, the best iterate, the stopping rules); no lr schedule."""
        unknowns, attack = module.unknowns, module.attacks[0]
        if module.stepper is None:  # built on the device the Trainer chose; a resumed run restarts its history
            box = (unknowns.box_low, unknowns.box_high) if attack.boxed else None
            module.stepper = ImageLBFGS(unknowns.image_stack, attack.lr, box)
        lbfgs: ImageLBFGS = module.stepper
        value, point = lbfgs.step(lambda: module.job_losses(active)[0].sum(), module.manual_backward)
        improved, _ = module.state.observe(active, [value], module.attacks)
        if improved:
            with torch.no_grad():
                unknowns.best_images.copy_(point)
        if lbfgs.stuck and module.active():
            module.state.status[0] = "converged"  # nothing left to try: waiting out the patience changes nothing
        module.state.iteration += 1
        module.log("loss_mean", value, prog_bar=True, on_step=True, batch_size=1)
        if not module.active():
            module.trainer.should_stop = True


ATTACK_OPTIMIZERS: dict[str, AttackOptimizer] = {o.name: o for o in (JobAdam(), LBFGS())}
