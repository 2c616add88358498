"""The plain baseline the benchmark divides by, written by hand ON PURPOSE: it IS the plain loop that
the field's implementations (inverting-gradients, the DIA authors' code) run, so that every speed
figure of `make bench` is a ratio measured in the same process, on the same jobs:

  for each victim, one after another:
      for each iteration:
          g = torch.autograd.grad(CE(model(x)), weights, create_graph=True)   # weight-sized, per victim
          loss = 1 - <g, g*> / (|g| |g*|) + TV + mask regularizer             # cosine over all weights
          loss.backward(); sign of the data gradient; Adam step; scheduler; box and mask clipping

It is the same attack as the engine's (checked by tests/test_plain_baseline.py): the same model and
weights, the same initial dummies and masks (read from an InversionModule built for the same jobs),
the same TV term and DIA mask regularizer (attacker.engine.objectives), the same Adam, ReduceLROnPlateau,
signed data gradient, box and [0, 1] mask clipping. One kindness to the baseline: its backward
pass goes to the optimized tensors only (``inputs=``), where the field's code also accumulates
gradients into the model's weights. Neither this loop nor the engine step it is timed against
tracks the best iterate or the stopping rules.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from attacker.attacks import AttackConfig
from attacker.engine.inversion import InversionModule
from attacker.engine.objectives import EPS, mask_regularizer, term_weight, total_variation
from attacker.jobs import VictimJob, model_from_job
from fedsim.data import box_bounds, get_spec
from fedsim.models import DropoutMode, set_dropout_mode, set_masks


def initial_state(module: InversionModule, j: int) -> tuple[Tensor, list[Tensor], bool]:
    """Job j's dummies and masks as the engine starts them (copies), and whether masks are learned."""
    image = module.images[j].detach().clone()
    masks, learned = [], False
    for layer, (kind, _) in enumerate(module.unknowns.mask_slots[j]):
        if kind == "random":
            raise NotImplementedError("the plain baseline runs fixed or learned masks, not fresh random ones")
        masks.append(module.unknowns.mask(j, layer).detach().clone())
        learned = learned or kind == "learn"
    return image, masks, learned


class PlainAttack:
    """One victim, attacked alone by the plain loop (see the module docstring)."""

    def __init__(
        self,
        job: VictimJob,
        attack: AttackConfig,
        image: Tensor,
        masks: list[Tensor],
        learned: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        if attack.distance != "cosine" or term_weight(attack, "lambda_pos", job.spec.name):
            raise NotImplementedError("the plain baseline is the cosine attack (IG, WIIG, DIA)")
        self.attack = attack
        self.model = model_from_job(job).to(device)
        self.params = list(self.model.parameters())  # requires_grad: autograd.grad differentiates w.r.t. them
        self.targets = [t.to(device) for t in job.gradient]
        self.target_norm = torch.sqrt(sum(t.pow(2).sum() for t in self.targets))
        self.labels = job.labels.to(device)
        self.image = image.to(device).requires_grad_(True)
        self.masks = [m.to(device).requires_grad_(learned) for m in masks]
        self.learned = learned
        self.p = job.p
        self.tv = term_weight(attack, "tv_weight", job.spec.name)
        self.lambda_mask = term_weight(attack, "lambda_mask", job.spec.name) if learned else 0.0
        low, high = box_bounds(get_spec(job.spec.dataset, job.spec.input_shape[0]))
        self.low, self.high = low.to(device), high.to(device)
        optimized = [self.image] + (self.masks if learned else [])
        self.optimized = optimized
        self.opt = torch.optim.Adam(optimized, lr=attack.lr, betas=(0.9, 0.999))
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.opt, mode="min", factor=attack.plateau_factor, patience=attack.plateau_patience
        )

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        if self.masks:
            set_masks(self.model, self.masks)
            set_dropout_mode(self.model, DropoutMode.LEARN)
        x = self.image
        grads = torch.autograd.grad(F.cross_entropy(self.model(x), self.labels), self.params, create_graph=True)
        dot = sum((g * t).sum() for g, t in zip(grads, self.targets))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads).clamp_min(0))
        loss = 1 - dot / (norm * self.target_norm + EPS)
        if self.tv:
            loss = loss + self.tv * total_variation(x, 1)[0]
        if self.lambda_mask:
            loss = loss + self.lambda_mask * mask_regularizer(self.masks, 1, self.p)[0]
        loss.backward(inputs=self.optimized)
        value = loss.item()
        if self.attack.signed_gradients:
            x.grad.sign_()
        self.opt.step()
        self.scheduler.step(value)
        with torch.no_grad():
            if self.attack.boxed:
                x.copy_(torch.maximum(torch.minimum(x, self.high), self.low))
            if self.learned:
                for m in self.masks:
                    m.clamp_(0.0, 1.0)
        return value


def plain_attacks(module: InversionModule, jobs: int, device: torch.device | str = "cpu") -> list[PlainAttack]:
    """Plain attacks of the module's first ``jobs`` jobs, from the module's initial state."""
    return [
        PlainAttack(module.jobs[j], module.attacks[j], *initial_state(module, j), device=device) for j in range(jobs)
    ]


def run_plain(attacks: list[PlainAttack], iterations: int, sync=lambda: None) -> tuple[float, list[list[float]]]:
    """Each victim alone for ``iterations`` steps, one after another: (seconds, losses per victim)."""
    losses = []
    sync()
    start = time.perf_counter()
    for attack in attacks:
        losses.append([attack.step() for _ in range(iterations)])
    sync()
    return time.perf_counter() - start, losses
