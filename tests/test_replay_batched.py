"""The FedAvg replay batched across jobs (attacker.engine.replay_lowrank): its match terms and their
gradients w.r.t. the dummy images and the learned masks equal the one-job replay's, and the dispatch
takes it only where it applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from attacker.engine import replay_lowrank
from attacker.engine.replay import replay_terms
from attacker.engine.replay_lowrank import (
    batched_replay_applies,
    linear_chain,
    lowrank_replay_terms,
    one_job_loop,
)
from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule, run_local_round
from fedsim.models import MaskedDropout, build_model

WIDTH, V = 24, 3


def _setup(steps: int, b: int, momentum: float, dtype: torch.dtype, bias: bool = False, pruned: bool = True):
    """An MLP, V jobs of steps·b images, their captured updates (one pruned, or none), learnable masks."""
    model = build_model("mlp", "mnist", 0.25, seed=0, width=WIDTH, bias=bias).to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    plan = LocalPlan(Schedule(batch_size=b, order="in-order"), OptimizerSpec("sgd", 0.2, momentum=momentum))
    names = [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(3)
    n = steps * b
    images, labels, masks, targets = [], [], [], []
    for j in range(V):
        y = torch.randint(0, 10, (n,), generator=g)
        truth = torch.randn(n, 1, 28, 28, generator=g, dtype=dtype)
        update = run_local_round(model, TensorDataset(truth, y), LocalPlan(plan.schedule, plan.optimizer, seed=j))
        targets.append([update.update[k] for k in names])
        images.append(torch.randn(n, 1, 28, 28, generator=g, dtype=dtype).requires_grad_(True))
        labels.append(y)
        step_masks = lambda: [torch.rand(b, WIDTH, generator=g, dtype=dtype).requires_grad_(True) for _ in range(3)]  # noqa: E731
        masks.append([step_masks() for _ in range(steps)])
    supports: list[list[torch.Tensor] | None] = [None] * V
    if not pruned:
        return model, plan, images, labels, masks, targets, None
    supports[1] = [(torch.rand(t.shape, generator=g) < 0.3).to(dtype) for t in targets[1]]  # a pruned capture
    targets[1] = [t * s for t, s in zip(targets[1], supports[1])]
    return model, plan, images, labels, masks, targets, supports


def _loss_and_grads(terms, images, masks):
    """A cosine distance per job (summed over jobs), and its gradient w.r.t. every dummy and mask."""
    cosine = terms.dot.sum(0) / (terms.norm2.sum(0) * terms.target_norm2.sum(0)).sqrt()
    loss = (1 - cosine).sum()
    leaves = [*images, *(m for job in masks for step in job for m in step)]
    return loss, torch.autograd.grad(loss, leaves)


def _as_rows(targets: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """The targets as rows of one stacked tensor per parameter, as the matcher holds them."""
    stacked = [torch.stack(per_job) for per_job in zip(*targets)]
    return [[t[j] for t in stacked] for j in range(len(targets))]


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("steps,b", [(1, 1), (1, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("layout", ["pruned", "rows"])
def test_batched_replay_equals_the_one_job_loop(layout, steps, b, momentum, dtype, rtol):
    """pruned: loose target tensors, one job's capture pruned (Δ built and cut); rows: the targets as
    rows of stacked tensors, as the matcher passes them (their low-rank factors are cached)."""
    model, plan, images, labels, masks, targets, supports = _setup(steps, b, momentum, dtype, pruned=layout == "pruned")
    if layout == "rows":
        targets = _as_rows(targets)
    start = dict(model.named_parameters())
    assert batched_replay_applies(model, plan, images, masks)
    with one_job_loop():
        assert not batched_replay_applies(model, plan, images, masks)
        loop = replay_terms(model, start, plan, images, labels, masks, targets, supports)
    batched = lowrank_replay_terms(model, start, plan, images, labels, masks, targets, supports)
    if layout == "rows":  # the first layers' targets (rank ≤ K·b) took the factored path
        assert any(entry[2] is not None for entry in replay_lowrank._TARGETS.values())
    assert batched.names == loop.names and batched.dot.shape == loop.dot.shape == (4, V)
    for a, e in [(batched.dot, loop.dot), (batched.norm2, loop.norm2), (batched.target_norm2, loop.target_norm2)]:
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * float(e.detach().abs().max()))
    loss_b, grads_b = _loss_and_grads(batched, images, masks)
    loss_l, grads_l = _loss_and_grads(loop, images, masks)
    torch.testing.assert_close(loss_b, loss_l, rtol=rtol, atol=0)
    if layout == "rows" and dtype == torch.float32:
        rtol = 1e-4  # float32 factors of the targets: the one-step factored path's tolerance (test_factored_targets)
    for a, e in zip(grads_b, grads_l):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * float(e.abs().max()) + 1e-30)


def test_cached_factors_serve_a_subset_of_jobs():
    model, plan, images, labels, masks, targets, _ = _setup(4, 1, 0.0, torch.float64, pruned=False)
    start, rows = dict(model.named_parameters()), _as_rows(targets)
    full = lowrank_replay_terms(model, start, plan, images, labels, masks, rows)
    assert replay_lowrank._TARGETS, "no target was cached"
    pick = [0, 2]
    subset = lowrank_replay_terms(model, start, plan, *([x[j] for j in pick] for x in (images, labels, masks, rows)))
    torch.testing.assert_close(subset.dot, full.dot[:, pick], rtol=1e-12, atol=0)
    torch.testing.assert_close(subset.target_norm2, full.target_norm2[:, pick], rtol=1e-12, atol=0)
    before = full.target_norm2[0, 0].item()
    rows[0][0]._base.mul_(2.0)  # changed in place: the cache must not serve the old values
    again = lowrank_replay_terms(model, start, plan, images, labels, masks, rows)
    assert again.target_norm2[0, 0].item() == pytest.approx(4 * before)


def test_bias_and_the_dispatch_agree_with_the_loop():
    """A Linear with a bias, and replay_terms itself (which dispatches to the batched path)."""
    model, plan, images, labels, masks, targets, _ = _setup(4, 1, 0.9, torch.float64, bias=True)
    start = dict(model.named_parameters())
    with one_job_loop():
        loop = replay_terms(model, start, plan, images, labels, masks, targets)
    dispatched = replay_terms(model, start, plan, images, labels, masks, targets)
    for a, e in [(dispatched.dot, loop.dot), (dispatched.norm2, loop.norm2)]:
        torch.testing.assert_close(a, e, rtol=1e-10, atol=0)
    _, grads_b = _loss_and_grads(dispatched, images, masks)
    _, grads_l = _loss_and_grads(loop, images, masks)
    for a, e in zip(grads_b, grads_l):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10 * float(e.abs().max()))


def test_the_dispatch_refuses_what_it_cannot_batch():
    model, plan, images, labels, masks, _, _ = _setup(4, 1, 0.0, torch.float32)
    assert linear_chain(model) is not None
    adam = LocalPlan(plan.schedule, OptimizerSpec("adam", 1e-3))
    assert not batched_replay_applies(model, adam, images, masks)
    lenet = build_model("lenet", "mnist", 0.25, seed=0)
    assert linear_chain(lenet) is None and not batched_replay_applies(lenet, plan, images, masks)
    assert not batched_replay_applies(build_model("vit", "mnist", 0.25, seed=0, depth=1), plan, images, masks)
    # jobs of different sizes step through different batches; a missing step's masks: the loop says why
    assert not batched_replay_applies(model, plan, [images[0], images[1][:2]], masks[:2])
    assert not batched_replay_applies(model, plan, images, [job[:3] for job in masks])
    narrow = [[[m[:, :1] for m in step] for step in job] for job in masks]  # would broadcast if concatenated
    assert not batched_replay_applies(model, plan, images, narrow)
    # one dropout placed twice in a Sequential: children() lists it once, so the chain would miss a call
    drop = MaskedDropout(0.25)
    twice = nn.Sequential(nn.Flatten(), nn.Linear(784, 8), drop, nn.Linear(8, 8), drop, nn.Linear(8, 10))
    assert linear_chain(twice) is None
    assert linear_chain(nn.Sequential(*[m if m is not drop else MaskedDropout(0.25) for m in twice])) is not None


def test_bench_prints_the_fedavg_rows(capsys):
    from attack_throughput import main  # benchmarks/ is on the test path

    args = ["--models", "fedavg", "--fedavg-jobs", "2", "--fedavg-steps", "2", "--iterations", "1", "--repeats", "1"]
    rows = main(args)
    assert [r["path"] for r in rows] == ["sgd-loop", "sgd-batch", "adam-loop", "adam-batch"]
    assert all(r["rate"] > 0 and r["V"] == 2 for r in rows)
    assert "low-rank, all jobs at once" in capsys.readouterr().out
