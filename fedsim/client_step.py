"""One client step: a client's local training for one round, from a description of it.

Every place that needs "what a client does in a round" calls :func:`run_local_round`: the ClientApp
(training rounds and one-step capture rounds), the offline victim simulation (``attacker.jobs``),
and the experiments through those. A round is described by a :class:`LocalPlan`: the schedule
(epochs, batch size, step cap, batch order), the optimizer (SGD, SGD with momentum, Adam), the
dropout behaviour per step (sample and record, replay given masks, learnable masks, off). The result
holds the new weights, the update (global - local) and the ground truth of every step (its image
indices and masks). Under FedProx (``LocalPlan.proximal_mu`` > 0) each step's gradient also holds the
proximal term's, mu·(w − w_global), whatever the optimizer. Defenses are not applied here: they are
Flower mods and strategy wrappers around the ClientApp and the strategy (``fedsim.defenses``), so each
is applied once, on the reply.

Why the optimizer updates are written here rather than taken from ``torch.optim``: an attacker
replays the client's steps *differentiably* (through the updates, with learnable masks), and
torch.optim steps parameters in place. The functions below use the same tensor operations as
torch.optim's single-tensor (CPU default) code paths, out of place, so the client's result is
bit-identical to torch.optim's (tested against it) and the same code serves the replay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fedsim.dp_sgd import DpSgdSpec, DpSgdStep, clipped_gradients, poisson_batches
from fedsim.models import DropoutMode, get_recorded_masks, set_dropout_mode, set_masks

DROPOUT_BEHAVIOURS = ("sample", "replay", "learn", "off")
BATCH_ORDERS = ("shuffled", "in-order")


class LocalPlanError(ValueError):
    """A local round that cannot be run as described."""


@dataclass(frozen=True)
class Schedule:
    """Which images each local step uses."""

    epochs: int = 1
    batch_size: int = 0  # 0: the whole local set as one batch
    max_steps: int = 0  # > 0: stop after this many steps, across epochs
    order: str = "shuffled"  # shuffled: a fresh permutation per epoch (seeded); in-order

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 0 or self.max_steps < 0:
            raise LocalPlanError(f"schedule needs epochs >= 1, batch_size >= 0, max_steps >= 0; got {self}")
        if self.order not in BATCH_ORDERS:
            raise LocalPlanError(f"batch order must be one of {BATCH_ORDERS}, got {self.order!r}")

    def batches(self, n: int, seed: int) -> list[list[int]]:
        """The index batches of every step, in order. Drawn by torch's own DataLoader sampler with a
        generator seeded by ``seed``, so the global RNG (the dropout masks) is left untouched."""
        if n < 1:
            raise LocalPlanError("the client has no local data")
        loader = DataLoader(
            range(n),
            batch_size=self.batch_size or n,
            shuffle=self.order == "shuffled",
            generator=torch.Generator().manual_seed(seed),
        )
        out: list[list[int]] = []
        for _ in range(self.epochs):
            for batch in loader:
                out.append([int(i) for i in batch])
                if 0 < self.max_steps <= len(out):
                    return out
        return out


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "sgd"  # a name in CLIENT_OPTIMIZERS: sgd (momentum 0: plain SGD) | adam
    lr: float = 1e-3
    momentum: float = 0.0  # only an optimizer that takes momentum (SGD)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam only; torch's defaults
    eps: float = 1e-8

    def __post_init__(self) -> None:
        # The table itself, not the import-time OPTIMIZERS: an entry added later is an optimizer too.
        if self.name not in CLIENT_OPTIMIZERS:
            raise LocalPlanError(f"optimizer must be one of {tuple(CLIENT_OPTIMIZERS)}, got {self.name!r}")
        if not self.lr >= 0:
            raise LocalPlanError(f"lr must be >= 0, got {self.lr}")
        if self.momentum < 0 or (self.momentum and not self.algorithm.takes_momentum):
            with_momentum = ", ".join(n for n, o in CLIENT_OPTIMIZERS.items() if o.takes_momentum)
            raise LocalPlanError(
                f"momentum must be >= 0 and only with {with_momentum}, got {self.momentum} for {self.name}"
            )

    @property
    def algorithm(self) -> ClientOptimizer:
        """The optimizer's entry in ``CLIENT_OPTIMIZERS``: its update and what the replay knows of it."""
        return CLIENT_OPTIMIZERS[self.name]


@dataclass(frozen=True)
class LocalPlan:
    """A client's local round, as a description."""

    schedule: Schedule = field(default_factory=Schedule)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    dropout: str = "sample"  # sample (and record) | replay | learn | off
    masks: Sequence[Sequence[Tensor]] | None = None  # per step, per dropout layer: for replay and learn
    float64_weights: bool = False  # keep the weights in float64 between steps (exact (global - local)/lr)
    record_masks: bool = True  # with dropout "sample": keep each step's masks (the audit's ground truth)
    keep_gradients: bool = False  # record each step's parameter gradient
    differentiable: bool = False  # keep the graph through every step (the attacker's replay)
    seed: int = 0  # batch order and sampled dropout masks
    # Explicit index batches of every step, overriding ``schedule.batches`` (the attacker's unknown-order
    # replay: epoch e's steps run on its own copy of the images, indices e*N + i, in order).
    batches: tuple[tuple[int, ...], ...] | None = None
    # DP-SGD (``--defense dp-sgd``): per-example clipping and noise in every step (fedsim.dp_sgd).
    dp: DpSgdSpec | None = None
    # FedProx (Li et al. 2020): every step's loss gains (mu/2)·||w − w_global||², Flower's "proximal-mu".
    proximal_mu: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.proximal_mu) and self.proximal_mu >= 0):
            raise LocalPlanError(f"proximal mu must be a finite number >= 0, got {self.proximal_mu}")
        if self.dp is not None and self.differentiable and (self.dp.poisson or self.dp.noise_multiplier > 0):
            # The replay clips per example (dp_sgd.clipped_gradients) but adds no noise (the server does
            # not know it) and needs the batches the client ran, which Poisson sampling does not record.
            raise LocalPlanError("a DP-SGD replay needs fixed batches and noise 0 (the noise stays in the target)")
        if self.dropout not in DROPOUT_BEHAVIOURS:
            raise LocalPlanError(f"dropout must be one of {DROPOUT_BEHAVIOURS}, got {self.dropout!r}")
        if self.dropout in ("replay", "learn") and self.masks is None:
            raise LocalPlanError(f"dropout {self.dropout!r} needs the masks of every step")


@dataclass
class StepRecord:
    """The ground truth of one local step."""

    indices: list[int]  # which of the client's images the step used, in batch order
    masks: list[Tensor]  # the dropout masks of the step, in forward order
    loss: float
    gradient: list[Tensor] | None = None  # in model.parameters() order, when kept


@dataclass
class LocalResult:
    weights: dict[str, Tensor]  # the new state dict (float64 parameters with float64_weights)
    update: dict[str, Tensor]  # global - local for floating entries
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def mean_loss(self) -> float:
        return sum(s.loss for s in self.steps) / max(len(self.steps), 1)


# -- optimizer updates (torch.optim's single-tensor arithmetic, out of place) -------------------------

# One parameter's update in one step: (param, grad, state, t) -> the new param (t counts from 1).
UpdateRule = Callable[[Tensor, Tensor, dict, int], Tensor]


def _sgd(spec: OptimizerSpec, differentiable: bool = False) -> UpdateRule:
    def step(param: Tensor, grad: Tensor, state: dict, t: int) -> Tensor:
        if spec.momentum:
            buf = state.get("momentum_buffer")
            buf = grad.clone() if buf is None else torch.add(buf * spec.momentum, grad, alpha=1.0)
            state["momentum_buffer"] = buf
            grad = buf
        return torch.add(param, grad, alpha=-spec.lr)

    return step


def _adam(spec: OptimizerSpec, differentiable: bool = False) -> UpdateRule:
    beta1, beta2 = spec.betas
    # In a replay, a weight whose gradient was exactly 0 so far (a dropped neuron) has v = 0, and the
    # derivative of sqrt at 0 is infinite: the backward pass would turn NaN. The clamp changes no value
    # there (m = 0 too, so the weight does not move) and only zeroes that derivative.
    sqrt = (lambda v: v.clamp_min(1e-30).sqrt()) if differentiable else torch.sqrt

    def step(param: Tensor, grad: Tensor, state: dict, t: int) -> Tensor:
        exp_avg = state.get("exp_avg", torch.zeros_like(param))
        exp_avg_sq = state.get("exp_avg_sq", torch.zeros_like(param))
        exp_avg = torch.lerp(exp_avg, grad, 1 - beta1)
        exp_avg_sq = torch.addcmul(exp_avg_sq * beta2, grad, grad, value=1 - beta2)
        state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
        step_size = spec.lr / (1 - beta1**t)
        denom = sqrt(exp_avg_sq) / ((1 - beta2**t) ** 0.5) + spec.eps
        return torch.addcdiv(param, exp_avg, denom, value=-step_size)

    return step


@dataclass(frozen=True)
class ClientOptimizer:
    """One client optimizer: its update, and what the rest of the tool asks of it (nothing else checks
    an optimizer's name)."""

    update_rule: Callable[[OptimizerSpec, bool], UpdateRule]  # (spec, differentiable) -> one tensor's update
    title: str  # its name in the audit's words
    takes_momentum: bool  # OptimizerSpec.momentum may be > 0 (the run config's momentum is used)
    # The attacker replays it with a smoothed ε first (attacker.engine.replay.annealed_eps): at the client's
    # ε, Adam's first step is ≈ lr·sign(g), which gives the dummies almost no usable gradient.
    smoothed_eps_replay: bool = False
    # An all-Linear model's replay runs all jobs at once in low-rank form (attacker.engine.replay_lowrank):
    # each step moves a weight by a sum of outer products (through a momentum buffer at most); an
    # elementwise step such as Adam's is not of that form.
    lowrank_replay: bool = False
    # One step of it without momentum is Δ = lr·g exactly, so a one-step update is attacked as that
    # gradient (attacker.jobs.exact_as_gradient).
    step_is_gradient: bool = False
    # Each entry's step is its own gradient history over its own scale, but for ε (Adam): an update of one
    # image then keeps the pixels' signs, and ε's share their magnitudes (attacker's adam_eps closed form).
    scale_free_steps: bool = False

    def words(self, momentum: Any = 0) -> str:
        """The optimizer as the audit names it, with its momentum where it takes one: "SGD with momentum 0.9"."""
        if self.takes_momentum and float(momentum or 0) > 0:
            return f"{self.title} with momentum {momentum}"
        return self.title


# A new optimizer is one update function and one entry here: the run config's choices, the momentum
# setting, the attacker's replay and the audit's words follow.
CLIENT_OPTIMIZERS: dict[str, ClientOptimizer] = {
    "adam": ClientOptimizer(_adam, "Adam", takes_momentum=False, smoothed_eps_replay=True, scale_free_steps=True),
    "sgd": ClientOptimizer(_sgd, "SGD", takes_momentum=True, lowrank_replay=True, step_is_gradient=True),
}
OPTIMIZERS = tuple(CLIENT_OPTIMIZERS)


# -- the round -------------------------------------------------------------------------------------


def with_proximal_term(grad: Tensor, weight: Tensor, anchor: Tensor, mu: float) -> Tensor:
    """The gradient of loss + (mu/2)·||w − w_global||² at ``weight``: ``grad + mu·(weight − anchor)``, in
    the weight's dtype. Added to the loss gradient (not through autograd) so the term is the same in
    every path: plain autograd, DP-SGD's per-example clipping (the term holds no data, so it is neither
    clipped nor noised) and the replay, whose graph it joins through ``weight``."""
    grad = grad.to(weight.dtype)
    if not mu:
        return grad
    return grad + mu * (weight - anchor.to(weight.dtype))


def _gather(data: Dataset, indices: list[int]) -> tuple[Tensor, Tensor]:
    if not indices:  # an empty Poisson batch (DP-SGD): no image, shaped like one
        image = torch.as_tensor(data[0][0])
        return image.new_zeros((0, *image.shape)), torch.zeros(0, dtype=torch.long)
    if isinstance(data, TensorDataset):  # fast path: no per-item Python loop
        index = torch.tensor(indices)
        images, labels = data.tensors[0][index], data.tensors[1][index]
        return images, labels.long()
    items = [data[i] for i in indices]
    return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.tensor([int(y) for _, y in items])


def plan_batches(plan: LocalPlan, n: int) -> list[list[int]]:
    """The index batches of every step of ``plan`` on ``n`` images: its explicit batches, else its schedule's."""
    if plan.batches is None:
        batches = plan.schedule.batches(n, plan.seed)
        if plan.dp is not None and plan.dp.poisson:  # as many steps, each a Poisson sample (Opacus' sampler)
            return poisson_batches(n, plan.dp.sample_rate, len(batches), plan.seed)
        return batches
    if not plan.batches or any(not b or min(b) < 0 or max(b) >= n for b in plan.batches):
        raise LocalPlanError(f"explicit batches must be non-empty and index the {n} images")
    return [list(b) for b in plan.batches]


def run_local_round(
    model: nn.Module,
    data: Dataset,
    plan: LocalPlan,
    *,
    start: Mapping[str, Tensor] | None = None,
    accountant: Any | None = None,
) -> LocalResult:
    """Run the client's local round described by ``plan`` on ``data`` (a Dataset of (image, label)).

    The model's parameters are the global weights unless ``start`` gives others (the attacker's
    replay passes tensors in its graph there). The model object itself is not changed, except
    for buffers such as BatchNorm's running statistics, which train as in ``model.train()``.
    With ``plan.dp`` each step's gradient is DP-SGD's (fedsim.dp_sgd) and ``accountant`` (an Opacus
    accountant), when given, is told every step.
    """
    batches = plan_batches(plan, len(data))  # type: ignore[arg-type]
    if plan.masks is not None and len(plan.masks) < len(batches):
        raise LocalPlanError(f"{len(plan.masks)} mask sets for {len(batches)} steps")
    update_rule = plan.optimizer.algorithm.update_rule(plan.optimizer, plan.differentiable)
    names = [n for n, _ in model.named_parameters()]
    global_params = dict(model.named_parameters()) if start is None else dict(start)
    dtype = torch.float64 if plan.float64_weights else None
    weights = {
        n: (global_params[n].detach().to(dtype) if dtype else global_params[n].detach())
        if not plan.differentiable
        else global_params[n]
        for n in names
    }
    states: dict[str, dict] = {n: {} for n in names}
    steps: list[StepRecord] = []
    was_training = model.training
    model.train()
    sample = DropoutMode.RECORD if plan.record_masks else DropoutMode.SAMPLE  # the same random draws
    mode = {"sample": sample, "replay": DropoutMode.REPLAY, "learn": DropoutMode.LEARN, "off": DropoutMode.OFF}[
        plan.dropout
    ]
    set_dropout_mode(model, mode)
    # Copies of the start values first: the DP-SGD step writes each step's weights into the model.
    dp_step = None
    if plan.dp is not None and not plan.differentiable:  # the replay clips by autograd instead (keeps the graph)
        global_params = {k: v.detach().clone() for k, v in global_params.items()}
        dp_step = DpSgdStep(model, plan.dp, accountant)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(plan.seed)  # reproducible dropout masks for a given round and client
            for t, indices in enumerate(batches, start=1):
                images, labels = _gather(data, indices)
                params = {}
                for n in names:
                    p = weights[n]
                    if dtype is not None:
                        p = p.to(global_params[n].dtype)
                    if not plan.differentiable or not p.requires_grad:  # a frozen start: a leaf of its own
                        p = p.detach().requires_grad_(True)
                    params[n] = p
                if plan.masks is not None:
                    set_masks(model, list(plan.masks[t - 1]))
                if dp_step is not None:
                    loss_value, grads = dp_step.gradients(params, images, labels)
                    loss = torch.tensor(loss_value)
                elif plan.dp is not None:
                    step_masks = list(plan.masks[t - 1]) if plan.masks is not None else None
                    loss, grads = clipped_gradients(
                        model, params, images, labels, step_masks, plan.dp, create_graph=plan.differentiable
                    )
                else:
                    loss = F.cross_entropy(functional_call(model, params, (images,)), labels)
                    grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=plan.differentiable)
                if plan.dropout == "sample" and plan.record_masks:
                    masks = [m.clone() for m in get_recorded_masks(model)]
                else:
                    masks = [m.detach().clone() for m in plan.masks[t - 1]] if plan.masks is not None else []
                with torch.set_grad_enabled(plan.differentiable):
                    for n, g in zip(names, grads):
                        g = with_proximal_term(g, weights[n], global_params[n], plan.proximal_mu)
                        weights[n] = update_rule(weights[n], g, states[n], t)
                steps.append(
                    StepRecord(
                        indices,
                        masks,
                        float(loss.detach()),
                        [g.detach() for g in grads] if plan.keep_gradients else None,
                    )
                )
    finally:
        if dp_step is not None:
            dp_step.close()
        set_dropout_mode(model, DropoutMode.AUTO)
        model.train(was_training)
    # Only the replay keeps a graph; the client's own result is plain data.
    start_values = global_params if plan.differentiable else {k: v.detach() for k, v in global_params.items()}
    buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in start_values}
    local = {**buffers, **{n: (w if plan.differentiable else w.detach()) for n, w in weights.items()}}
    update = {k: start_values[k].to(v.dtype) - v for k, v in local.items() if k in start_values}
    local = {k: local[k] for k in model.state_dict()}  # state-dict order
    return LocalResult(local, update, steps)


def one_step_plan(lr: float, *, seed: int = 0, float64: bool = True, keep_gradients: bool = False) -> LocalPlan:
    """The paper's capture round: one plain SGD step on the whole victim batch, in order."""
    return LocalPlan(
        Schedule(epochs=1, batch_size=0, max_steps=1, order="in-order"),
        OptimizerSpec("sgd", lr),
        float64_weights=float64,
        keep_gradients=keep_gradients,
        seed=seed,
    )
