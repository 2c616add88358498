"""SSIM against the iteration: how fast an attack reaches a good reconstruction, not only where it ends.

A Lightning callback scores every running job's current dummies against its ground truth every
``every`` iterations (paper-space SSIM, matched for B > 1, as the final scoring does). The ground
truth stays in the callback, which only measures: the attack module never sees it (only WIIG's
masks reach the module, attacks.py). The curve is kept in the checkpoint (the callback's state), so a
resumed run continues it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from fedsim.data import get_spec

from .jobs import Oracle, merge_copies
from .metrics import score_batch

SSIM_TARGET = 0.9  # "iterations to SSIM 0.9": how fast an attack gets a recognizable image


class SSIMCurve(L.Callback):
    def __init__(self, oracles: list[Oracle | None], every: int = 100) -> None:
        self.oracles = oracles
        self.every = every
        self.points: list[list[tuple[int, float]]] = [[] for _ in oracles]  # per job: (iteration, ssim)
        self.done = [False] * len(oracles)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        it, status = module.state.iteration, module.state.status
        due = it % self.every == 0 or it == 1  # iteration 1 too: where every curve starts
        if not due and all(self.done[j] or status[j] == "running" for j in range(len(self.oracles))):
            return  # nothing to score this iteration
        spec = get_spec(module.jobs[0].spec.dataset, module.jobs[0].spec.input_shape[0])
        with torch.no_grad():
            for j, oracle in enumerate(self.oracles):
                if oracle is None or self.done[j]:
                    continue
                stopped = status[j] != "running"
                if not (due or stopped):
                    continue
                if stopped:
                    self.done[j] = True  # its last point: where it stopped (its dummies no longer move)
                images = merge_copies(module.in_label_order(j, module.images[j].detach().cpu()), module.copies)
                # an unknown batch order holds one label per copy of each image: match on the images alone
                labels = module.jobs[j].labels if module.copies == 1 else None
                scored = score_batch(oracle.images, images, spec.mean, spec.std, labels=labels)
                self.points[j].append((it, float(scored["metrics"]["ssim_paper"]["mean"])))

    def state_dict(self) -> dict[str, Any]:
        return {"points": self.points, "done": self.done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.points = [list(map(tuple, p)) for p in state_dict["points"]]
        self.done = list(state_dict["done"])


def iterations_to(points: list[tuple[int, float]], target: float = SSIM_TARGET) -> int | None:
    """The first scored iteration at which the SSIM reached ``target`` (None: never within the run)."""
    return next((it for it, ssim in points if ssim >= target), None)


def mean_curve(points: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The jobs' mean SSIM at every scored iteration; a job that stopped holds its last value."""
    iterations = sorted({it for job in points for it, _ in job})
    curve = []
    for it in iterations:
        values = [next((s for i, s in reversed(job) if i <= it), None) for job in points if job]
        values = [v for v in values if v is not None]
        if values:
            curve.append((it, sum(values) / len(values)))
    return curve


def time_to(
    points: list[list[tuple[int, float]]], target: float, seconds_per_iteration: float | None
) -> tuple[int | None, float | None]:
    """The first iteration at which the jobs' MEAN SSIM reached ``target``, and the seconds it took
    (that iteration times ``seconds_per_iteration``, the run's wall time per iteration of all these
    jobs); (None, None) where it never did."""
    reached = iterations_to(mean_curve(points), target)
    if reached is None:
        return None, None
    return reached, (reached * seconds_per_iteration if seconds_per_iteration is not None else None)
