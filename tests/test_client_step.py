"""The one client step: today's rounds are settings of it, bit for bit, and its optimizer updates
are torch.optim's. The references below are the project's previous, separate implementations
(the one-step round and the local training loop), kept here as the yardstick."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsim.client_step import (
    CLIENT_OPTIMIZERS,
    LocalPlan,
    LocalPlanError,
    OptimizerSpec,
    Schedule,
    one_step_plan,
    run_local_round,
)
from fedsim.models import MaskedDropout, ModelSpec, build_model, get_recorded_masks, set_dropout_mode


def _reference_one_step(model, images, labels, lr, seed):
    """The earlier ``task.one_step``: record masks, autograd, float64 local weights."""
    set_dropout_mode(model, "record")
    model.train()
    names = [n for n, _ in model.named_parameters()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss = F.cross_entropy(model(images), labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    masks = [m.clone() for m in get_recorded_masks(model)]
    set_dropout_mode(model, "auto")
    local = {k: v.detach().clone().double() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    for name, grad in zip(names, grads):
        local[name] = local[name] - lr * grad.double()
    return local, grads, masks


def _reference_train(model, data, optimizer, batch_size, epochs, seed):
    """The earlier ``task.train_local``: DataLoader, torch.optim, the model's own dropout."""
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    set_dropout_mode(model, "auto")
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(epochs):
            for images, labels in loader:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(images), labels).backward()
                optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _data(n=12, seed=3, channels=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, channels, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


@pytest.mark.parametrize("name,p", [("mlp", 0.25), ("lenet", 0.5)])
def test_one_step_round_is_bit_identical_to_the_previous_one(name, p):
    spec = ModelSpec(name, "mnist", p, 0)
    data = _data(4, channels=spec.input_shape[0])
    images, labels = data.tensors
    ref_local, ref_grads, ref_masks = _reference_one_step(build_model(spec), images, labels, 1e-3, seed=11)
    model = build_model(spec)
    result = run_local_round(model, data, one_step_plan(1e-3, seed=11, keep_gradients=True))
    assert len(result.steps) == 1 and result.steps[0].indices == [0, 1, 2, 3]
    # float64 weights agree to the last bit or one (torch.optim's add(alpha=-lr) fuses the multiply-add);
    # the float32 gradient the server recovers from them is bit-identical
    for k, v in ref_local.items():
        torch.testing.assert_close(result.weights[k], v, rtol=1e-15, atol=1e-18)
    global_state = build_model(spec).state_dict()
    for (n, _), g in zip(model.named_parameters(), ref_grads):
        captured = ((global_state[n].double() - result.weights[n]) / 1e-3).float()  # what the server computes
        assert torch.equal(captured, ((global_state[n].double() - ref_local[n]) / 1e-3).float())
        assert torch.equal(result.steps[0].gradient[[m for m, _ in model.named_parameters()].index(n)], g)
    assert all(torch.equal(a, b) for a, b in zip(result.steps[0].masks, ref_masks))
    # the model object still holds the global weights
    assert all(torch.equal(v, global_state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "opt", [OptimizerSpec("adam", 1e-3), OptimizerSpec("sgd", 0.05), OptimizerSpec("sgd", 0.05, momentum=0.9)]
)
def test_training_round_equals_torch_optim_bit_for_bit(opt):
    spec = ModelSpec("mlp", "mnist", 0.25, 0)
    data = _data(12)
    reference_model = build_model(spec)
    torch_opt = (
        torch.optim.Adam(reference_model.parameters(), lr=opt.lr)
        if opt.name == "adam"
        else torch.optim.SGD(reference_model.parameters(), lr=opt.lr, momentum=opt.momentum)
    )
    expected = _reference_train(reference_model, data, torch_opt, batch_size=4, epochs=2, seed=5)
    plan = LocalPlan(Schedule(epochs=2, batch_size=4), opt, seed=5)
    result = run_local_round(build_model(spec), data, plan)
    assert len(result.steps) == 6
    for k, v in expected.items():
        assert torch.equal(result.weights[k], v), k
    start = build_model(spec).state_dict()
    for k, delta in result.update.items():
        assert torch.equal(delta, start[k] - result.weights[k])


def test_schedule_orders_and_step_cap():
    assert Schedule(epochs=2, batch_size=2, order="in-order").batches(4, 0) == [[0, 1], [2, 3], [0, 1], [2, 3]]
    shuffled = Schedule(epochs=2, batch_size=3, max_steps=3).batches(6, seed=1)
    assert len(shuffled) == 3 and sorted(shuffled[0] + shuffled[1]) == list(range(6))
    assert shuffled == Schedule(epochs=2, batch_size=3, max_steps=3).batches(6, seed=1)
    assert shuffled != Schedule(epochs=2, batch_size=3, max_steps=3).batches(6, seed=2)


def test_replaying_the_recorded_masks_reproduces_the_round():
    spec = ModelSpec("mlp", "mnist", 0.5, 0)
    data = _data(8)
    plan = LocalPlan(Schedule(epochs=1, batch_size=2), OptimizerSpec("adam", 1e-3), seed=2)
    sampled = run_local_round(build_model(spec), data, plan)
    masks = [s.masks for s in sampled.steps]
    replay = LocalPlan(
        Schedule(epochs=1, batch_size=2), OptimizerSpec("adam", 1e-3), dropout="replay", masks=masks, seed=2
    )
    replayed = run_local_round(build_model(spec), data, replay)
    assert all(torch.equal(replayed.weights[k], v) for k, v in sampled.weights.items())
    off = run_local_round(build_model(spec), data, LocalPlan(plan.schedule, plan.optimizer, dropout="off", seed=2))
    assert any(not torch.equal(off.update[k], v) for k, v in sampled.update.items())  # dropout did act


def _reused_dropout() -> torch.nn.Module:
    """One dropout placed twice (after each hidden layer): two masks a step, one per call."""
    torch.manual_seed(0)
    drop = MaskedDropout(0.5)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), drop, nn.Linear(16, 16), nn.ReLU(), drop, nn.Linear(16, 10)
    )


def test_a_dropout_run_twice_records_two_masks_a_step_and_their_replay_reproduces_the_round():
    data = _data(8)
    plan = LocalPlan(Schedule(epochs=1, batch_size=2), OptimizerSpec("adam", 1e-3), seed=2)
    sampled = run_local_round(_reused_dropout(), data, plan)
    masks = [s.masks for s in sampled.steps]
    assert all(len(m) == 2 and not torch.equal(m[0], m[1]) for m in masks)
    replay = dataclasses.replace(plan, dropout="replay", masks=masks)
    replayed = run_local_round(_reused_dropout(), data, replay)
    assert all(torch.equal(replayed.weights[k], v) for k, v in sampled.weights.items())
    swapped = dataclasses.replace(replay, masks=[m[::-1] for m in masks])  # the calls' masks in the other order
    other = run_local_round(_reused_dropout(), data, swapped)
    assert any(not torch.equal(other.weights[k], v) for k, v in sampled.weights.items())


def test_differentiable_round_passes_gradients_to_images_and_learned_masks():
    spec = ModelSpec("mlp", "mnist", 0.25, 0)
    data = _data(4)
    sampled = run_local_round(
        build_model(spec), data, LocalPlan(Schedule(batch_size=2, order="in-order"), OptimizerSpec("sgd", 0.1), seed=4)
    )
    images = data.tensors[0].clone().requires_grad_(True)
    masks = [[m.clone().float().requires_grad_(True) for m in s.masks] for s in sampled.steps]
    plan = LocalPlan(
        Schedule(batch_size=2, order="in-order"),
        OptimizerSpec("sgd", 0.1),
        dropout="learn",
        masks=masks,
        differentiable=True,
        seed=4,
    )
    replay = run_local_round(build_model(spec), TensorDataset(images, data.tensors[1]), plan)
    for k, v in sampled.update.items():  # binary learned masks = replay: the same update
        torch.testing.assert_close(replay.update[k], v, rtol=0, atol=1e-7)
    loss = sum((u**2).sum() for u in replay.update.values())
    loss.backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    assert all(m.grad is not None for step in masks for m in step)


def test_bad_plans_are_refused():
    with pytest.raises(LocalPlanError):
        OptimizerSpec("rmsprop")
    with pytest.raises(LocalPlanError):
        OptimizerSpec("adam", momentum=0.9)
    with pytest.raises(LocalPlanError):
        Schedule(order="random")
    with pytest.raises(LocalPlanError):
        LocalPlan(dropout="replay")


def test_a_new_optimizer_is_one_entry_that_every_site_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry added to CLIENT_OPTIMIZERS is an optimizer for the client, the run config's momentum, the
    attacker's replay (ε smoothing, the low-rank batching, one step as a gradient) and the audit's words,
    and changing an entry changes what those sites do: none of them checks an optimizer's name."""
    from attacker.engine.replay import replay_terms
    from attacker.engine.replay_lowrank import batched_replay_applies
    from attacker.jobs import VictimJob, exact_as_gradient
    from fedsim import task
    from fedsim.run_config import DEFAULTS

    sgd, adam = CLIENT_OPTIMIZERS["sgd"], CLIENT_OPTIMIZERS["adam"]
    # New names: SGD's update without momentum, and Adam as it is.
    monkeypatch.setitem(CLIENT_OPTIMIZERS, "plain", dataclasses.replace(sgd, title="Plain", takes_momentum=False))
    monkeypatch.setitem(CLIENT_OPTIMIZERS, "adam2", dataclasses.replace(adam, title="Adam 2"))
    spec = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 8})
    model, data = build_model(spec), _data(4)
    images, labels = data.tensors
    plain = LocalPlan(Schedule(order="in-order"), OptimizerSpec("plain", 0.1), seed=1)
    as_sgd = dataclasses.replace(plain, optimizer=OptimizerSpec("sgd", 0.1))
    ran = run_local_round(model, data, plain)
    assert all(torch.equal(v, run_local_round(model, data, as_sgd).update[k]) for k, v in ran.update.items())
    with pytest.raises(LocalPlanError, match="only with sgd, got 0.9 for plain"):
        OptimizerSpec("plain", 0.1, momentum=0.9)
    cfg = dict(DEFAULTS, optimizer="plain", momentum=0.9)
    assert task.local_plan(cfg, one_step=False, seed=0).optimizer == OptimizerSpec("plain", float(cfg["lr"]))
    assert task.local_plan(dict(cfg, optimizer="sgd"), one_step=False, seed=0).optimizer.momentum == 0.9
    masks = [[step.masks for step in ran.steps]]
    job = VictimJob("c0", spec, model.state_dict(), list(ran.update.values()), labels, plan=plain)
    assert batched_replay_applies(model, plain, [images], masks) and exact_as_gradient(job)
    assert CLIENT_OPTIMIZERS["plain"].words(0.9) == "Plain"
    assert sgd.words(0.9) == "SGD with momentum 0.9" and sgd.words(0) == "SGD" and adam.words(0.9) == "Adam"

    def smoothed(name: str) -> bool:
        """Whether the replay of an Adam-like plan takes the attack's ε in place of the client's."""
        plan = dataclasses.replace(plain, optimizer=OptimizerSpec(name, 1e-3))
        start, target = dict(model.named_parameters()), [torch.ones_like(p) for p in model.parameters()]
        dot = [replay_terms(model, start, plan, [images], [labels], masks, [target], eps=e).dot for e in ([1.0], None)]
        return not torch.equal(*dot)

    assert smoothed("adam") and smoothed("adam2")
    # The entries, changed: the same names now replay one job at a time, unsmoothed, not as a gradient.
    monkeypatch.setitem(CLIENT_OPTIMIZERS, "adam", dataclasses.replace(adam, smoothed_eps_replay=False))
    monkeypatch.setitem(
        CLIENT_OPTIMIZERS, "plain", dataclasses.replace(sgd, lowrank_replay=False, step_is_gradient=False)
    )
    assert not smoothed("adam")
    assert not batched_replay_applies(model, plain, [images], masks) and not exact_as_gradient(job)


def test_explicit_batches_override_the_schedule() -> None:
    """LocalPlan.batches (the attacker's unknown-order replay) runs exactly the given index batches."""
    from fedsim.client_step import plan_batches

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    data = TensorDataset(torch.randn(6, 12), torch.tensor([0, 1, 2, 0, 1, 2]))
    shuffled = LocalPlan(Schedule(epochs=2, batch_size=3, order="shuffled"), OptimizerSpec("sgd", 0.1), seed=5)
    explicit = dataclasses.replace(shuffled, batches=tuple(tuple(b) for b in plan_batches(shuffled, 6)))
    a, b = run_local_round(model, data, shuffled), run_local_round(model, data, explicit)
    assert [s.indices for s in a.steps] == [s.indices for s in b.steps]
    assert all(torch.equal(a.update[k], b.update[k]) for k in a.update)
    with pytest.raises(LocalPlanError, match="explicit batches"):
        run_local_round(model, data, dataclasses.replace(shuffled, batches=((0, 6),)))
