"""DP-SGD clients (``--defense dp-sgd``, fedsim.dp_sgd): Opacus' per-example clipping and noise inside
the client's local round, its accountant across rounds, and the refusals. Small: an MLP, a few images."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from flower_harness import FakeGrid, client_context, offline_config, set_task_identity
from flwr.app import ArrayRecord, ConfigRecord
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from torch import nn
from torch.utils.data import TensorDataset

from fedsim import dp_sgd, task
from fedsim.client_app import handle_train
from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule, run_local_round
from fedsim.models import (
    DropoutMode,
    MaskedDropout,
    ModelSpec,
    build_model,
    get_recorded_masks,
    set_dropout_mode,
    set_masks,
)
from fedsim.run_config import RunConfigError, resolve_config
from fedsim.strategy import CuriousFedAvg

DELTA = 1e-5


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


def _data(n: int = 12, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def _mlp(p: float = 0.25) -> nn.Module:
    return build_model(ModelSpec("mlp", "mnist", p, 0, {"width": 64}))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_masked_dropout_per_example_gradients_are_exact() -> None:
    """Opacus hooks only layers with parameters; the Linear after a MaskedDropout sees each example's
    own mask in its input, so its per-example gradient equals autograd on that example alone."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), MaskedDropout(0.5), nn.Linear(5, 3))
    x, y = torch.randn(4, 6), torch.tensor([0, 2, 1, 2])
    set_dropout_mode(model, DropoutMode.RECORD)
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    (mask,) = get_recorded_masks(model)
    assert mask is not None and 0 < float(mask.mean()) < 1  # some units dropped, per example
    per_example = [p.grad_sample.clone() for p in model.parameters()]
    gsm.remove_hooks()
    set_dropout_mode(model, DropoutMode.REPLAY)
    for i in range(len(y)):
        set_masks(model, [mask[i : i + 1]])
        alone = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        for sample, grad in zip(per_example, alone, strict=True):
            torch.testing.assert_close(sample[i], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize(("name", "momentum"), [("sgd", 0.0), ("sgd", 0.9)])
def test_noise_off_and_clipping_never_reached_equals_the_plain_update(name: str, momentum: float) -> None:
    """The quality bar: no noise, no Poisson sampling, a clipping norm no example reaches: the DP-SGD
    client's update is the plain client's (same seed, same batches, same dropout masks)."""
    model, data = _mlp(), _data()
    schedule, optimizer = Schedule(epochs=2, batch_size=4), OptimizerSpec(name, 0.05, momentum=momentum)
    plain = run_local_round(model, data, LocalPlan(schedule, optimizer, seed=3))
    spec = dp_sgd.DpSgdSpec(1e6, 0.0, 4 / 12, poisson=False)
    private = run_local_round(model, data, LocalPlan(schedule, optimizer, seed=3, dp=spec))
    assert [s.indices for s in private.steps] == [s.indices for s in plain.steps]
    for a, b in zip(plain.steps, private.steps, strict=True):
        assert all(torch.equal(m, n) for m, n in zip(a.masks, b.masks, strict=True))
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
    scale = max(float(v.abs().max()) for v in plain.update.values())
    assert scale > 0
    for key, value in plain.update.items():
        torch.testing.assert_close(private.update[key], value, rtol=1e-5, atol=1e-6 * scale)
    # the model object is left as it was: parameters back, Opacus' hooks gone
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), _mlp().parameters(), strict=True))
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


def test_adam_first_step_gradient_equals_the_plain_one() -> None:
    """Adam divides by sqrt(v): float-level differences of near-zero entries grow after step 1, so the
    comparison is on the gradient each client steps with first."""
    model, data = _mlp(), _data()
    plan = LocalPlan(Schedule(batch_size=4, max_steps=1), OptimizerSpec("adam", 1e-3), seed=5, keep_gradients=True)
    plain = run_local_round(model, data, plan)
    private = run_local_round(model, data, replace(plan, dp=dp_sgd.DpSgdSpec(1e6, 0.0, 1 / 3, False)))
    for a, b in zip(plain.steps[0].gradient, private.steps[0].gradient, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_clipping_bounds_each_example_and_noise_moves_the_update() -> None:
    model, data = _mlp(), _data()
    plan = LocalPlan(Schedule(batch_size=4, max_steps=1, order="in-order"), OptimizerSpec("sgd", 1.0), seed=0)
    clip = 1e-3
    clipped = run_local_round(model, data, replace(plan, dp=dp_sgd.DpSgdSpec(clip, 0.0, 1, False)))
    norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in clipped.update.values()))
    assert norm <= clip * (1 + 1e-5)  # the mean of 4 examples, each clipped to clip
    noised = run_local_round(model, data, replace(plan, dp=dp_sgd.DpSgdSpec(clip, 1.0, 1, False)))
    assert any(not torch.allclose(noised.update[k], clipped.update[k]) for k in clipped.update)


def test_poisson_batches_come_from_opacus_sampler() -> None:
    batches = dp_sgd.poisson_batches(1000, 0.05, 20, seed=7)
    assert len(batches) == 20 and batches == dp_sgd.poisson_batches(1000, 0.05, 20, seed=7)
    sizes = [len(b) for b in batches]
    assert 30 < sum(sizes) / len(sizes) < 70 and len(set(sizes)) > 1  # about q * n, varying


@pytest.fixture(scope="module")
def fed() -> dict[str, Any]:
    return offline_config(
        {
            "defense": "dp-sgd",
            "local-steps": 3,
            "batch-size": 8,
            "model-options": '{"width": 64}',
            "optimizer": "sgd",
            "lr": 0.1,
            "clip-norm": 1.0,
            "dp-delta": DELTA,
            "num-server-rounds": 2,
        }
    )


def _rounds(cfg: dict[str, Any], rounds: int) -> tuple[list[dict[int, float]], CuriousFedAvg, list[Any]]:
    """``rounds`` training rounds of both clients, each client keeping its own Context across rounds."""
    strategy = CuriousFedAvg(
        task.model_spec(cfg), defense="dp-sgd", min_available_nodes=2, min_train_nodes=2, fraction_evaluate=0.0
    )
    contexts = {1111: client_context(0, 1111), 2222: client_context(1, 2222)}
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    spent: list[dict[int, float]] = []
    for rnd in range(1, rounds + 1):
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
        replies = [handle_train(m, contexts[m.metadata.dst_node_id]) for m in messages]
        spent.append(
            {r.content["meta"]["partition-id"]: float(r.content["metrics"]["dp-epsilon-spent"]) for r in replies}
        )
        arrays, _ = strategy.aggregate_train(rnd, replies)
    return spent, strategy, list(contexts.values())


def test_reported_epsilon_is_opacus_accountant_for_the_same_schedule(fed: dict[str, Any]) -> None:
    """The client's epsilon composes across rounds through its context.state and equals Opacus'
    RDPAccountant for (noise multiplier, q = B / n, all steps so far, delta)."""
    cfg = resolve_config(dict(fed, **{"dp-noise-from": "noise-multiplier", "noise-multiplier": 1.1}))
    spent, strategy, contexts = _rounds(cfg, 2)
    n = len(task.partition_indices(cfg, task.load_split(cfg, train=True), 0, 2))
    for rnd, by_client in enumerate(spent, start=1):
        expected = RDPAccountant()
        expected.history = [(1.1, 8 / n, 3 * rnd)]
        assert by_client[0] == pytest.approx(expected.get_epsilon(DELTA), rel=1e-9)
    assert spent[1][0] > spent[0][0] > 0  # composed over the rounds, not restarted
    assert json.loads(contexts[0].state[dp_sgd.STATE_KEY]["history"]) == [[1.1, 8 / n, 6]]
    summary = dp_sgd.privacy_summary(cfg, strategy.client_epsilon)
    assert summary["epsilon"] == max(spent[1].values()) and summary["accountant"].startswith("opacus")


def test_noise_derived_from_the_target_epsilon_spends_it_over_the_training(fed: dict[str, Any]) -> None:
    cfg = resolve_config(dict(fed, **{"dp-noise-from": "epsilon", "dp-epsilon": 3.0}))
    spent, _, _ = _rounds(cfg, 2)  # num-server-rounds = 2: the whole training
    n = len(task.partition_indices(cfg, task.load_split(cfg, train=True), 0, 2))
    z = get_noise_multiplier(target_epsilon=3.0, target_delta=DELTA, sample_rate=8 / n, steps=6, accountant="rdp")
    assert dp_sgd.noise_multiplier(cfg, n) == pytest.approx(z)
    assert 2.9 < spent[1][0] <= 3.0  # Opacus' search stops within its tolerance below the target


@pytest.mark.parametrize(("kind", "images", "capture_steps"), [("update", 4, 3), ("gradient", 0, 1)])
def test_noise_from_the_target_epsilon_counts_the_capture_rounds_at_q_1(
    fed: dict[str, Any], kind: str, images: int, capture_steps: int
) -> None:
    """The audited round runs fixed batches, accounted at q = 1 (no amplification): the calibration
    counts it, so the epsilon the client reports after the whole run (training rounds and the capture
    round) lands within Opacus' tolerance at or below the target, not above it."""
    cfg = resolve_config(
        dict(
            fed,
            **{
                "dp-noise-from": "epsilon",
                "dp-epsilon": 8.0,
                "num-server-rounds": 3,
                "capture-rounds": "3",
                "capture-kind": kind,
                "capture-images": images,
                "victim-batch-size": 2,
            },
        )
    )
    n = len(task.partition_indices(cfg, task.load_split(cfg, train=True), 0, 2))
    assert dp_sgd.privacy_schedule(cfg, n) == [(8 / n, 2 * 3), (1.0, capture_steps)]
    strategy = CuriousFedAvg(
        task.model_spec(cfg),
        capture_rounds={3},
        capture_kind=kind,
        keep_in_memory=True,
        defense="dp-sgd",
        min_available_nodes=2,
        min_train_nodes=2,
        fraction_evaluate=0.0,
    )
    contexts = {1111: client_context(0, 1111), 2222: client_context(1, 2222)}
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    for rnd in (1, 2, 3):
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
        replies = [handle_train(m, contexts[m.metadata.dst_node_id]) for m in messages]
        arrays, _ = strategy.aggregate_train(rnd, replies)
    z = dp_sgd.noise_multiplier(cfg, n)
    history = json.loads(contexts[1111].state[dp_sgd.STATE_KEY]["history"])
    assert history == [[z, 8 / n, 6], [z, 1.0, capture_steps]]  # what the client ran, as the calibration assumed
    reported = dp_sgd.privacy_summary(cfg, strategy.client_epsilon)["epsilon"]
    assert 8.0 - dp_sgd.EPSILON_TOLERANCE <= reported <= 8.0
    # The training rounds alone (the former calibration) give less noise, and the run overran the target.
    alone = get_noise_multiplier(target_epsilon=8.0, target_delta=DELTA, sample_rate=8 / n, steps=9, accountant="rdp")
    assert alone < z
    overrun = RDPAccountant()
    overrun.history = [(alone, 8 / n, 6), (alone, 1.0, capture_steps)]
    assert overrun.get_epsilon(DELTA) > 8.0


def test_capture_round_steps_follow_the_round_schedule(fed: dict[str, Any]) -> None:
    by_epochs = resolve_config(dict(fed, **{"local-steps": 0, "local-epochs": 2, "batch-size": 4}))
    assert dp_sgd.capture_steps(dict(by_epochs, **{"capture-kind": "update", "capture-images": 8}), 100) == 4
    assert dp_sgd.capture_steps(dict(by_epochs, **{"capture-kind": "update", "capture-images": 0}), 100) is None
    whole = dict(by_epochs, **{"capture-kind": "update", "capture-images": 0, "capture-rounds": "all"})
    assert dp_sgd.privacy_schedule(dict(whole, **{"num-server-rounds": 4}), 100) == [(0.04, 4 * 2 * 25)]
    none = dict(by_epochs, **{"capture-rounds": "", "num-server-rounds": 4})
    assert dp_sgd.privacy_schedule(none, 100) == [(0.04, 4 * 2 * 25)]


def test_calibration_with_one_sample_rate_is_opacus_search() -> None:
    for eps, q, steps in ((1.0, 0.128, 32), (8.0, 0.01, 1000), (3.0, 1.0, 2)):
        expected = get_noise_multiplier(target_epsilon=eps, target_delta=DELTA, sample_rate=q, steps=steps)
        assert dp_sgd.calibrate_noise(eps, DELTA, [(q, steps)]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"defense": "dp-sgd+local-dp"}, "dp-sgd cannot be combined with another update-level defense (local-dp)"),
        ({"defense": "prune,dp-sgd"}, "cannot be combined"),
        ({"clip-norm": 0}, "clip-norm must be > 0"),
        ({"dp-epsilon": 0}, "dp-epsilon must be > 0"),
        ({"dp-delta": 1.0}, "dp-delta must be in (0, 1)"),
    ],
)
def test_bad_dp_sgd_settings_are_refused(overrides: dict[str, Any], words: str) -> None:
    with pytest.raises(RunConfigError) as err:
        resolve_config({"defense": "dp-sgd", **overrides})
    assert words in str(err.value)


def test_delta_and_sample_rate_are_checked_against_the_clients_data(fed: dict[str, Any]) -> None:
    with pytest.raises(RunConfigError, match=r"dp-delta 0.1 >= 1/\d+"):
        task.check_defense(resolve_config(dict(fed, **{"dp-delta": 0.1})))
    with pytest.raises(RunConfigError, match="sample rate .* > 1"):
        task.check_defense(resolve_config(dict(fed, **{"batch-size": 100000})))
    assert task.check_defense(fed) == []


def test_batchnorm_is_refused_unless_the_model_is_fixed(fed: dict[str, Any]) -> None:
    bn = dict(fed, model="resnet18", **{"model-options": '{"norm": "batch"}'})
    with pytest.raises(RunConfigError, match="dp-sgd cannot train model resnet18 per example .*--dp-fix-model"):
        task.check_defense(resolve_config(bn))
    changes = task.check_defense(resolve_config(dict(bn, **{"dp-fix-model": True})))
    assert changes and all("BatchNorm2d -> GroupNorm" in line for line in changes)
    fixed = task.make_model(resolve_config(dict(bn, **{"dp-fix-model": True})))
    assert not dp_sgd.model_problems(fixed) and not any(isinstance(m, nn.BatchNorm2d) for m in fixed.modules())


def test_cli_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedsim.cli import main

    base = ["simulate", "--no-download", "--clients", "2", "--rounds", "1", "--run-dir", str(tmp_path / "run")]
    for args, words in (
        (["--defense", "dp-sgd", "--model", "resnet18", "--model-options", '{"norm": "batch"}'], "--dp-fix-model"),
        (["--set", "defense=dp-sgd+central-dp-server-clipping"], "cannot be combined"),
    ):
        assert main([*base, *args]) == 2
        out, err = capsys.readouterr()
        lines = [line for line in (out + err).splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], out + err
    assert list(tmp_path.iterdir()) == []


def test_cli_flags_run_a_federation_whose_results_state_the_spent_epsilon(tmp_path: Path) -> None:
    """`fedsim simulate --defense dp-sgd ...`, its flags read by the CLI's own parser into the run config
    and the federation run by the ServerApp with the ClientApp itself (mods included) on an in-process
    grid: results.json states each client's epsilon, composed over both rounds. (Ray and the console
    command run in tests/test_simulation.py and tests/test_commands.py.)"""
    from flower_harness import AppGrid

    from fedsim.cli import build_parser, run_config_from_args
    from fedsim.server_app import run_server

    set_task_identity()
    run_dir = tmp_path / "run"
    args = ["simulate", "--no-download", "--clients", "2", "--rounds", "2", "--local-steps", "2", "--batch-size", "8"]
    args += ["--model-options", '{"width": 64}', "--optimizer", "sgd", "--lr", "0.1", "--defense", "dp-sgd"]
    args += ["--dp-epsilon", "8", "--clip-norm", "1.0", "--run-dir", str(run_dir)]
    cfg = run_config_from_args(build_parser().parse_args(args))
    assert cfg["defense"] == "dp-sgd" and cfg["dp-epsilon"] == 8.0 and cfg["clip-norm"] == 1.0
    run_server(AppGrid([1111, 2222]), cfg)
    privacy = json.loads((run_dir / "results.json").read_text())["privacy"]
    assert privacy["defense"] == "dp-sgd" and set(privacy["per_client"]) == {"0", "1"}
    assert 0 < privacy["per_round"]["1"] < privacy["per_round"]["2"] == privacy["epsilon"] <= 8.0


def test_a_one_step_capture_round_is_clipped_noised_and_accounted_with_q_1(fed: dict[str, Any]) -> None:
    """A gradient capture round on the victim batch: fixed batch (no Poisson sampling), accounted
    with sample rate 1; the capture names the defense."""
    cfg = resolve_config(dict(fed, **{"dp-noise-from": "noise-multiplier", "noise-multiplier": 1.1}))
    strategy = CuriousFedAvg(
        task.model_spec(cfg),
        capture_rounds={1},
        capture_kind="gradient",
        keep_in_memory=True,
        defense="dp-sgd",
        min_available_nodes=2,
        min_train_nodes=2,
        fraction_evaluate=0.0,
    )
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
    context = client_context(0, 1111)
    reply = handle_train(next(m for m in messages if m.metadata.dst_node_id == 1111), context)
    assert json.loads(context.state[dp_sgd.STATE_KEY]["history"]) == [[1.1, 1.0, 1]]
    expected = RDPAccountant()
    expected.history = [(1.1, 1.0, 1)]
    assert reply.content["metrics"]["dp-epsilon-spent"] == pytest.approx(expected.get_epsilon(DELTA), rel=1e-9)
    strategy.aggregate_train(1, [reply])
    assert [c.defense for c in strategy.captures] == ["dp-sgd"] and strategy.captures[0].kind == "gradient"
