"""The FedAvg replay of an all-Linear model (the MLP family) under SGD, for all jobs at once.

Why it can batch: an SGD step changes a Linear weight by -c·δᵀa, a matrix of rank ≤ b (δ: the
gradient of the step's loss w.r.t. the layer's output rows, a: its input rows). So at step t every
job's weight is the SHARED start W0 plus a job's own low-rank correction:

    W_t = W0 − Σ_{s<t} c_{t,s} δ_sᵀ a_s,   c_{t,s} = lr · Σ_{q=s}^{t-1} μ^{q-s}

(μ = 0: plain SGD, c = lr; with momentum, buf_q = μ·buf_{q-1} + g_q unrolled; FedProx's proximal
gradient prox·(W_q − W0) is itself a combination of the earlier steps' terms, so it only changes the
c_{t,s}: ``_coefficients`` runs the recursion on scalars). A layer's output on
step t is then  a W_tᵀ = a W0ᵀ − Σ_s c_{t,s} (a a_sᵀ) δ_s : the product with W0 is one matrix
product over every job's rows stacked, and each job's correction is a (b × b·(t−1)) product. The δ
of a step come from autograd on the summed per-job losses w.r.t. the layer outputs (the jobs' rows
never mix, so each row's δ is its own job's), with the graph kept for the attacker's backward pass.
The update Δ = W0 − W_{K+1} = Dᵀ A (D: the steps' δ rows scaled by c_{K+1,s}, A: their a rows) is
never built for the match terms: <Δ, Δ*> = Σ((D Δ*) ⊙ A), ||Δ||² = Σ((D Dᵀ) ⊙ (A Aᵀ)). A pruned
capture needs Δ cut to its support, so there Δ is built (per job, as the loop does). Targets the
matcher holds stacked are factored once where they are exactly low-rank (``_cached_targets``).

The arithmetic is the client's (``fedsim.client_step.run_local_round``): mean cross-entropy per
step, the dropout layer's ``x * mask * scale``, torch's SGD momentum; only the summation order
differs, so the terms agree with the one-job replay to float rounding (tests/test_replay_batched.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedsim.client_step import LocalPlan, plan_batches
from fedsim.models.dropout import MaskedDropout
from fedsim.models.mlp import MLP

from .gradients import MatchTerms, factor_targets, useful_rank

# Row-wise activations: applied to every job's rows stacked, each row alone.
ELEMENTWISE = (nn.GELU, nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.ELU, nn.Identity)

_forced_loop = 0  # > 0: replay_terms keeps its one-job loop (tests and the benchmark's baseline)


@contextmanager
def one_job_loop() -> Iterator[None]:
    """Within the block, ``batched_replay_applies`` says no, so ``replay_terms`` runs job by job."""
    global _forced_loop
    _forced_loop += 1
    try:
        yield
    finally:
        _forced_loop -= 1


def linear_chain(model: nn.Module) -> list[nn.Module] | None:
    """The model's layers in forward order when it is a chain this module can replay (the project's
    MLP or an nn.Sequential of Linear, the project's dropout, Flatten and row-wise activations, every
    parameter in a Linear), else None."""
    if type(model) is MLP:
        root: nn.Sequential = model.net
    elif type(model) is nn.Sequential:
        root = model
    else:
        return None  # an unknown forward: its layer order cannot be trusted
    chain: list[nn.Module] = []

    def walk(seq: nn.Sequential) -> bool:
        for m in seq:  # as its forward runs them: a module placed twice comes twice (children() once)
            if type(m) is nn.Sequential:
                if not walk(m):
                    return False
            elif isinstance(m, (nn.Linear, MaskedDropout, *ELEMENTWISE)) or (
                isinstance(m, nn.Flatten) and m.start_dim >= 1
            ):
                chain.append(m)
            else:
                return False
        return True

    if not walk(root) or len({id(m) for m in chain}) != len(chain):  # a layer run twice: not this chain
        return None
    owned = {id(p) for m in chain if isinstance(m, nn.Linear) for p in m.parameters()}
    if any(id(p) not in owned for p in model.parameters()):
        return None
    return chain


def batched_replay_applies(
    model: nn.Module, plan: LocalPlan, images: list[Tensor], masks: list[list[list[Tensor]]]
) -> bool:
    """Whether ``lowrank_replay_terms`` can replay these jobs: an all-Linear chain (``linear_chain``),
    an optimizer whose entry batches its replay low-rank (``ClientOptimizer.lowrank_replay``: SGD, with
    or without momentum; no DP-SGD clipping), and jobs of the same size (so the same step batches)
    with a mask set per step and dropout layer. Anything else is left to the one-job loop."""
    # DP-SGD's per-example clipping scales each example's outer product on its own: not this form.
    if _forced_loop or not plan.optimizer.algorithm.lowrank_replay or plan.dp is not None or not images:
        return False
    chain = linear_chain(model)
    if chain is None:
        return False
    n = images[0].shape[0]
    if any(x.shape != images[0].shape for x in images) or len(masks) != len(images):
        return False
    try:
        batches = plan_batches(plan, n)
    except ValueError:
        return False  # the loop raises the plan's own error
    # Each dropout layer's mask must be exactly its activation's shape (rows of the step, width of the
    # Linear before it): the jobs' masks are concatenated, where a broadcasting shape would not fail.
    widths, features = [], None
    for m in chain:
        if isinstance(m, nn.Linear):
            features = m.out_features
        elif isinstance(m, MaskedDropout):
            widths.append(features)
    return all(
        len(job) >= len(batches)
        and all(
            len(step) == len(widths)
            and all(
                mask.dim() == 2 and mask.shape[0] == len(batch) and width in (None, mask.shape[1])
                for mask, width in zip(step, widths)
            )
            for step, batch in zip(job, batches)
        )
        for job in masks
    )


def _stacked(tensors: list[Tensor]) -> Tensor:
    """The tensors as one (V, ...) tensor: a zero-copy view when they are equally spaced views of one
    storage (the matcher's stacked targets, all jobs active), else a copy. The targets are as large as
    the model per job: a copy every iteration is a sizeable part of the iteration's time."""
    first = tensors[0]
    if len(tensors) > 1 and all(
        t.shape == first.shape
        and t.stride() == first.stride()
        and t.dtype == first.dtype
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for t in tensors
    ):
        step = tensors[1].storage_offset() - first.storage_offset()
        if step > 0 and all(t.storage_offset() == first.storage_offset() + j * step for j, t in enumerate(tensors)):
            return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())
    return torch.stack(tensors)


def _coefficients(plan: LocalPlan, t: int) -> list[float]:
    """c_{t,s} for s = 1 .. t-1: how much of step s's gradient the weights of step t have lost.

    Run as the client's recursion on scalars, one coefficient per earlier step: the weights' offset
    E_t = W_t − W0 = −Σ_s c_{t,s} G_s, the step's gradient G_t + prox·E_t (FedProx's proximal term is
    linear in E_t, so the update stays in the span of the steps' low-rank gradients), SGD momentum's
    buffer, then E_{t+1} = E_t − lr·buffer. Without the term and momentum, c = lr."""
    lr, momentum, prox = plan.optimizer.lr, plan.optimizer.momentum, plan.proximal_mu
    offset: list[float] = []  # E_q's coefficient of each G_s, s < q
    buffer: list[float] = []
    for _ in range(t - 1):  # steps 1 .. t-1
        grad = [prox * e for e in offset] + [1.0]  # G_q + prox·E_q
        buffer = [momentum * b + g for b, g in zip([*buffer, 0.0], grad)]  # torch's first buffer is G_1
        offset = [e - lr * b for e, b in zip([*offset, 0.0], buffer)]
    return [-e for e in offset]


def _scaled(rows: list[Tensor], coefficients: list[float]) -> Tensor:
    """The steps' δ rows, each step's scaled by its coefficient, as (V, R, out)."""
    return torch.cat([c * d for c, d in zip(coefficients, rows)], 1)


def lowrank_replay_terms(
    model: nn.Module,
    start: dict[str, Tensor],
    plan: LocalPlan,
    images: list[Tensor],
    labels: list[Tensor],
    masks: list[list[list[Tensor]]],
    targets: list[list[Tensor]],
    supports: list[list[Tensor] | None] | None = None,
) -> MatchTerms:
    """``replay.replay_terms`` for jobs that ``batched_replay_applies`` accepts, all jobs at once."""
    chain = linear_chain(model)
    assert chain is not None, "check batched_replay_applies first"
    names = [n for n, _ in model.named_parameters()]
    name_of = {id(p): n for n, p in model.named_parameters()}
    linears = [m for m in chain if isinstance(m, nn.Linear)]
    w0 = [start[name_of[id(m.weight)]] for m in linears]
    b0 = [start[name_of[id(m.bias)]] if m.bias is not None else None for m in linears]
    V, n = len(images), images[0].shape[0]
    x, y = torch.stack(images), torch.stack(labels).long()
    batches = plan_batches(plan, n)
    # Per Linear layer, per finished step: its input rows a (V, b, in) and output gradients δ (V, b, out).
    hist_a: list[list[Tensor]] = [[] for _ in linears]
    hist_d: list[list[Tensor]] = [[] for _ in linears]
    for t, indices in enumerate(batches, start=1):
        rows = torch.tensor(indices, device=x.device)
        b = len(indices)
        coef = _coefficients(plan, t)
        step_masks = [torch.cat([job[t - 1][i] for job in masks]) for i in range(len(masks[0][t - 1]))]
        h = x.index_select(1, rows).flatten(0, 1)  # (V·b, ...): the jobs' rows, job-major
        inputs, outputs = [], []
        li = di = 0
        for m in chain:
            if isinstance(m, nn.Linear):
                z = F.linear(h, w0[li], b0[li])  # the shared start: one product for every job
                if t > 1:
                    A, D = torch.cat(hist_a[li], 1), _scaled(hist_d[li], coef)
                    z = z - ((h.view(V, b, -1) @ A.transpose(1, 2)) @ D).flatten(0, 1)
                    if b0[li] is not None:
                        z = z - D.sum(1).repeat_interleave(b, 0)
                if not z.requires_grad:  # nothing learnable upstream (a check with the true images): δ still needed
                    z.requires_grad_(True)
                inputs.append(h)
                outputs.append(z)
                h = z
                li += 1
            elif isinstance(m, MaskedDropout):  # learn mode, as the client's layer computes it
                h = h * step_masks[di] * (1.0 / (1.0 - m.p))
                di += 1
            else:
                h = m(h)
        # each job's loss is the mean over its step's rows (the client's reduction); summed over jobs
        loss = F.cross_entropy(h, y.index_select(1, rows).flatten(), reduction="none").view(V, b).mean(1).sum()
        deltas = torch.autograd.grad(loss, outputs, create_graph=True)
        for li, (a, d) in enumerate(zip(inputs, deltas)):
            hist_a[li].append(a.view(V, b, -1))
            hist_d[li].append(d.view(V, b, -1))
    final = _coefficients(plan, len(batches) + 1)
    pruned = supports is not None and any(s is not None for s in supports)
    dots: list[Tensor | None] = [None] * len(names)
    norms: list[Tensor | None] = [None] * len(names)
    target_norms: list[Tensor | None] = [None] * len(names)
    index = {n: i for i, n in enumerate(names)}
    for li, m in enumerate(linears):
        A, D = torch.cat(hist_a[li], 1), _scaled(hist_d[li], final)  # Δ_weight = Dᵀ A per job
        for key in ("weight", "bias") if m.bias is not None else ("weight",):
            i = index[name_of[id(getattr(m, key))]]
            jobs_targets = [job[i] for job in targets]
            cached = None if pruned else _cached_targets(jobs_targets, key == "weight")
            if cached is not None and cached[0] is not None:  # factored: <Δ, LRᵀ> = Σ((D L) ⊙ (A R))
                (left, right), target_norms[i] = cached
                dots[i] = ((D @ left) * (A @ right)).sum((1, 2))
                norms[i] = _gram_norm2(D, A)
                continue
            target = _stacked(jobs_targets)
            target_norms[i] = cached[1] if cached is not None else (target * target).flatten(1).sum(1)
            if key == "bias":
                delta = D.sum(1)
            elif not pruned and D.shape[1] * (D.shape[2] + A.shape[2]) < D.shape[2] * A.shape[2]:
                dots[i], norms[i] = ((D @ target) * A).sum((1, 2)), _gram_norm2(D, A)  # no weight-sized Δ
                continue
            else:
                delta = D.transpose(1, 2) @ A
            if pruned:
                assert supports is not None
                delta = delta * torch.stack([s[i] if s is not None else torch.ones_like(delta[0]) for s in supports])
            dots[i] = (delta * target).flatten(1).sum(1)
            norms[i] = (delta * delta).flatten(1).sum(1)
    return MatchTerms(torch.stack(dots), torch.stack(norms), torch.stack(target_norms), names)  # type: ignore[arg-type]


def _gram_norm2(D: Tensor, A: Tensor) -> Tensor:
    """||Dᵀ A||² per job from the two (R × R) Gram matrices."""
    return ((D @ D.transpose(1, 2)) * (A @ A.transpose(1, 2))).sum((1, 2))


# Per stacked target tensor (by id, alive while its weak reference is): its in-place version, the
# exact low-rank factors of all its rows (``gradients.factor_targets``, or None) and their squared
# norms. The targets are the same every iteration of an attack; a Linear weight's update is of rank
# ≤ K·b, so its factors turn the dot product into a few (R × k) products instead of two passes over a
# model-sized tensor per job. A float32 client's Δ = W0 − W_K carries the rounding of W0 (~1e-5 of Δ,
# measured on MLP/MNIST K = 4), often past FACTOR_RTOL: such targets stay dense, as they must.
_TARGETS: dict[int, tuple[weakref.ref, int, tuple[Tensor, Tensor] | None, Tensor]] = {}


def _cached_targets(tensors: list[Tensor], weight: bool) -> tuple[tuple[Tensor, Tensor] | None, Tensor] | None:
    """(the jobs' target factors or None, their squared norms) when every target is a row of one
    stacked tensor (the matcher's buffers), cached per that tensor; None for loose tensors."""
    base = tensors[0]._base
    if base is None or base.dim() != tensors[0].dim() + 1 or base.stride(0) == 0:
        return None
    rows = []
    for t in tensors:
        j, rest = divmod(t.storage_offset() - base.storage_offset(), base.stride(0))
        if t._base is not base or rest or not 0 <= j < base.shape[0] or t.shape != base.shape[1:]:
            return None
        if t.stride() != base.stride()[1:]:
            return None
        rows.append(j)
    entry = _TARGETS.get(id(base))
    if entry is None or entry[0]() is not base or entry[1] != base._version:
        with torch.no_grad():
            norms = (base * base).flatten(1).sum(1)
            factors = None
            if weight and base.dim() == 3:
                factors = factor_targets(base, useful_rank(base.shape[1], base.shape[2]))
        key = id(base)
        ref = weakref.ref(base, lambda _ref, key=key: _TARGETS.pop(key, None))
        entry = _TARGETS[key] = (ref, base._version, factors, norms)
    _, _, factors, norms = entry
    if rows == list(range(base.shape[0])):
        return factors, norms
    index = torch.tensor(rows, device=base.device)
    picked = None if factors is None else (factors[0].index_select(0, index), factors[1].index_select(0, index))
    return picked, norms.index_select(0, index)
