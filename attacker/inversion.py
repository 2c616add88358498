"""The one engine: a LightningModule that reconstructs the images of V victim jobs at once.

All jobs of one module share the model and its weights and have the same batch size B; each has
its own attack (IG, WIIG, DIA, APRIL...), dummies, masks, Adam, ReduceLROnPlateau, stopping rule
and best iterate, so each job's result equals running it alone (up to float rounding of batched
products). Every attack is "learn mode" dropout with per-job masks: IG (eval) multiplies by the
constant 1 - p (which cancels the 1/(1-p) scaling: dropout off), IG (train) by fresh Bernoulli
masks each iteration, WIIG by the client's true masks, DIA by optimized masks in [0, 1].

Why manual optimization, and Adam and the plateau schedule written out: each job has its own
learning rate, lowered on its own loss plateau, and its own stopping point; torch's optimizers and
schedulers act on a whole optimizer and one metric, and 128 of them stepped one by one cost most of
a V = 128 MLP iteration on CPU. So all jobs' dummies live in one parameter, each dropout layer's
learned masks in another, and Adam (attacker.job_adam) and the plateau rule of
torch.optim.lr_scheduler.ReduceLROnPlateau are applied row by row to those tensors: a job's result
is still what its own Adam and scheduler would give (tests/test_job_adam.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from fedsim.data import box_bounds, get_spec
from fedsim.models import DropoutMode, mask_shapes, set_dropout_mode, set_masks

from .attacks import AttackConfig
from .gradients import MatchTerms, PerJobGradients, UnsupportedModelError, autograd_terms
from .job_adam import _rows_view, adam_factors, adam_rows_, plateau_step
from .jobs import Oracle, VictimJob, merge_copies, model_from_job, support_mask
from .masks import MaskContext, mask_mode
from .replay import replay_terms
from .objectives import DISTANCES, TERMS, TermInputs, term_weight


@dataclass
class JobResult:
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


def job_seed(job: VictimJob, attack: AttackConfig, seed: int) -> int:
    """Each job draws its dummies and masks from its own generator: same result alone or batched."""
    return zlib.crc32(f"{job.job_id}/{attack.name}/{seed}".encode())


class _Steps(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class InversionModule(L.LightningModule):
    def __init__(
        self,
        jobs: list[VictimJob],
        attacks: list[AttackConfig],
        oracles: list[Oracle | None] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not jobs or len(jobs) != len(attacks):
            raise ValueError("give one attack per job, and at least one job")
        first = jobs[0]
        for job in jobs[1:]:
            if job.spec != first.spec or job.weights is not first.weights or job.batch_size != first.batch_size:
                raise ValueError("jobs of one module must share model spec, weights and batch size")
            if job.kind != first.kind or job.steps != first.steps or job.copies != first.copies:
                raise ValueError("jobs of one module must share what they match (gradient or update) and its steps")
        self.automatic_optimization = False
        self.jobs, self.attacks = jobs, attacks
        self.V, self.B = len(jobs), first.batch_size
        self.p = first.p
        self.model = model_from_job(first)
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.plan = first.plan  # an update job: the client's local round, replayed (attacker.replay)
        self.steps = first.steps  # which of a job's B images each local step uses
        self.copies = first.copies  # an unknown batch order: B = copies x N dummies (attacker.jobs.unknown_order)
        # Pruned captures (match_support): only the entries the client kept are matched, so the dummy
        # gradient is cut to them; that needs it materialized, job by job (autograd_terms).
        self.supports = [support_mask(j) for j in jobs]
        self.masked = any(s is not None for s in self.supports)
        self.ghost: PerJobGradients | None = None
        try:
            if self.plan is None and not self.masked:
                self.ghost = PerJobGradients(self.model)
        except UnsupportedModelError:
            if self.V > 1:
                raise ValueError("this model (BatchNorm) couples the images of a batch: run its jobs one per module") from None
        # Everything below is rebuilt from the jobs on resume: not persistent, so checkpoints stay small.
        spec = get_spec(first.spec.dataset, first.spec.input_shape[0])
        low, high = box_bounds(spec)
        self.register_buffer("box_low", low, persistent=False)
        self.register_buffer("box_high", high, persistent=False)
        # Masks per local step and dropout layer, step-major (one step for a gradient job).
        self.mask_shapes = [shape for batch in self.steps
                            for shape in mask_shapes(self.model, torch.zeros(len(batch), *first.spec.input_shape))]
        self.layers_per_step = len(self.mask_shapes) // len(self.steps)
        self.register_buffer("labels", torch.cat([j.labels for j in jobs]), persistent=False)
        for i, param_targets in enumerate(zip(*[j.gradient for j in jobs])):
            self.register_buffer(f"target_{i}", torch.stack(param_targets).float(), persistent=False)
        self.num_params = len(jobs[0].gradient)

        # All jobs' dummies as ONE parameter (V, B, *input) and each dropout layer's learned masks as one
        # parameter (a row per job that learns masks), so that gathering the active jobs, Adam, the box
        # and the best iterate are a few whole-tensor operations per iteration, not a few per job.
        images: list[Tensor] = []
        learn_rows: list[list[Tensor]] = [[] for _ in self.mask_shapes]
        const_rows: list[list[Tensor]] = [[] for _ in self.mask_shapes]
        self.mask_slots: list[list[tuple[str, int]]] = []  # per job and layer: (kind, row in that layer's stack)
        for j, (job, attack) in enumerate(zip(jobs, attacks)):
            gen = torch.Generator().manual_seed(job_seed(job, attack, seed))
            images.append(torch.randn(self.B, *first.spec.input_shape, generator=gen))
            oracle = oracles[j] if oracles else None
            if oracle is not None and not attack.receives_oracle:
                # The threat model: IG and DIA see only what the server saw, never ground truth.
                raise ValueError(f"job {job.job_id}: attack {attack.name} must not receive the oracle (only WIIG replays true masks)")
            mode = mask_mode(attack.masks, self.p)
            if mode.uses_oracle and oracle is None:
                raise ValueError(f"job {job.job_id}: WIIG replays the client's true masks and needs its oracle")
            if mode.kind == "random":
                self.mask_slots.append([("random", -1)] * len(self.mask_shapes))
                continue
            assert mode.init is not None
            gradient = job.gradient if self.plan is None else None  # an update is no gradient (analytical init)
            init = mode.init(MaskContext(self.mask_shapes, self.p, attack.mask_init, self.model, gradient, oracle, gen))
            kind = "learn" if mode.kind == "learn" else "const"
            rows = learn_rows if kind == "learn" else const_rows
            self.mask_slots.append([(kind, len(rows[layer])) for layer in range(len(init))])
            for layer, m in enumerate(init):
                rows[layer].append(m)
        self.image_stack = nn.Parameter(torch.stack(images))
        self.mask_stacks = nn.ParameterList(
            nn.Parameter(torch.stack(r) if r else torch.zeros(0, *shape)) for r, shape in zip(learn_rows, self.mask_shapes))
        for i, (r, shape) in enumerate(zip(const_rows, self.mask_shapes)):
            self.register_buffer(f"const_stack_{i}", torch.stack(r) if r else torch.zeros(0, *shape), persistent=False)
        # per layer, the job of each learned row (rows were added in job order)
        self.learn_jobs = [[j for j in range(self.V) if self.mask_slots[j][i][0] == "learn"]
                           for i in range(len(self.mask_shapes))]
        # Adam's moments (persistent: a resumed run continues them), per-job step counts, learning rates
        # and plateau state (in the checkpoint's "inversion" entry).
        self.register_buffer("adam_m_images", torch.zeros_like(self.image_stack))
        self.register_buffer("adam_v_images", torch.zeros_like(self.image_stack))
        for i, stack in enumerate(self.mask_stacks):
            self.register_buffer(f"adam_m_mask_{i}", torch.zeros_like(stack))
            self.register_buffer(f"adam_v_mask_{i}", torch.zeros_like(stack))
        self.adam_steps = [0] * self.V
        self.job_lr = [float(a.lr) for a in attacks]
        self.plateau_best = [float("inf")] * self.V
        self.plateau_bad = [0] * self.V
        self.register_buffer("signed", torch.tensor([a.signed_gradients for a in attacks]), persistent=False)
        self.register_buffer("boxed", torch.tensor([a.boxed for a in attacks]), persistent=False)
        self._index_cache: dict[tuple[int, ...], Tensor] = {}
        # Per-job settings as vectors, indexed by the active jobs each step: the distance of each job,
        # and the weight of every loss term (objectives.TERMS), zero where it does not apply.
        self.distance_names = sorted({a.distance for a in attacks})
        self.register_buffer("distance_index", torch.tensor([self.distance_names.index(a.distance) for a in attacks]),
                             persistent=False)
        learns = [mask_mode(a.masks, self.p).kind == "learn" for a in attacks]
        self.term_keys = list(TERMS)
        for key in self.term_keys:
            term = TERMS[key]
            weights = [term_weight(a, key, first.spec.name)
                       if (learned or not term.learned_masks_only) and (self.copies > 1 or not term.copies_only)
                       else 0.0 for a, learned in zip(attacks, learns)]
            self.register_buffer(f"weight_{key}", torch.tensor(weights), persistent=False)
        self.iteration = 0
        self.status = ["running"] * self.V
        self.best_loss = [float("inf")] * self.V
        self.best_iteration = [-1] * self.V
        self.since_best = [0] * self.V
        self.losses: list[list[float]] = [[] for _ in range(self.V)]
        self.has_best = [False] * self.V
        self.register_buffer("best_images", self.image_stack.detach().clone())
        for i, stack in enumerate(self.mask_stacks):
            self.register_buffer(f"best_masks_{i}", stack.detach().clone())
        self._targets_for: tuple[int, ...] | None = None

    # -- Lightning plumbing -------------------------------------------------------------------
    def on_train_start(self) -> None:
        # A replay is many small, memory-bound ops: on CPU one intra-op thread beats two (measured
        # here: MLP K = 4, 0.04 s against 1.2 s per iteration on a busy 2-core machine), since every
        # parallel region waits for the slowest thread. Restored when the fit ends.
        self._threads = torch.get_num_threads()
        if self.plan is not None and self.device.type == "cpu":
            torch.set_num_threads(1)

    def on_train_end(self) -> None:
        torch.set_num_threads(getattr(self, "_threads", torch.get_num_threads()))

    def configure_optimizers(self):  # optimizers live per job in the module (see module docstring)
        return None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Steps(self.chunk), batch_size=None)

    chunk = 250  # iterations per Lightning "epoch": the checkpoint interval

    # -- the optimization -------------------------------------------------------------------
    def active(self) -> list[int]:
        return [j for j in range(self.V) if self.status[j] == "running"]

    @property
    def images(self) -> list[Tensor]:
        """Job j's dummies: row j of the stacked parameter (a view; in-place edits reach the parameter)."""
        return list(self.image_stack.unbind(0))

    def _index(self, rows: list[int]) -> Tensor:
        key = tuple(rows)
        index = self._index_cache.get(key)
        if index is None or index.device != self.image_stack.device:
            if len(self._index_cache) > 64:  # jobs stop one by one: keep only recent subsets
                self._index_cache.clear()
            index = self._index_cache[key] = torch.tensor(rows, device=self.image_stack.device, dtype=torch.long)
        return index

    def _rows(self, stack: Tensor, rows: list[int]) -> Tensor:
        """The given rows of a stacked tensor, flattened into one batch (no copy when all rows, in order)."""
        picked = stack if rows == list(range(stack.shape[0])) else stack.index_select(0, self._index(rows))
        return picked.reshape(-1, *stack.shape[2:])

    def _mask(self, j: int, layer: int) -> Tensor:
        kind, k = self.mask_slots[j][layer]
        if kind == "learn":
            return self.mask_stacks[layer][k]
        if kind == "const":
            return getattr(self, f"const_stack_{layer}")[k]
        shape = self.mask_shapes[layer]
        return torch.bernoulli(torch.full(shape, 1.0 - self.p, device=self.box_low.device))

    def _layer_masks(self, active: list[int], layer: int) -> Tensor:
        """One dropout layer's masks of the active jobs, job after job, as one batch."""
        kinds = {self.mask_slots[j][layer][0] for j in active}
        if kinds == {"learn"} or kinds == {"const"}:
            stack = self.mask_stacks[layer] if kinds == {"learn"} else getattr(self, f"const_stack_{layer}")
            return self._rows(stack, [self.mask_slots[j][layer][1] for j in active])
        return torch.cat([self._mask(j, layer) for j in active])  # jobs of different kinds in one group

    def _support(self, j: int, device: torch.device) -> list[Tensor] | None:
        support = self.supports[j]
        if support is not None and support[0].device != device:  # moved once, with the module
            self.supports[j] = support = [s.to(device) for s in support]
        return support

    def _masked_terms(self, x: Tensor, active: list[int], layers: list[Tensor]) -> MatchTerms:
        """Job by job by autograd, each dummy gradient cut to its job's support (pruned captures)."""
        B, parts = self.B, []
        for param in self.model.parameters():
            param.requires_grad_(True)
        try:
            for k, j in enumerate(active):
                rows = slice(k * B, (k + 1) * B)
                if layers:
                    set_masks(self.model, [layer[rows] for layer in layers])
                targets = [getattr(self, f"target_{i}")[j:j + 1] for i in range(self.num_params)]
                parts.append(autograd_terms(self.model, x[rows], self.labels.view(self.V, B)[j], targets,
                                            self._support(j, x.device)))
        finally:
            for param in self.model.parameters():
                param.requires_grad_(False)
        return MatchTerms(torch.cat([t.dot for t in parts], 1), torch.cat([t.norm2 for t in parts], 1),
                          torch.cat([t.target_norm2 for t in parts], 1), parts[0].names)

    def _terms(self, x: Tensor, active: list[int]) -> MatchTerms:
        labels = self.labels.view(self.V, self.B)[active].reshape(-1)
        if self.ghost is None:
            targets = [getattr(self, f"target_{i}")[active] for i in range(self.num_params)]
            for param in self.model.parameters():
                param.requires_grad_(True)
            try:
                return autograd_terms(self.model, x, labels, targets)
            finally:
                for param in self.model.parameters():
                    param.requires_grad_(False)
        key = tuple(active)
        if self._targets_for != key:  # jobs stopped: compact the targets once, not every step
            targets = [getattr(self, f"target_{i}") for i in range(self.num_params)]
            index = torch.tensor(active, device=self.labels.device) if len(active) < self.V else None
            self.ghost.set_targets(targets, jobs=index)  # low-rank targets are factored once, then rows picked
            self._targets_for = key
        return self.ghost.compute(x, labels, len(active))

    def _replay_terms(self, active: list[int]) -> tuple[MatchTerms, list[Tensor]]:
        """An update's terms: each job's masks as (step, layer) lists, its round replayed (attacker.replay)."""
        L = self.layers_per_step
        masks = {j: [self._mask(j, i) for i in range(len(self.mask_shapes))] for j in active}
        per_step = [[masks[j][t * L:(t + 1) * L] for t in range(len(self.steps))] for j in active]
        targets = [[getattr(self, f"target_{i}")[j] for i in range(self.num_params)] for j in active]
        labels = [self.labels.view(self.V, self.B)[j] for j in active]
        start = dict(self.model.named_parameters())
        dummies = self.images  # one unbind for all jobs, not one per job
        terms = replay_terms(self.model, start, self.plan, [dummies[j] for j in active], labels, per_step, targets,
                             [self._support(j, self.labels.device) for j in active])
        layers = [torch.cat([masks[j][i] for j in active]) for i in range(len(self.mask_shapes))]
        return terms, layers

    def job_losses(self, active: list[int]) -> tuple[Tensor, Tensor]:
        x = self._rows(self.image_stack, active)
        layers: list[Tensor] = []
        if self.plan is not None:
            terms, layers = self._replay_terms(active)
        else:
            if self.mask_shapes:
                layers = [self._layer_masks(active, i) for i in range(len(self.mask_shapes))]
                set_masks(self.model, layers)
                set_dropout_mode(self.model, DropoutMode.LEARN)
            terms = self._masked_terms(x, active, layers) if self.masked else self._terms(x, active)
        index = self._index(active)
        chosen = self.distance_index.index_select(0, index)
        loss = DISTANCES[self.distance_names[0]](terms)
        for d, name in enumerate(self.distance_names[1:], start=1):
            loss = torch.where(chosen == d, DISTANCES[name](terms), loss)
        inputs = TermInputs(terms, x, len(active), layers, self.p, self.copies)
        for key in self.term_keys:
            weight = getattr(self, f"weight_{key}").index_select(0, index)
            if weight.any():  # a term no active job uses is not computed
                loss = loss + weight * TERMS[key].fn(inputs)
        return loss, x

    def training_step(self, batch, batch_idx):
        active = self.active()
        if not active:
            self.trainer.should_stop = True
            return None
        self.zero_grads(active)
        losses, _ = self.job_losses(active)
        self.manual_backward(losses.sum())
        values = losses.detach().cpu().tolist()
        it = self.iteration
        stepping: list[tuple[int, float]] = []
        improved: list[int] = []
        for j, value in zip(active, values):
            attack = self.attacks[j]
            if value != value or value in (float("inf"), float("-inf")):
                self.status[j] = "diverged"
                continue
            self.losses[j].append(value)
            if value < self.best_loss[j]:
                self.best_loss[j], self.best_iteration[j], self.since_best[j] = value, it, 0
                improved.append(j)
            else:
                self.since_best[j] += 1
            if self.best_loss[j] < attack.loss_threshold:
                self.status[j] = "converged"
            elif self.since_best[j] >= attack.patience:
                self.status[j] = "no_improvement"
            elif it + 1 >= attack.max_iterations:
                self.status[j] = "max_iterations"
            if self.status[j] != "running":
                continue
            stepping.append((j, value))
        if improved:
            self.keep_best(improved)
        if stepping:
            self.step_jobs([j for j, _ in stepping], [v for _, v in stepping])
        self.iteration += 1
        running = self.active()
        self.log("active_jobs", float(len(running)), prog_bar=True, on_step=True, batch_size=1)
        self.log("loss_mean", float(sum(values) / len(values)), prog_bar=True, on_step=True, batch_size=1)
        if not running:
            self.trainer.should_stop = True
        return None

    def keep_best(self, jobs: list[int]) -> None:
        """Record the current dummies and learned masks of ``jobs`` as their best iterate."""
        with torch.no_grad():
            index = self._index(jobs)
            self.best_images.index_copy_(0, index, self.image_stack.detach().index_select(0, index))
            for i, stack in enumerate(self.mask_stacks):
                rows = [self.mask_slots[j][i][1] for j in jobs if self.mask_slots[j][i][0] == "learn"]
                if rows:
                    r = self._index(rows)
                    getattr(self, f"best_masks_{i}").index_copy_(0, r, stack.detach().index_select(0, r))
        for j in jobs:
            self.has_best[j] = True

    def zero_grads(self, active: list[int]) -> None:
        """Drop the gradients of the last iteration (all jobs' rows at once)."""
        self.image_stack.grad = None
        for stack in self.mask_stacks:
            stack.grad = None

    def _plateau(self, j: int, loss: float) -> None:
        """Job j's learning rate after its plateau rule saw ``loss`` (attacker.job_adam.plateau_step)."""
        attack = self.attacks[j]
        self.job_lr[j], self.plateau_best[j], self.plateau_bad[j] = plateau_step(
            self.job_lr[j], self.plateau_best[j], self.plateau_bad[j], loss, attack.plateau_patience, attack.plateau_factor)

    def step_jobs(self, jobs: list[int], losses: list[float]) -> None:
        """One optimizer step of each of ``jobs`` after the backward pass: signed data gradients, Adam
        with each job's learning rate and step count (attacker.job_adam, on the stacked rows), each job's
        plateau rule on its loss, then the box on the images and [0, 1] on learned masks. Rows of other
        jobs do not move."""
        stepping = [False] * self.V
        for j in jobs:
            stepping[j] = True
            self.adam_steps[j] += 1
        step_size, bc2_sqrt = adam_factors(self.job_lr, self.adam_steps, stepping)
        device = self.image_stack.device
        step_size, bc2_sqrt = step_size.to(device), bc2_sqrt.to(device)
        moving = torch.tensor(stepping, device=device)
        with torch.no_grad():
            grad = self.image_stack.grad
            if grad is not None:
                if bool(self.signed.any()):  # the data gradient only; mask gradients stay as they are
                    grad = torch.where(_rows_view(self.signed, grad), grad.sign(), grad)
                adam_rows_(self.image_stack, grad, self.adam_m_images, self.adam_v_images, step_size, bc2_sqrt, moving)
                box = moving & self.boxed
                if bool(box.any()):
                    clamped = torch.maximum(torch.minimum(self.image_stack, self.box_high), self.box_low)
                    self.image_stack.copy_(torch.where(_rows_view(box, clamped), clamped, self.image_stack))
            for i, stack in enumerate(self.mask_stacks):
                if stack.grad is None or not self.learn_jobs[i]:
                    continue
                rows = self._index(self.learn_jobs[i])
                adam_rows_(stack, stack.grad, getattr(self, f"adam_m_mask_{i}"), getattr(self, f"adam_v_mask_{i}"),
                           step_size.index_select(0, rows), bc2_sqrt.index_select(0, rows), moving.index_select(0, rows))
                stack.clamp_(0.0, 1.0)
        for j, loss in zip(jobs, losses):
            self._plateau(j, loss)

    def step_job(self, j: int, loss: float) -> None:
        """:meth:`step_jobs` for one job."""
        self.step_jobs([j], [loss])

    # -- checkpoints: the per-job state Lightning does not know about ------------------------------
    # The dummies, masks, Adam moments and best iterates are the module's parameters and buffers.
    CHECKPOINT_FORMAT = 2

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["inversion"] = {
            "format": self.CHECKPOINT_FORMAT,
            "iteration": self.iteration,
            "status": self.status,
            "best_loss": self.best_loss,
            "best_iteration": self.best_iteration,
            "since_best": self.since_best,
            "losses": self.losses,
            "has_best": self.has_best,
            "adam_steps": self.adam_steps,
            "job_lr": self.job_lr,
            "plateau_best": self.plateau_best,
            "plateau_bad": self.plateau_bad,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["inversion"]
        for key in ("iteration", "status", "best_loss", "best_iteration", "since_best", "losses", "has_best",
                    "adam_steps", "job_lr", "plateau_best", "plateau_bad"):
            setattr(self, key, state[key])

    # -- results ------------------------------------------------------------------------------------
    def results(self) -> list[JobResult]:
        out = []
        pixels = self.B * int(torch.Size(self.jobs[0].spec.input_shape).numel())
        for j, (job, attack) in enumerate(zip(self.jobs, self.attacks)):
            source = self.best_images if self.has_best[j] else self.image_stack
            images = merge_copies(source[j].detach().cpu().clone(), self.copies)
            slots = [(i, k) for i, (kind, k) in enumerate(self.mask_slots[j]) if kind == "learn"]
            masks = [getattr(self, f"best_masks_{i}")[k].cpu().clone() for i, k in slots] if slots and self.has_best[j] else None
            learned = sum(self.mask_stacks[i][k].numel() for i, k in slots)
            out.append(
                JobResult(
                    job.job_id,
                    attack.name,
                    images,
                    masks,
                    self.best_loss[j],
                    self.best_iteration[j],
                    len(self.losses[j]),
                    self.status[j],
                    pixels + learned,
                    list(self.losses[j]),
                )
            )
        return out
