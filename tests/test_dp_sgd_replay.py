"""The attacker's replay of a DP-SGD client (``--defense dp-sgd``): per-example clipping replayed
differentiably (fedsim.dp_sgd.clipped_gradients), the noise left in the target, on the fixed batches of
an update capture's victim set. Small: an MLP, N = 8 images, b = 4, K = 2."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from flower_harness import NODE_IDS, FakeGrid, client_context, offline_config, set_task_identity
from flwr.app import ArrayRecord, ConfigRecord
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.data import TensorDataset

from attacker.captures import jobs_from_captures, replay_plan
from attacker.engine.replay import replay_terms
from attacker.jobs import model_from_job
from fedsim import dp_sgd, task
from fedsim.capture import CaptureError, list_captures, load_capture
from fedsim.client_app import handle_train
from fedsim.client_step import LocalPlan, LocalPlanError, OptimizerSpec, Schedule, run_local_round
from fedsim.models import ModelSpec, build_model, set_masks
from fedsim.strategy import CuriousFedAvg

CLIP = 0.5  # below most examples' gradient norm at the MLP's start (asserted)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


def _example_norms(
    model: nn.Module, weights: dict[str, Tensor], x: Tensor, y: Tensor, masks: list[Tensor]
) -> list[float]:
    """||g_i|| over all parameters, example by example, each with its own mask rows."""
    weights = {k: v.detach().requires_grad_(True) for k, v in weights.items()}
    norms = []
    for i in range(len(y)):
        set_masks(model, [m[i : i + 1] for m in masks])
        loss = F.cross_entropy(functional_call(model, weights, (x[i : i + 1],)), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(weights.values()))
        norms.append(math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)))
    return norms


def test_replay_with_the_true_masks_reproduces_the_dp_sgd_update() -> None:
    """Noise off: the differentiable replay (autograd per example, Opacus' clip formula) gives the
    DP-SGD client's update (Opacus' GradSampleModule and DPOptimizer) to float precision, with
    clipping active for most examples, and a finite, non-zero gradient for the dummy images."""
    torch.manual_seed(0)
    model = build_model(ModelSpec("mlp", "mnist", 0.25, 0, {"width": 64}))
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    spec = dp_sgd.DpSgdSpec(CLIP, 0.0, 1.0, poisson=False)
    plan = LocalPlan(Schedule(batch_size=4, max_steps=2, order="in-order"), OptimizerSpec("sgd", 0.1), seed=4, dp=spec)
    client = run_local_round(model, TensorDataset(x, y), plan)
    assert [s.indices for s in client.steps] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    masks = [s.masks for s in client.steps]

    for p in model.parameters():
        p.requires_grad_(False)
    start = dict(model.named_parameters())
    dummies = x.clone().requires_grad_(True)
    replay = replace(plan, dropout="learn", masks=masks, differentiable=True, record_masks=False)
    update = run_local_round(model, TensorDataset(dummies, y), replay, start=start).update
    scale = max(float(v.abs().max()) for v in client.update.values())
    assert scale > 0
    for name, value in client.update.items():
        torch.testing.assert_close(update[name], value, rtol=1e-5, atol=1e-5 * scale)  # float32 sums in another order

    # clipping is active: most examples' gradients exceed the clip norm at the weights of their step
    after_one = run_local_round(
        model, TensorDataset(x, y), replace(replay, schedule=replace(plan.schedule, max_steps=1))
    )
    norms = _example_norms(model, start, x[:4], y[:4], masks[0])
    norms += _example_norms(
        model, {k: v.float() for k, v in after_one.weights.items() if k in start}, x[4:], y[4:], masks[1]
    )
    assert sum(n > CLIP for n in norms) >= 6, norms

    # the dummies receive a usable gradient through the clipping
    target = [v.detach() + 0.01 * torch.randn_like(v) for v in client.update.values()]
    loss = sum(((update[n] - t) ** 2).sum() for n, t in zip(client.update, target))
    (grad,) = torch.autograd.grad(loss, dummies)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0


def test_a_replay_with_noise_or_poisson_batches_is_refused() -> None:
    schedule = Schedule(batch_size=4, max_steps=2)
    for spec in (dp_sgd.DpSgdSpec(1.0, 1.1, 1.0, poisson=False), dp_sgd.DpSgdSpec(1.0, 0.0, 0.5, poisson=True)):
        with pytest.raises(LocalPlanError, match="fixed batches and noise 0"):
            LocalPlan(schedule, differentiable=True, dp=spec)


def _dp_captured_round(tmp_path: Path, **overrides: Any) -> Path:
    """One audited update-capture round of two in-process DP-SGD clients on victim sets of 8 images,
    b = 4, K = 2, written as a run folder."""
    cfg = offline_config(
        {
            "audit": True,
            "defense": "dp-sgd",
            "dp-noise-from": "none",
            "clip-norm": CLIP,
            "dp-delta": 1e-5,
            "model-options": '{"width": 64}',
            "capture-kind": "update",
            "capture-images": 8,
            "batch-size": 4,
            "local-steps": 2,
            "batch-order": "in-order",
            "optimizer": "sgd",
            "lr": 0.1,
            **overrides,
        }
    )
    strategy = CuriousFedAvg(
        task.model_spec(cfg),
        capture_rounds="all",
        capture_kind="update",
        capture_dir=tmp_path / "captures",
        oracle_dir=tmp_path / "oracle",
        defense="dp-sgd",
        min_available_nodes=2,
        min_train_nodes=2,
        fraction_evaluate=0.0,
    )
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
    replies = [
        handle_train(m, client_context(NODE_IDS.index(m.metadata.dst_node_id), m.metadata.dst_node_id))
        for m in messages
    ]
    strategy.aggregate_train(1, replies)
    assert not strategy.failures
    return tmp_path


def test_a_dp_sgd_update_capture_is_replayed_exactly(tmp_path: Path) -> None:
    """From the captures: the replay plan clips as the client did (no noise), and with the oracle's
    images and masks it gives the captured Δ: <Δ, Δ*> = ||Δ||² = ||Δ*||² to float precision."""
    run = _dp_captured_round(tmp_path)
    jobs, oracles, skipped = jobs_from_captures(list_captures(run), run)
    assert not skipped and len(jobs) == 2
    for job, oracle in zip(jobs, oracles):
        assert job.meta["defense"] == "dp-sgd" and job.steps == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert job.plan.dp == dp_sgd.DpSgdSpec(CLIP, 0.0, 1.0, poisson=False)
        model = model_from_job(job)
        for p in model.parameters():
            p.requires_grad_(False)
        masks = [[m.float() for m in oracle.masks[t * 3 : (t + 1) * 3]] for t in range(2)]
        terms = replay_terms(
            model, dict(model.named_parameters()), job.plan, [oracle.images], [job.labels], [masks], [job.gradient]
        )
        total = terms.target_norm2.sum()
        assert total > 0
        torch.testing.assert_close(terms.norm2.sum(), total, rtol=1e-5, atol=0)
        torch.testing.assert_close(terms.dot.sum(), total, rtol=1e-5, atol=0)
        # and the clipped replay differs from the plain one: clipping is replayed, not ignored
        plain = replay_terms(
            model,
            dict(model.named_parameters()),
            replace(job.plan, dp=None),
            [oracle.images],
            [job.labels],
            [masks],
            [job.gradient],
        )
        assert float((plain.norm2.sum() - total).detach().abs()) > 1e-3 * float(total)


def test_a_poisson_sampled_dp_sgd_update_is_refused_in_one_line(tmp_path: Path) -> None:
    """A whole partition's round ran Poisson batches the capture does not record: no replay."""
    run = _dp_captured_round(tmp_path)
    capture = load_capture(list_captures(run)[0])
    capture.hyperparameters["capture-images"] = 0
    with pytest.raises(CaptureError, match="Poisson-sampled batches") as err:
        replay_plan(capture)
    assert "\n" not in str(err.value)
