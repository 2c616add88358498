"""DP-SGD on the client (``--defense dp-sgd``), with Opacus' own parts.

Unlike the other defenses (Flower mods on the reply, ``fedsim.defenses``), DP-SGD lives *inside* the
client's local round: each step's gradient is the sum of per-example gradients, each clipped to
``clip-norm``, plus Gaussian noise of std ``noise_multiplier * clip-norm``, divided by the expected
batch size. ``fedsim.client_step.run_local_round`` asks :class:`DpSgdStep` for that gradient when its
plan carries a :class:`DpSgdSpec` and otherwise runs unchanged, so the optimizer arithmetic (SGD, Adam)
is the project's one implementation in both cases.

Opacus does the work: ``GradSampleModule`` computes the per-example gradients (it hooks the layers that
have parameters; the project's ``MaskedDropout`` has none and multiplies each example by its own mask,
so the per-example gradients of the layers after it are exact: tested), ``DPOptimizer.pre_step`` clips,
adds the noise, scales and calls the accountant's hook, ``UniformWithReplacementSampler`` draws the
Poisson batches and ``RDPAccountant`` composes the steps. A ClientApp is stateless between rounds, so
the accountant's history travels in the client's ``context.state`` (:func:`load_accountant`,
:func:`save_accountant`) and the epsilon composes over every round the client takes part in.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedsim.capture_kinds import CAPTURE_KINDS
from fedsim.capture_rounds import parse_capture_rounds
from fedsim.models import set_masks

STATE_KEY = "dp-sgd"  # the ConfigRecord of the client's context.state that holds the accountant's history
NOISE_SOURCES = ("epsilon", "noise-multiplier", "none")


class DpSgdError(ValueError):
    """A DP-SGD configuration that cannot give the guarantee it names."""


@dataclass(frozen=True)
class DpSgdSpec:
    """How one local round runs DP-SGD."""

    max_grad_norm: float  # per-example L2 clipping norm (C)
    noise_multiplier: float  # noise std as a multiple of C; 0: clipping only (no guarantee)
    sample_rate: float  # q, told to the accountant for each step
    poisson: bool = True  # Poisson-sampled batches (Opacus' sampler); False: the plan's own batches
    expected_batch_size: int = 0  # the divisor of the noised sum; 0: each batch's own size

    def __post_init__(self) -> None:
        if not self.max_grad_norm > 0:
            raise DpSgdError(f"dp-sgd: the max grad norm (clip-norm) must be > 0, got {self.max_grad_norm}")
        if self.noise_multiplier < 0:
            raise DpSgdError(f"dp-sgd: the noise multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise DpSgdError(f"dp-sgd: the sample rate must be in (0, 1], got {self.sample_rate}")


# -- the model ----------------------------------------------------------------------------------------


def model_problems(model: nn.Module) -> list[str]:
    """What Opacus cannot train with per-example gradients in ``model`` (empty: nothing)."""
    from opacus.validators import ModuleValidator

    return [str(err).strip().splitlines()[0] for err in ModuleValidator.validate(model, strict=False)]


def fix_model(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` converted by Opacus' ``ModuleValidator.fix`` (BatchNorm becomes GroupNorm, ...), and
    what changed, one line per replaced module."""
    from opacus.validators import ModuleValidator

    before = {name: type(m).__name__ for name, m in model.named_modules()}
    fixed = ModuleValidator.fix(model)
    after = {name: type(m).__name__ for name, m in fixed.named_modules()}
    changes = [f"{name}: {kind} -> {after[name]}" for name, kind in before.items() if after.get(name, kind) != kind]
    return fixed, changes


# -- the step -----------------------------------------------------------------------------------------


def poisson_batches(n: int, sample_rate: float, steps: int, seed: int) -> list[list[int]]:
    """``steps`` Poisson-sampled index batches of ``n`` images (each image in each batch with
    probability ``sample_rate``; batches may be empty), drawn by Opacus' sampler from a seeded generator."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    sampler = UniformWithReplacementSampler(
        num_samples=n, sample_rate=sample_rate, generator=torch.Generator().manual_seed(seed), steps=steps
    )
    return [[int(i) for i in batch] for batch in sampler]


class DpSgdStep:
    """The DP-SGD gradient of one step, for ``run_local_round``.

    The model's own parameters receive each step's weights (Opacus' hooks read per-example gradients
    from real module parameters, not from ``functional_call``'s substitutes); :meth:`close` removes the
    hooks and puts the model's parameters back."""

    def __init__(self, model: nn.Module, spec: DpSgdSpec, accountant: Any | None = None) -> None:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self.model = model
        self.spec = spec
        self.saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        # Loss summed over the batch: per-example gradients as they are, and an empty Poisson batch
        # (possible) gives zero gradients rather than the NaN of a mean over nothing.
        self.module = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = DPOptimizer(
            torch.optim.SGD(params, lr=0.0),  # never stepped: the project's update rule steps the weights
            noise_multiplier=spec.noise_multiplier,
            max_grad_norm=spec.max_grad_norm,
            expected_batch_size=max(spec.expected_batch_size, 1),
            loss_reduction="mean",  # divide the noised sum by the expected batch size
        )
        if accountant is not None:
            self.optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(spec.sample_rate))

    def gradients(self, weights: Mapping[str, Tensor], images: Tensor, labels: Tensor) -> tuple[float, list[Tensor]]:
        """The mean loss of the batch and the DP-SGD gradient at ``weights``, in named_parameters order."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(weights[name])
        if not self.spec.expected_batch_size:
            self.optimizer.expected_batch_size = max(len(labels), 1)
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.module(images), labels, reduction="sum")
        with warnings.catch_warnings():  # the images need no gradient, which torch's full backward hook notes
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        self.optimizer.pre_step()  # clip per example, add noise, scale, tell the accountant
        grads = [
            p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()
        ]
        return float(loss.detach()) / max(len(labels), 1), grads

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.module.remove_hooks()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.saved[name])
                for attr in ("grad_sample", "summed_grad", "_forward_counter"):
                    if hasattr(p, attr):
                        delattr(p, attr)


# Opacus' flat clipping (DPOptimizer.clip_and_accumulate): each example's factor is
# min(1, C / (||g_i|| + 1e-6)), the norm over all parameters of that example.
CLIP_EPS = 1e-6


def clipped_gradients(
    model: nn.Module,
    params: Mapping[str, Tensor],
    images: Tensor,
    labels: Tensor,
    masks: Sequence[Tensor] | None,
    spec: DpSgdSpec,
    create_graph: bool = False,
) -> tuple[Tensor, list[Tensor]]:
    """DP-SGD's gradient of one step without its noise, by plain autograd (the attacker's replay:
    the graph is kept with ``create_graph``): the mean loss of the batch and, in named_parameters
    order, sum_i min(1, C / (||g_i|| + 1e-6)) g_i / (expected batch size, or the batch's own size),
    as Opacus' ``DPOptimizer.pre_step`` computes it with noise 0.

    Per-example gradients come from a loop over the examples (batches are small), each with its own
    rows of the dropout ``masks`` (per step, per layer, batch-first, as the client recorded them), so
    the dropout layer runs in whatever mode the model is in (learn, replay, off)."""
    names = [n for n, _ in model.named_parameters()]
    inputs = [params[n] for n in names]
    b = len(labels)
    divisor = float(spec.expected_batch_size or max(b, 1))
    total: list[Tensor] = [torch.zeros_like(p) for p in inputs]
    losses: list[Tensor] = []
    try:
        for i in range(b):
            if masks:
                set_masks(model, [m[i : i + 1] for m in masks])
            loss = F.cross_entropy(functional_call(model, dict(params), (images[i : i + 1],)), labels[i : i + 1])
            grads = torch.autograd.grad(loss, inputs, create_graph=create_graph, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, inputs)]
            # the same reduction as Opacus: a norm per parameter, then the norm of those norms
            norm = torch.stack([g.reshape(-1).norm(2) for g in grads]).norm(2)
            factor = (spec.max_grad_norm / (norm + CLIP_EPS)).clamp(max=1.0)
            total = [acc + factor * g for acc, g in zip(total, grads)]
            losses.append(loss)
    finally:
        if masks:
            set_masks(model, list(masks))  # the whole batch's masks back, as set_masks left them
    mean_loss = torch.stack(losses).mean() if losses else torch.zeros(())
    return mean_loss, [g / divisor for g in total]


# -- the configuration and the accountant -------------------------------------------------------------


def sample_rate(cfg: Mapping[str, Any], n: int) -> float:
    """q = batch size / the client's data size (Poisson sampling's expected batch over the data)."""
    return int(cfg["batch-size"]) / max(n, 1)


def steps_per_round(cfg: Mapping[str, Any], n: int) -> int:
    """The local steps of one training round: ``local-steps``, else the epochs' batches of ``n`` images."""
    if int(cfg["local-steps"]) > 0:
        return int(cfg["local-steps"])
    return int(cfg["local-epochs"]) * math.ceil(n / int(cfg["batch-size"]))


def check_config(cfg: Mapping[str, Any], n: int) -> str | None:
    """Why DP-SGD cannot run with ``cfg`` on a client of ``n`` images, or None."""
    delta, q = float(cfg["dp-delta"]), sample_rate(cfg, n)
    if q > 1:
        return f"dp-sgd: batch-size {cfg['batch-size']} exceeds the client's {n} images (sample rate {q:g} > 1)"
    if delta >= 1 / n:
        return (
            f"dp-sgd: dp-delta {delta:g} >= 1/{n} (1 / the client's data size): such a delta allows leaking "
            "one example in clear; use a smaller dp-delta"
        )
    if float(cfg["clip-norm"]) <= 0:
        return f"dp-sgd: clip-norm must be > 0, got {cfg['clip-norm']}"
    return None


def capture_round_count(cfg: Mapping[str, Any]) -> int:
    """How many of the ``num-server-rounds`` rounds the curious server captures (``capture-rounds``)."""
    rounds = int(cfg["num-server-rounds"])
    chosen = parse_capture_rounds(cfg["capture-rounds"])
    if chosen == "all":
        return rounds
    return sum(1 for r in chosen if 1 <= r <= rounds)


def capture_steps(cfg: Mapping[str, Any], n: int) -> int | None:
    """The local steps of a capture round when it runs fixed batches (a victim set: accounted at
    q = 1), or None when it runs like a training round (an update capture of the whole partition,
    ``capture-images`` 0: Poisson batches). A one-step round (``capture-kind`` gradient) is one step;
    an update capture of N = ``capture-images`` images runs the round's schedule on them: ``local-steps``,
    else ``local-epochs`` x ceil(N / batch-size) (``fedsim.client_step.Schedule``)."""
    if CAPTURE_KINDS[str(cfg["capture-kind"])].one_step_gradient:
        return 1
    images = int(cfg["capture-images"])
    if images <= 0:
        return None
    if int(cfg["local-steps"]) > 0:
        return int(cfg["local-steps"])
    return int(cfg["local-epochs"]) * math.ceil(min(images, max(n, 1)) / int(cfg["batch-size"]))


def privacy_schedule(cfg: Mapping[str, Any], n: int) -> list[tuple[float, int]]:
    """Every step a client of ``n`` images takes over the whole run, as the accountant is told them:
    (sample rate, steps) pairs. Training rounds run Poisson batches at q = B / n; capture rounds on a
    victim set run fixed batches, told to the accountant as q = 1 (no amplification). Every round is
    counted, as if the client were sampled in each (with ``fraction-train`` < 1 a client spends less)."""
    rounds = int(cfg["num-server-rounds"])
    captured = capture_round_count(cfg)
    fixed = capture_steps(cfg, n) if captured else None
    training_rounds = rounds if fixed is None else rounds - captured
    schedule = [(sample_rate(cfg, n), training_rounds * steps_per_round(cfg, n))]
    if fixed is not None:
        schedule.append((1.0, captured * fixed))
    return [(q, steps) for q, steps in schedule if steps > 0]


# Opacus' search (opacus.accountants.utils.get_noise_multiplier), over a schedule of several sample rates.
EPSILON_TOLERANCE = 0.01
MAX_SIGMA = 1e6


def calibrate_noise(target_epsilon: float, delta: float, schedule: Sequence[tuple[float, int]]) -> float:
    """The smallest noise multiplier (to Opacus' tolerance) whose RDP epsilon over ``schedule``
    ((sample rate, steps) pairs, one noise multiplier for all) stays at or below ``target_epsilon``:
    Opacus' own ``get_noise_multiplier`` search (double, then bisect until the epsilon is within 0.01
    below the target), with the accountant's history holding every part of the schedule. With one
    part it is ``get_noise_multiplier`` exactly."""
    accountant = new_accountant()

    def spent(sigma: float) -> float:
        accountant.history = [(sigma, q, steps) for q, steps in schedule]
        return float(accountant.get_epsilon(delta=delta))

    eps_high, sigma_low, sigma_high = math.inf, 0.0, 10.0
    while eps_high > target_epsilon:
        sigma_high = 2 * sigma_high
        eps_high = spent(sigma_high)
        if sigma_high > MAX_SIGMA:
            raise DpSgdError(f"dp-sgd: the target epsilon {target_epsilon:g} is too low for this schedule")
    while target_epsilon - eps_high > EPSILON_TOLERANCE:
        sigma = (sigma_low + sigma_high) / 2
        eps = spent(sigma)
        if eps < target_epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high


def noise_multiplier(cfg: Mapping[str, Any], n: int) -> float:
    """The noise multiplier the run config asks for: fixed (``noise-multiplier``), none (clipping
    only), or the smallest that keeps the whole run within ``dp-epsilon`` at ``dp-delta``: every round
    the client may take part in (num-server-rounds), the training rounds' local steps at q = B / n and
    the capture rounds' fixed batches at q = 1 (:func:`privacy_schedule`), searched as Opacus'
    ``get_noise_multiplier`` does (:func:`calibrate_noise`)."""
    source = str(cfg["dp-noise-from"])
    if source == "none":
        return 0.0
    if source == "noise-multiplier":
        return float(cfg["noise-multiplier"])
    return calibrate_noise(float(cfg["dp-epsilon"]), float(cfg["dp-delta"]), privacy_schedule(cfg, n))


def spec_from_config(cfg: Mapping[str, Any], n: int, *, fixed_batches: bool = False) -> DpSgdSpec:
    """The DP-SGD of a round of a client holding ``n`` images. A capture round on a victim set
    (``fixed_batches``) runs its fixed batches, not Poisson samples: the accountant is told so
    (sample rate 1, no amplification); the noise multiplier is the training rounds' one."""
    problem = check_config(cfg, n)
    if problem:
        raise DpSgdError(problem)
    z = noise_multiplier(cfg, n)
    if fixed_batches:
        return fixed_batch_spec(cfg, z)
    return DpSgdSpec(
        float(cfg["clip-norm"]), z, sample_rate(cfg, n), poisson=True, expected_batch_size=int(cfg["batch-size"])
    )


def fixed_batch_spec(cfg: Mapping[str, Any], z: float) -> DpSgdSpec:
    """A round on fixed batches (a capture round's victim set): each step divides by its own batch
    size. The attacker's replay of a dp-sgd update takes this with z = 0: the noise stays in the target."""
    return DpSgdSpec(float(cfg["clip-norm"]), z, 1.0, poisson=False)


def new_accountant() -> Any:
    from opacus.accountants import RDPAccountant

    return RDPAccountant()


def load_accountant(state: Any) -> Any:
    """The client's accountant, from its Flower ``context.state`` (a RecordDict): a fresh one in its first round."""
    accountant = new_accountant()
    if STATE_KEY in state:
        history = json.loads(str(state[STATE_KEY]["history"]))
        accountant.history = [(float(z), float(q), int(k)) for z, q, k in history]
    return accountant


def save_accountant(state: Any, accountant: Any) -> None:
    """Keep the accountant's history (noise multiplier, sample rate, steps) in the client's ``context.state``."""
    from flwr.app import ConfigRecord

    state[STATE_KEY] = ConfigRecord({"history": json.dumps([list(h) for h in accountant.history])})


def epsilon(accountant: Any, delta: float) -> float:
    """The epsilon spent so far at ``delta`` (inf with clipping only; 0 before any step)."""
    if not accountant.history:
        return 0.0
    if any(z == 0 for z, _, _ in accountant.history):
        return math.inf
    return float(accountant.get_epsilon(delta))


def privacy_summary(cfg: Mapping[str, Any], client_epsilon: Mapping[int, Mapping[int, float]]) -> dict[str, Any]:
    """The run's ``privacy`` entry under dp-sgd: the epsilon each client reported after its last round
    (``client_epsilon``: round -> partition -> epsilon), and the largest, which is the run's guarantee."""
    last: dict[int, float] = {}
    for rnd in sorted(client_epsilon):
        last.update(client_epsilon[rnd])
    worst = max(last.values()) if last else None
    return {
        "defense": "dp-sgd",
        "delta": float(cfg["dp-delta"]),
        "clip_norm": float(cfg["clip-norm"]),
        "noise_from": str(cfg["dp-noise-from"]),
        "target_epsilon": float(cfg["dp-epsilon"]) if cfg["dp-noise-from"] == "epsilon" else None,
        "guarantee": "client",
        "accountant": "opacus RDPAccountant (Poisson sampling in training rounds; capture rounds: q = 1)",
        "accountant_name": "opacus RDPAccountant",  # the name alone, for a sentence (attacker audit)
        "epsilon": worst,
        "per_client": {str(k): v for k, v in sorted(last.items())},
        "per_round": {str(r): max(v.values()) for r, v in sorted(client_epsilon.items()) if v},
    }
