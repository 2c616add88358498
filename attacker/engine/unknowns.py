"""What the attack optimizes, for all jobs of a group at once: the dummy images and the learned masks.

All jobs' dummies live in ONE parameter (V, B, *input) and each dropout layer's learned masks in
another (a row per job that learns masks), so gathering the active jobs, Adam, the box and the best
iterate are a few whole-tensor operations per iteration, not a few per job. Masks that are not
learned (WIIG's true masks, IG's constant 1 - p) sit in buffers; IG (train) draws fresh ones.

Why Adam is written out (``job_adam``): each job has its own learning rate and step count; torch's
optimizers act on a whole parameter, and 128 of them stepped one by one cost most of a V = 128 MLP
iteration on CPU. A job's rows still move exactly as its own ``torch.optim.Adam`` would move them
(tests/test_job_adam.py).
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor, nn

from fedsim.models.dropout import mask_rates

from ..attacks import AttackConfig
from ..closed_form.run import ClosedForms
from ..jobs import Oracle, VictimJob
from .job_adam import _rows_view, adam_factors, adam_rows_
from .masks import MaskContext, mask_mode
from .span import image_span


def job_seed(job: VictimJob, attack: AttackConfig, seed: int) -> int:
    """Each job draws its dummies and masks from its own generator: same result alone or batched."""
    return zlib.crc32(f"{job.job_id}/{attack.name}/{seed}".encode())


class Unknowns(nn.Module):
    """The stacked dummies and masks, their Adam moments and best iterates, and the step that moves
    them. ``mask_slots[j][layer]`` says where job j's masks of a layer are: ("learn", row of the
    layer's learned stack), ("const", row of its constant stack) or ("random", -1). A "layer" here is
    one mask of a pass, ``mask_shapes`` order: one per dropout call, so a layer run twice has two."""

    def __init__(
        self,
        jobs: list[VictimJob],
        attacks: list[AttackConfig],
        oracles: list[Oracle | None] | None,
        seed: int,
        model: nn.Module,
        mask_shapes: list[torch.Size],
        box: tuple[Tensor, Tensor],
    ) -> None:
        super().__init__()
        first = jobs[0]
        self.p, self.mask_shapes = first.p, mask_shapes
        # each mask's drop rate: p, or a stochastic-depth layer's own rate (fedsim.models.MaskedDropPath)
        self.mask_rates = mask_rates(model, self.p, len(mask_shapes))
        # Rebuilt from the jobs on resume: not persistent, so checkpoints stay small.
        self.register_buffer("box_low", box[0], persistent=False)
        self.register_buffer("box_high", box[1], persistent=False)
        images: list[Tensor] = []
        held: list[Tensor] = []  # per job, the images a closed form pinned down that the attack holds
        forms = ClosedForms()
        learn_rows: list[list[Tensor]] = [[] for _ in mask_shapes]
        const_rows: list[list[Tensor]] = [[] for _ in mask_shapes]
        self.mask_slots: list[list[tuple[str, int]]] = []
        # per job, where the attack holds its dummies in the images' span: that span's basis (span.py)
        spans: list[Tensor | None] = [image_span(job, model) if a.image_span else None for job, a in zip(jobs, attacks)]
        for j, (job, attack) in enumerate(zip(jobs, attacks)):
            gen = torch.Generator().manual_seed(job_seed(job, attack, seed))
            start = torch.randn(job.batch_size, *first.spec.input_shape, generator=gen)
            hold = torch.zeros(job.batch_size, dtype=torch.bool)
            if attack.image_init == "closed_form":  # a solver's (partial) answer where one applies
                guess = forms.first_guess(job)
                if guess is not None:
                    start = guess.images.to(start.dtype)
                    hold = guess.held & attack.hold_certain
            images.append(start)
            held.append(hold)
            oracle = oracles[j] if oracles else None
            if oracle is not None and not attack.receives_oracle:
                # The threat model: IG and DIA see only what the server saw, never ground truth.
                raise ValueError(
                    f"job {job.job_id}: attack {attack.name} must not receive the oracle (only WIIG replays true masks)"
                )
            mode = mask_mode(attack.masks, self.mask_rates or self.p)
            if mode.uses_oracle and oracle is None:
                raise ValueError(f"job {job.job_id}: WIIG replays the client's true masks and needs its oracle")
            if mode.kind == "random":
                self.mask_slots.append([("random", -1)] * len(mask_shapes))
                continue
            assert mode.init is not None
            gradient = job.gradient if job.plan is None else None  # an update is no gradient (analytical init)
            init = mode.init(
                MaskContext(mask_shapes, self.p, attack.mask_init, model, gradient, oracle, gen, self.mask_rates)
            )
            kind = "learn" if mode.kind == "learn" else "const"
            rows = learn_rows if kind == "learn" else const_rows
            self.mask_slots.append([(kind, len(rows[layer])) for layer in range(len(init))])
            for layer, m in enumerate(init):
                rows[layer].append(m)
        pixels, batch = int(torch.Size(first.spec.input_shape).numel()), first.batch_size
        self.register_buffer(
            "span_bases",
            torch.stack([s.float() if s is not None else torch.zeros(pixels, batch) for s in spans]),
            persistent=False,
        )
        self.register_buffer("spanned", torch.tensor([s is not None for s in spans]), persistent=False)
        starts = torch.stack(images)
        self.register_buffer("held", torch.stack(held), persistent=False)  # (V, B)
        self.holds = bool(self.held.any())  # known once: no device sync per step
        self.register_buffer("held_images", starts.clone() if self.holds else torch.zeros(0), persistent=False)
        self.image_stack = nn.Parameter(self.hold(self.in_span(starts, self.spanned)))
        self.mask_stacks = nn.ParameterList(
            nn.Parameter(torch.stack(r) if r else torch.zeros(0, *shape)) for r, shape in zip(learn_rows, mask_shapes)
        )
        for i, (r, shape) in enumerate(zip(const_rows, mask_shapes)):
            self.register_buffer(f"const_stack_{i}", torch.stack(r) if r else torch.zeros(0, *shape), persistent=False)
        # per layer, the job of each learned row (rows were added in job order)
        self.learn_jobs = [
            [j for j in range(len(jobs)) if self.mask_slots[j][i][0] == "learn"] for i in range(len(mask_shapes))
        ]
        # Adam's moments and the best iterates are persistent: a resumed run continues them.
        self.register_buffer("adam_m_images", torch.zeros_like(self.image_stack))
        self.register_buffer("adam_v_images", torch.zeros_like(self.image_stack))
        self.register_buffer("best_images", self.image_stack.detach().clone())
        for i, stack in enumerate(self.mask_stacks):
            self.register_buffer(f"adam_m_mask_{i}", torch.zeros_like(stack))
            self.register_buffer(f"adam_v_mask_{i}", torch.zeros_like(stack))
            self.register_buffer(f"best_masks_{i}", stack.detach().clone())
        self.register_buffer("signed", torch.tensor([a.signed_gradients for a in attacks]), persistent=False)
        self.register_buffer("boxed", torch.tensor([a.boxed for a in attacks]), persistent=False)
        self._index_cache: dict[tuple[int, ...], Tensor] = {}

    def in_span(self, stack: Tensor, rows: Tensor) -> Tensor:
        """``stack`` with the dummies of the jobs in ``rows`` (a mask over jobs) projected on their span."""
        if not bool(rows.any()):
            return stack
        flat = stack.reshape(stack.shape[0], stack.shape[1], -1)  # (V, B, pixels)
        bases = self.span_bases.to(flat.dtype)
        projected = torch.bmm(torch.bmm(flat, bases), bases.transpose(1, 2)).reshape(stack.shape)
        return torch.where(_rows_view(rows.to(stack.device), projected), projected, stack)

    def hold(self, stack: Tensor) -> Tensor:
        """``stack`` with the held images (a closed form's exact ones, ``hold_certain``) put back."""
        if not self.holds:
            return stack
        view = self.held.reshape(*self.held.shape, *([1] * (stack.dim() - 2)))
        return torch.where(view, self.held_images, stack)

    def hold_more(self, j: int, images: Tensor, taken: Tensor) -> int:
        """Job j's images where ``taken`` (B,) held from now on at ``images``' values (a closed form's snap):
        its dummies and held values there are set, the rest untouched. Returns how many were newly held."""
        with torch.no_grad():
            new = taken.to(self.held.device) & ~self.held[j]
            if not bool(new.any()):
                return 0
            if not self.holds:  # the first held images of the module: the buffer of their values is made
                self.held_images = self.image_stack.detach().clone()
                self.holds = True
            values = images.to(self.image_stack.device, self.image_stack.dtype)
            view = new.reshape(-1, *([1] * (values.dim() - 1)))
            self.held_images[j] = torch.where(view, values, self.held_images[j])
            self.held[j] |= new
            self.image_stack[j] = torch.where(view, values, self.image_stack[j])
        return int(new.sum())

    # -- reading -----------------------------------------------------------------------------------
    @property
    def images(self) -> list[Tensor]:
        """Job j's dummies: row j of the stacked parameter (a view; in-place edits reach the parameter)."""
        return list(self.image_stack.unbind(0))

    def index(self, rows: list[int]) -> Tensor:
        key = tuple(rows)
        index = self._index_cache.get(key)
        if index is None or index.device != self.image_stack.device:
            if len(self._index_cache) > 64:  # jobs stop one by one: keep only recent subsets
                self._index_cache.clear()
            index = self._index_cache[key] = torch.tensor(rows, device=self.image_stack.device, dtype=torch.long)
        return index

    def rows(self, stack: Tensor, rows: list[int]) -> Tensor:
        """The given rows of a stacked tensor, flattened into one batch (no copy when all rows, in order)."""
        picked = stack if rows == list(range(stack.shape[0])) else stack.index_select(0, self.index(rows))
        return picked.reshape(-1, *stack.shape[2:])

    def mask(self, j: int, layer: int) -> Tensor:
        kind, k = self.mask_slots[j][layer]
        if kind == "learn":
            return self.mask_stacks[layer][k]
        if kind == "const":
            return getattr(self, f"const_stack_{layer}")[k]
        keep = 1.0 - self.mask_rates[layer]
        return torch.bernoulli(torch.full(self.mask_shapes[layer], keep, device=self.box_low.device))

    def layer_masks(self, active: list[int], layer: int) -> Tensor:
        """One dropout layer's masks of the active jobs, job after job, as one batch."""
        kinds = {self.mask_slots[j][layer][0] for j in active}
        if kinds == {"learn"} or kinds == {"const"}:
            stack = self.mask_stacks[layer] if kinds == {"learn"} else getattr(self, f"const_stack_{layer}")
            return self.rows(stack, [self.mask_slots[j][layer][1] for j in active])
        return torch.cat([self.mask(j, layer) for j in active])  # jobs of different kinds in one group

    def learned(self, j: int) -> list[tuple[int, int]]:
        """(layer, row) of each learned mask of job j."""
        return [(i, k) for i, (kind, k) in enumerate(self.mask_slots[j]) if kind == "learn"]

    # -- moving ------------------------------------------------------------------------------------
    def zero_grad_rows(self) -> None:
        """Drop the gradients of the last iteration (all jobs' rows at once)."""
        self.image_stack.grad = None
        for stack in self.mask_stacks:
            stack.grad = None

    def step(self, stepping: list[bool], job_lr: list[float], adam_steps: list[int]) -> None:
        """One Adam step of the stepping jobs' rows after the backward pass: signed data gradients where
        the attack asks, each job's learning rate and step count, then the box on the images and
        [0, 1] on learned masks. Rows of other jobs do not move."""
        step_size, bc2_sqrt = adam_factors(job_lr, adam_steps, stepping)
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
                spanned = moving & self.spanned
                if bool(spanned.any()):  # after the box: the span is certain, the box a prior
                    self.image_stack.copy_(self.in_span(self.image_stack, spanned))
                if self.holds:  # what a closed form pinned down stays
                    self.image_stack.copy_(self.hold(self.image_stack))
            for i, stack in enumerate(self.mask_stacks):
                if stack.grad is None or not self.learn_jobs[i]:
                    continue
                rows = self.index(self.learn_jobs[i])
                adam_rows_(
                    stack,
                    stack.grad,
                    getattr(self, f"adam_m_mask_{i}"),
                    getattr(self, f"adam_v_mask_{i}"),
                    step_size.index_select(0, rows),
                    bc2_sqrt.index_select(0, rows),
                    moving.index_select(0, rows),
                )
                stack.clamp_(0.0, 1.0)

    def keep_best(self, jobs: list[int]) -> None:
        """Record the current dummies and learned masks of ``jobs`` as their best iterate."""
        with torch.no_grad():
            index = self.index(jobs)
            self.best_images.index_copy_(0, index, self.image_stack.detach().index_select(0, index))
            for i, stack in enumerate(self.mask_stacks):
                rows = [self.mask_slots[j][i][1] for j in jobs if self.mask_slots[j][i][0] == "learn"]
                if rows:
                    r = self.index(rows)
                    getattr(self, f"best_masks_{i}").index_copy_(0, r, stack.detach().index_select(0, r))
