"""L-BFGS on one job's dummy images: the quasi-Newton step DLG and iDLG use on the small sigmoid CNN.

Why it is separate from the per-job Adam rows (``job_adam``): L-BFGS keeps a curvature history and
runs a line search over ONE objective, so it cannot step many jobs' rows independently; the runner
gives each L-BFGS job a group of its own. torch.optim.LBFGS does the math; this class fits it to the
engine's iteration (one L-BFGS iteration per Lightning step, so curves, patience and checkpoints keep
their meaning) and to the box the images live in.

Masks are not optimized here: they stay at their initialization (DIA's ``mask_init: analytical``
recovers a B = 1 dropout next to a Linear exactly from the gradient, ``masks.analytical_masks``).
Measured on LeNet (docs/results/profiles.md): optimizing the masks jointly with L-BFGS loses, because the [0, 1]
clamp on them breaks the curvature model the line search relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedsim.models import mask_shapes

from .masks import analytical_rules, mask_mode

HISTORY = 100  # curvature pairs kept (the DLG code's setting; torch's default is also 100)
LINE_SEARCH = 25  # evaluations the strong-Wolfe line search may take per iteration (torch's own cap)
CACHE = 4  # recent evaluations kept: the line search's accepted point is evaluated again at the next step


class ImageLBFGS:
    def __init__(self, images: torch.nn.Parameter, lr: float, box: tuple[Tensor, Tensor] | None) -> None:
        self.images, self.box = images, box
        # max_iter 1: one L-BFGS iteration per engine iteration; tolerances 0: the engine's own rules stop it.
        # max_eval must be given: its default (max_iter * 5 // 4 = 1) would leave the line search no evaluation.
        self.opt = torch.optim.LBFGS(
            [images],
            lr=lr,
            max_iter=1,
            max_eval=1 + LINE_SEARCH,
            history_size=HISTORY,
            tolerance_grad=0.0,
            tolerance_change=0.0,
            line_search_fn="strong_wolfe",
        )
        self.cache: list[tuple[Tensor, Tensor, Tensor]] = []
        self.evaluations = 0
        self.restarts = 0  # times the curvature history was dropped (no move)
        self.still = 0  # iterations in a row without a move

    def _project(self) -> None:
        if self.box is not None:
            with torch.no_grad():
                self.images.copy_(torch.maximum(torch.minimum(self.images, self.box[1]), self.box[0]))

    def step(self, loss_fn: Callable[[], Tensor], backward: Callable[[Tensor], None]) -> tuple[float, Tensor]:
        """One L-BFGS iteration. Returns the loss at the iterate it started from and that iterate (the
        engine keeps the best one, as it does for Adam)."""
        start: list[tuple[float, Tensor]] = []

        def closure() -> Tensor:
            self.opt.zero_grad()
            self._project()  # evaluate at the point inside the box (projected L-BFGS, as in DLG-style code)
            point = self.images.detach().clone()
            hit = next((c for c in self.cache if torch.equal(c[0], point)), None)
            if hit is not None:  # the same point again: reuse its loss and gradient
                loss, grad = hit[1], hit[2]
                self.images.grad = grad.clone()
            else:
                loss = loss_fn()
                backward(loss)
                loss = loss.detach()
                self.evaluations += 1
                self.cache = [*self.cache[-(CACHE - 1) :], (point, loss, self.images.grad.detach().clone())]
            if not start:
                start.append((float(loss), point))
            return loss

        self.opt.step(closure)
        self._project()
        if torch.equal(self.images.detach(), start[0][1]):
            # No move: the direction was not a descent one or the line search found no decrease. torch's
            # L-BFGS would return here forever; forgetting the curvature history restarts it from -g.
            self.opt.state.clear()
            self.restarts += 1
            self.still += 1
        else:
            self.still = 0
        return start[0]

    @property
    def stuck(self) -> bool:
        """Not even a fresh start from -g moved the images: no descent is left inside the box."""
        return self.still >= 2


def lbfgs_fits(job: Any, attack: Any, model: torch.nn.Module) -> bool:
    """Whether L-BFGS can take ``job`` under ``attack`` (a VictimJob and an AttackConfig): a one-step
    capture (where it was measured), masks that are fixed (IG (eval), WIIG) or, for DIA, read exactly
    from the gradient (``mask_init: analytical`` at B = 1 with a rule for every dropout layer). Fresh
    random masks per iteration (IG (train)) would make its line search chase noise."""
    if job.plan is not None:
        return False
    kind = mask_mode(attack.masks, job.p).kind
    if kind == "random":
        return False
    if kind == "const":
        return True
    shapes = mask_shapes(model, torch.zeros(job.batch_size, *job.spec.input_shape))
    rules = analytical_rules(model, shapes)
    return attack.mask_init == "analytical" and job.batch_size == 1 and all(r is not None for r in rules)
