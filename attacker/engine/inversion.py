"""The one engine: a LightningModule that reconstructs the images of V victim jobs at once.

All jobs of one module share the model and its weights and have the same batch size B; each has
its own attack (IG, WIIG, DIA, APRIL...), dummies, masks, Adam, ReduceLROnPlateau, stopping rule
and best iterate, so each job's result equals running it alone (up to float rounding of batched
products). Every attack is "learn mode" dropout with per-job masks: IG (eval) multiplies by the
constant 1 - p (which cancels the 1/(1-p) scaling: dropout off), IG (train) by fresh Bernoulli
masks each iteration, WIIG by the client's true masks, DIA by optimized masks in [0, 1].

Lightning's split: this module holds the math (each job's loss, the step); the Trainer the loop;
callbacks the checkpoints and curves (``runner``). The parts: ``Unknowns`` (what is optimized),
``Matcher`` (what it is matched against), ``JobState`` (each job's stopping and schedule state), the
attack optimizer (``optimizers.ATTACK_OPTIMIZERS``: one iteration of the jobs). Optimization is
manual because each job has its own learning rate, plateau and stopping point.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningModule
from torch import Tensor
from torch.utils.data import DataLoader

from fedsim.data import box_bounds, get_spec
from fedsim.models import DropoutMode, mask_shapes, set_dropout_mode, set_masks

from ..attacks import AttackConfig
from ..closed_form.run import ClosedForms, scores_average_masks
from ..jobs import JobResult, Oracle, VictimJob, merge_copies, model_from_job
from .checkpoints import CHECKPOINT_EVERY
from .features import FeatureTargets
from .masks import mask_mode
from .matching import Matcher
from .objectives import DISTANCES, TERMS, TermInputs, position_parameter, term_weight
from .optimizers import ATTACK_OPTIMIZERS
from .replay import smoothing_end
from .state import JobState
from .unknowns import Unknowns


def check_group(jobs: list[VictimJob], attacks: list[AttackConfig]) -> None:
    """One module's jobs share the model spec, weights, batch size and what they match."""
    if not jobs or len(jobs) != len(attacks):
        raise ValueError("give one attack per job, and at least one job")
    first = jobs[0]
    for job in jobs[1:]:
        if job.spec != first.spec or job.weights is not first.weights or job.batch_size != first.batch_size:
            raise ValueError("jobs of one module must share model spec, weights and batch size")
        if (
            job.kind != first.kind
            or job.steps != first.steps
            or (job.copies, job.members) != (first.copies, first.members)
        ):
            raise ValueError("jobs of one module must share what they match (gradient or update) and its steps")


class InversionModule(LightningModule):
    CHECKPOINT_FORMAT = 3  # 3: the unknowns and the per-job state as their own parts

    def __init__(
        self,
        jobs: list[VictimJob],
        attacks: list[AttackConfig],
        oracles: list[Oracle | None] | None = None,
        seed: int = 0,
        chunk: int = CHECKPOINT_EVERY,
    ) -> None:
        super().__init__()
        check_group(jobs, attacks)
        self.automatic_optimization = False
        self.jobs, self.attacks, self.chunk = jobs, attacks, chunk
        first = jobs[0]
        self.V, self.B, self.p, self.copies = len(jobs), first.batch_size, first.p, first.copies
        model = model_from_job(first)
        for param in model.parameters():
            param.requires_grad_(False)
        self.matcher = Matcher(jobs, model)
        # Masks per local step and dropout layer, step-major (one step for a gradient job).
        self.mask_shapes = [
            shape
            for batch in first.steps
            for shape in mask_shapes(model, torch.zeros(len(batch), *first.spec.input_shape))
        ]
        box = box_bounds(get_spec(first.spec.dataset, first.spec.input_shape[0]))
        self.unknowns = Unknowns(jobs, attacks, oracles, seed, model, self.mask_shapes, box)
        self.state = JobState.start(attacks)
        self._snaps = [0] * len(jobs)  # per job, the snaps taken (attack.snap_every)
        self.snapped = [0] * len(jobs)  # per job, the images its snaps added to the held ones
        self.relabeled = [0] * len(jobs)  # per job, the label changes of its slots (``_relabel``)
        # one for the run: it keeps each job's solves, which every snap consults (a B = 64 separation takes minutes)
        self._forms: ClosedForms | None = None
        # The iteration at which each job's smoothed Adam replay becomes its final objective (None: never).
        adam = first.plan is not None and first.plan.optimizer.algorithm.smoothed_eps_replay
        self.smoothing_ends = [smoothing_end(a) if adam else None for a in attacks]
        # The attack optimizer (optimizers.ATTACK_OPTIMIZERS), one per module: its step is the iteration.
        self.attack_optimizer = ATTACK_OPTIMIZERS[attacks[0].optimizer]
        if any(a.optimizer != attacks[0].optimizer for a in attacks):
            raise ValueError("the jobs of one module share one attack optimizer")
        if not self.attack_optimizer.batches_jobs and self.V != 1:
            raise ValueError(f"an attack with optimizer {attacks[0].optimizer!r} runs one job per module")
        if self.attack_optimizer.needs_fixed_masks:
            for stack in self.unknowns.mask_stacks:
                stack.requires_grad_(False)
        self.stepper: Any = None  # the optimizer's own state beside the unknowns, built at its first step
        # Per-job settings as vectors, indexed by the active jobs each step: the distance of each job,
        # and the weight of every loss term (objectives.TERMS), zero where it does not apply.
        self.distance_names = sorted({a.distance for a in attacks})
        self.register_buffer(
            "distance_index", torch.tensor([self.distance_names.index(a.distance) for a in attacks]), persistent=False
        )
        learns = [mask_mode(a.masks, self.unknowns.mask_rates or self.p).kind == "learn" for a in attacks]
        for key, term in TERMS.items():
            weights = [
                term_weight(a, key, first.spec.name)
                if (learned or not term.learned_masks_only) and (self.copies > 1 or not term.copies_only)
                else 0.0
                for a, learned in zip(attacks, learns)
            ]
            self.register_buffer(f"weight_{key}", torch.tensor(weights), persistent=False)
        # The features term: each job's target features from its gradient; off for jobs without one.
        self.features: FeatureTargets | None = None
        if self.weight_lambda_features.any():
            self.features = FeatureTargets(jobs, model)
            self.weight_lambda_features.mul_(torch.tensor(self.features.has, dtype=torch.float32))
        # APRIL's term: the position embedding's parameter, found once by structure (not by its name).
        self.position: str | None = None
        if self.weight_lambda_pos.any():
            self.position = position_parameter(model, tuple(first.spec.input_shape), first.spec.num_classes)

    @property
    def model(self) -> torch.nn.Module:
        return self.matcher.model

    @property
    def ghost(self):  # the batched gradient path, when the group uses it (benchmarks switch its factoring)
        return self.matcher.ghost

    @property
    def images(self) -> list[Tensor]:
        return self.unknowns.images

    def active(self) -> list[int]:
        return self.state.active()

    # -- Lightning plumbing -------------------------------------------------------------------
    def on_train_start(self) -> None:
        # A replay is many small, memory-bound ops: on CPU one intra-op thread beats two (measured
        # here: MLP K = 4, 0.04 s against 1.2 s per iteration on a busy 2-core machine), since every
        # parallel region waits for the slowest thread. Restored when the fit ends.
        self._threads = torch.get_num_threads()
        if self.matcher.plan is not None and self.device.type == "cpu":
            torch.set_num_threads(1)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Every ``snap_every`` iterations of an attack that asks (after the iteration, not only at a chunk's
        end: snaps more often than checkpoints): the images its closed form can now tell
        exactly from the dummies join the held ones (``ClosedForms.snap``), and the job's best iterate is looked
        for again from there (``JobState.restart_tracking``). On resume the held set starts
        again from the closed form's first answer; the snapped images are still the dummies' values, and
        the next snap holds them again."""
        due = [
            j
            for j in self.active()
            if self.attacks[j].snap_every and self.state.iteration // self.attacks[j].snap_every > self._snaps[j]
        ]
        if not due:
            return
        if self._forms is None:
            self._forms = ClosedForms()
        forms = self._forms
        for j in due:
            self._snaps[j] = self.state.iteration // self.attacks[j].snap_every
            images = self.unknowns.image_stack[j].detach().cpu()
            snapped = forms.snap(self.jobs[j], images, self.unknowns.held[j].cpu())
            added = self.unknowns.hold_more(j, *snapped) if snapped is not None else 0
            self.snapped[j] += added
            moved = self._relabel(j, forms)
            if added or moved:
                # the snapped images are exact by their own check, whatever the loss says: a best iterate
                # from before the snap lacks them (the loss jumps while the free images let go of the
                # ghosts they shared with the snapped ones; and where slots traded labels), so the best is
                # looked for after it
                self.state.restart_tracking([j])

    def _relabel(self, j: int, forms: ClosedForms) -> int:
        """Job j's slots trade labels so that each held image sits at a label it scores
        (``ClosedForms.relabel``): a held image fixed under the wrong label would keep the label its missing
        image needs from every open slot, and the slot that has it drifts to a copy of an image held
        elsewhere (a B = 32 SGD round: 31 of 32, the 32nd a copy). Returns how many slots changed label."""
        labels = self.matcher.job_labels(j)  # a view of the Matcher's labels: every objective reads them per call
        new = forms.relabel(
            self.jobs[j], self.unknowns.image_stack[j].detach().cpu(), self.unknowns.held[j].cpu(), labels.cpu()
        )
        if new is None:
            return 0
        moved = int((new != labels.cpu()).sum())
        if not moved:
            return 0
        # A round's scores are taken as they are: right after a trade the loss is no judge (the open slot given
        # the freed label still holds its copy; checked by it, the B = 32 SGD round stayed at 31 of 32, 32 of 32
        # unchecked, cap 1,000). One step's are blurred by its unknown masks (``scores_average_masks``):
        # unchecked, they cost a one-step B = 64 gradient 3 images (59 -> 56 of 64), so there the new labels
        # are taken only where the dummies explain what the client shared better under them.
        checked = not scores_average_masks(self.jobs[j])
        old = labels.clone()
        before = self._loss(j) if checked else 0.0
        labels.copy_(new.to(labels.device, labels.dtype))
        if checked and self._loss(j) >= before:
            labels.copy_(old)
            return 0
        self.relabeled[j] += moved
        return moved

    def _loss(self, j: int) -> float:
        with torch.enable_grad():  # a replay differentiates the client's steps
            return float(self.job_losses([j])[0][0].detach())

    def in_label_order(self, j: int, images: Tensor) -> Tensor:
        """Job j's dummies (B, ...) with image k at a slot of ``jobs[j].labels[k]``'s label: the order that
        scoring by labels assumes (``metrics.match_reconstructions``), whichever labels the slots traded."""
        slots = self.matcher.job_labels(j).cpu()
        labels = self.jobs[j].labels.to(slots.dtype).cpu()
        if images.shape[0] != slots.shape[0] or torch.equal(slots, labels):
            return images
        order = torch.empty_like(slots, dtype=torch.long)
        order[torch.argsort(labels, stable=True)] = torch.argsort(slots, stable=True)  # slots[order] == labels
        return images[order.to(images.device)]

    def on_train_end(self) -> None:
        torch.set_num_threads(getattr(self, "_threads", torch.get_num_threads()))

    def configure_optimizers(self) -> None:  # each job's Adam lives in Unknowns (see the module docstring)
        return None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(range(self.chunk), batch_size=None)

    # -- the math: each active job's loss ---------------------------------------------------------
    def job_losses(self, active: list[int]) -> tuple[Tensor, Tensor]:
        """Each active job's loss (one value per job) and the active jobs' dummies, job-major."""
        unknowns, layers_n = self.unknowns, len(self.mask_shapes)
        x = unknowns.rows(unknowns.image_stack, active)
        if self.matcher.plan is not None:
            masks = {j: [unknowns.mask(j, i) for i in range(layers_n)] for j in active}
            attacks = [self.attacks[j] for j in active]
            terms = self.matcher.replay(active, unknowns.images, masks, attacks, self.state.iteration)
            layers = [torch.cat([masks[j][i] for j in active]) for i in range(layers_n)]
        else:
            layers = [unknowns.layer_masks(active, i) for i in range(layers_n)]
            if layers:
                set_masks(self.model, layers)
                set_dropout_mode(self.model, DropoutMode.LEARN)
            terms = self.matcher.terms(x, active, layers)
        index = unknowns.index(active)
        chosen = self.distance_index.index_select(0, index)
        loss = DISTANCES[self.distance_names[0]](terms)
        for d, name in enumerate(self.distance_names[1:], start=1):
            loss = torch.where(chosen == d, DISTANCES[name](terms), loss)
        inputs = TermInputs(
            terms, x, len(active), layers, self.p, self.copies, self.unknowns.mask_rates, position=self.position
        )
        if self.features is not None:
            inputs.features = self.features.dummies(len(active) * self.B)
            inputs.target_features = self.features.targets.index_select(0, index)
        for key, term in TERMS.items():
            weight = getattr(self, f"weight_{key}").index_select(0, index)
            if weight.any():  # a term no active job uses is not computed
                loss = loss + weight * term.fn(inputs)
        return loss, x

    # -- the step -------------------------------------------------------------------------------
    def training_step(self, batch: int, batch_idx: int) -> None:
        active = self.active()
        if not active:
            self.trainer.should_stop = True
            return None
        self.attack_optimizer.step(self, active)  # one iteration of the active jobs (optimizers.py)
        return None

    def step_jobs(self, jobs: list[int], losses: list[float]) -> None:
        """One optimizer step of each of ``jobs`` after the backward pass (Adam on their rows, then each
        job's learning-rate schedule on its loss)."""
        stepping = [False] * self.V
        for j in jobs:
            stepping[j] = True
            self.state.adam_steps[j] += 1
        self.unknowns.step(stepping, self.state.job_lr, self.state.adam_steps)
        for j, loss in zip(jobs, losses):
            self.state.schedule(j, loss, self.attacks[j])

    # -- checkpoints: the dummies, masks, Adam moments and best iterates are parameters and buffers;
    # the per-job state is saved beside them.
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["inversion"] = {
            "format": self.CHECKPOINT_FORMAT,
            **self.state.state_dict(),
            "slot_labels": self.matcher.labels.cpu().clone(),  # the dummies were optimized under these
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = dict(checkpoint["inversion"])
        slot_labels = saved.pop("slot_labels", None)  # absent from checkpoints of before the slots traded labels
        if slot_labels is not None:
            self.matcher.labels.copy_(slot_labels.to(self.matcher.labels.device, self.matcher.labels.dtype))
        self.state.load_state_dict(saved)

    # -- results ------------------------------------------------------------------------------------
    def results(self) -> list[JobResult]:
        out, state, unknowns = [], self.state, self.unknowns
        pixels = self.B * int(torch.Size(self.jobs[0].spec.input_shape).numel())
        for j, (job, attack) in enumerate(zip(self.jobs, self.attacks)):
            source = unknowns.best_images if state.has_best[j] else unknowns.image_stack
            slots = unknowns.learned(j)
            masks = (
                [getattr(unknowns, f"best_masks_{i}")[k].cpu().clone() for i, k in slots]
                if slots and state.has_best[j]
                else None
            )
            learned = sum(unknowns.mask_stacks[i][k].numel() for i, k in slots)
            out.append(
                JobResult(
                    job.job_id,
                    attack.name,
                    merge_copies(self.in_label_order(j, source[j].detach().cpu().clone()), self.copies),
                    [self.in_label_order(j, m) for m in masks] if masks else masks,
                    state.best_loss[j],
                    state.best_iteration[j],
                    len(state.losses[j]),
                    state.status[j],
                    pixels + learned,
                    list(state.losses[j]),
                    # what the snaps did (metrics.json, summary.csv): images they held, slots' label changes
                    extras={"images_snapped": self.snapped[j], "labels_traded": self.relabeled[j]}
                    if attack.snap_every
                    else {},
                )
            )
        return out
