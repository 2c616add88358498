"""Secure aggregation (``secagg``): Flower's SecAgg+ workflow and mod, the whole protocol run in this
process (``flower_harness.AppGrid`` hands every message to the ClientApp with its mods), and what the
curious server can capture under it: one aggregate per round, the weighted mean of the clients' plain
replies within the quantization step it states, never one client's reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from flower_harness import AppGrid, offline_config, set_task_identity
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedsim import task
from fedsim.capture import find_oracles, list_captures, list_oracles, load_capture, load_oracle
from fedsim.client_app import handle_train
from fedsim.run_config import RunConfigError, resolve_config
from fedsim.server_app import run_server

NODES = [1111, 2222, 3333]
# A fine quantization: weights unscaled beyond num_examples / max-weight, clipped to [-1, 1], 2**28 levels.
FINE = {"max-weight": 4000.0, "clipping-range": 1.0, "quantization-range": 2**28}


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


def _secagg_run(run_dir: Path, fail: tuple[int, ...] = (), **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = offline_config(
        {
            "secagg": True,
            "audit": True,
            "num-clients": 3,
            "num-server-rounds": 1,
            "capture-rounds": "1",
            "model-options": '{"width": 32}',
            "run-dir": str(run_dir),
            **extra,
        }
    )
    return cfg, run_server(AppGrid(NODES, fail=fail), cfg)


def _round_message(cfg: dict[str, Any], weights: dict[str, torch.Tensor], partition: int) -> tuple[Message, Any]:
    """Round 1's train message to the client of ``partition`` without secure aggregation, and its context."""
    sent = dict(cfg, **{"server-round": 1, "one-step": cfg["capture-kind"] == "gradient"})
    sent["capture-update"] = cfg["capture-kind"] == "update"
    msg = Message(
        content=RecordDict({"arrays": ArrayRecord(weights), "config": ConfigRecord(sent)}),
        dst_node_id=NODES[partition],
        message_type="train",
    )
    return msg, AppGrid(NODES).contexts[NODES[partition]]


def _plain_reply(cfg: dict[str, Any], weights: dict[str, torch.Tensor], partition: int) -> Message:
    """What the client would send without secure aggregation: its handler on the same round's message."""
    return handle_train(*_round_message(cfg, weights, partition))


def _plain_mean(cfg: dict[str, Any], capture: Any, partitions: list[int]) -> tuple[list[dict], list[int]]:
    """The clients' plain updates (global - local) and their num_examples."""
    updates, weights = [], []
    for part in partitions:
        reply = _plain_reply(cfg, capture.weights, part)
        local = reply.content["arrays"].to_torch_state_dict()
        updates.append({k: capture.weights[k].double() - local[k].double() for k in capture.weights})
        weights.append(int(reply.content["metrics"]["num-examples"]))
    return updates, weights


def test_the_aggregate_capture_is_the_weighted_mean_of_the_plain_replies_within_its_step(tmp_path: Path) -> None:
    # Dirichlet partitions: the clients' weights (num_examples) differ; one local step of a FedAvg round.
    cfg, summary = _secagg_run(
        tmp_path / "run",
        **{"capture-kind": "update", "partitioning": "dirichlet", "local-steps": 1, "batch-size": 16, **FINE},
    )
    assert summary["num_captures"] == 1 and summary["failures"] == []
    (capture,) = [load_capture(p) for p in list_captures(tmp_path / "run")]
    agg = capture.aggregate
    assert capture.kind == "secagg-update" and agg.clients == [0, 1, 2] and agg.node_ids == NODES
    updates, weights = _plain_mean(cfg, capture, [0, 1, 2])
    assert agg.num_examples == weights and len(set(weights)) == 3 and capture.num_examples == sum(weights)
    assert agg.quantization == {
        "max_weight": 4000.0,
        "clipping_range": 1.0,
        "quantization_range": 2**28,
        "modulus_range": 2**32,
    }
    for key in capture.param_names:
        mean = sum(w * u[key] for w, u in zip(weights, updates)) / sum(weights)
        error = (capture.update[key].double() - mean).abs().max().item()
        size = mean.abs().max().item()
        assert 0 < error <= agg.error_bound, key  # quantized (stochastic rounding), within one step per client
        assert agg.error_bound < 1e-3 * size, key  # and the bound says something
        # no capture holds one client's update: each is farther from the mean than the quantization
        assert min((capture.update[key].double() - u[key]).abs().max().item() for u in updates) > 100 * agg.error_bound
    # the oracle, kept apart, is each client's
    assert [o.client for o in find_oracles(tmp_path / "run", capture)] == [0, 1, 2]


def test_a_one_step_aggregate_is_the_batch_gradient_of_all_the_clients_images(tmp_path: Path) -> None:
    cfg, _ = _secagg_run(tmp_path / "run", **{"victim-batch-size": 2, **FINE, "max-weight": 2.0})
    (capture,) = [load_capture(p) for p in list_captures(tmp_path / "run")]
    oracles = find_oracles(tmp_path / "run", capture)
    assert capture.kind == "secagg-gradient" and capture.batch_size == 6 and capture.aggregate.images == [2, 2, 2]
    assert torch.equal(capture.labels, torch.cat([o.labels for o in oracles]))  # known labels, in the images' order
    updates, weights = _plain_mean(cfg, capture, [0, 1, 2])
    lr = float(cfg["onestep-lr"])
    for i, name in enumerate(capture.param_names):
        mean = sum(w * u[name] for w, u in zip(weights, updates)) / sum(weights) / lr
        error = (capture.gradient[i].double() - mean).abs().max().item()
        assert error <= capture.aggregate.error_bound < 1e-3 * mean.abs().max().item()


def test_a_client_that_drops_out_leaves_the_mean_of_the_others(tmp_path: Path) -> None:
    # 3 shares, threshold 2: SecAgg+ reconstructs the dropped client's masks from the other two.
    cfg, summary = _secagg_run(tmp_path / "run", fail=(3333,), **{**FINE, "max-weight": 1.0})
    assert summary["rounds"][1]["num_replies"] == 2 and len(summary["failures"]) == 1
    assert "dropped out" in summary["failures"][0]["reason"]
    (capture,) = [load_capture(p) for p in list_captures(tmp_path / "run")]
    assert capture.aggregate.clients == [0, 1] and capture.batch_size == 2
    updates, _ = _plain_mean(cfg, capture, [0, 1])
    for i, name in enumerate(capture.param_names):
        mean = (updates[0][name] + updates[1][name]) / 2 / float(cfg["onestep-lr"])
        assert (capture.gradient[i].double() - mean).abs().max().item() <= capture.aggregate.error_bound
    assert {load_oracle(p).client for p in list_oracles(tmp_path / "run")} == {0, 1}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num-shares": 3, "reconstruction-threshold": 3}, "reconstruction-threshold 3 must be below num-shares 3"),
        ({"num-shares": 2.5}, "num-shares must be a fraction in (0, 1] or an integer >= 3"),
        ({"clipping-range": 0}, "clipping-range must be > 0"),
        ({"quantization-range": 0}, "quantization-range must be >= 1"),
        ({"num-clients": 1}, "secagg needs at least 2 sampled clients per round"),
        ({"num-clients": 4, "fraction-train": 0.25}, "secagg needs at least 2 sampled clients per round"),
        ({"strategy": "fedmedian"}, "strategy fedmedian cannot run under secagg"),
        ({"strategy": "krum"}, "strategy krum cannot run under secagg"),
        ({"defense": "central-dp-server-clipping"}, "defense central-dp-server-clipping cannot run under secagg"),
        ({"num-clients": 2, "reconstruction-threshold": 2}, "must be below the 2 sampled clients"),
    ],
)
def test_bad_secagg_settings_are_one_line_exit_2_and_nothing_written(
    settings: dict[str, Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedsim.cli import main

    with pytest.raises(RunConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        resolve_config({"secagg": True, **settings})
    args = ["simulate", "--secagg", "--run-dir", str(tmp_path / "run"), "--no-download"]
    args += [f"--set={k}={v}" for k, v in settings.items()]
    assert main(args) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and message in out and len(out.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_secagg_settings_need_secagg_on_only_for_their_combinations() -> None:
    # Without secagg, a strategy that needs each reply and 1 client are fine; the ranges still hold.
    assert resolve_config({"strategy": "krum", "num-clients": 1})["secagg"] is False
    with pytest.raises(RunConfigError, match="max-weight must be > 0"):
        resolve_config({"max-weight": 0})
    # 2 clients run with the fractional forms (the defaults)
    assert resolve_config({"secagg": True, "num-clients": 2})["num-shares"] == 1.0


@pytest.fixture(scope="module")
def aggregate_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """An audited secagg run: 3 clients, one image each, round 1's one-step mean captured finely."""
    run_dir = tmp_path_factory.mktemp("secagg") / "run"
    cfg, _ = _secagg_run(run_dir, **{**FINE, "max-weight": 1.0})
    return cfg, run_dir


def test_the_attacker_takes_an_aggregate_as_one_job_of_all_the_clients_images(
    aggregate_run: tuple[dict[str, Any], Path],
) -> None:
    import torch.nn.functional as F

    from attacker.captures import capture_paths, jobs_from_captures
    from fedsim.models import set_dropout_mode, set_masks

    cfg, run_dir = aggregate_run
    (job,), (oracle,), skipped = jobs_from_captures(capture_paths(run_dir), run_dir)
    records = find_oracles(run_dir, load_capture(list_captures(run_dir)[0]))
    assert skipped == [] and job.job_id == "r0001_secagg" and job.batch_size == 3 and job.plan is None
    assert job.meta["image_clients"] == [0, 1, 2] and torch.equal(job.labels, torch.cat([r.labels for r in records]))
    assert torch.equal(oracle.images, torch.cat([r.images for r in records]).float())
    # The target is the gradient of ONE batch of the 3 images, each with its own client's masks (what WIIG
    # replays, what DIA learns), up to the quantization.
    model = task.make_model(cfg, job.weights)
    set_dropout_mode(model, "replay")
    set_masks(model, list(oracle.masks))
    model.train()
    batch = torch.autograd.grad(F.cross_entropy(model(oracle.images), job.labels), list(model.parameters()))
    bound = job.meta["quantization_step"] * 3
    for got, want in zip(job.gradient, batch, strict=True):
        assert (got.double() - want.double()).abs().max().item() <= bound + 1e-7 * want.abs().max().item()


def test_the_audit_of_a_secagg_run_says_what_the_server_saw(
    aggregate_run: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    import json

    from attacker.cli import main

    _, run_dir = aggregate_run
    out = tmp_path / "audit"
    args = ["audit", str(run_dir), "--out", str(out), "--attacks", "dia", "wiig", "--iterations", "20", "--no-lpips"]
    assert main([*args, "--quiet"]) == 0
    audit = json.loads((out / "audit.json").read_text())
    capture = load_capture(list_captures(run_dir)[0])
    step, rms = capture.aggregate.step, capture.aggregate.rms
    assert 0 < step < 1e-2 * rms
    assert audit["setting"]["capture_text"].startswith(
        f"the mean of 3 clients' one-step gradients (SecAgg+: the server never holds one client's), quantized "
        f"with step {step:.2g} (the captured mean's RMS entry, quantization noise included: {rms:.2g})"
    )
    assert [(r["client"], r["index"]) for r in audit["images"]] == [(0, 0), (1, 1), (2, 2)]
    assert "SecAgg+ mean of 3 one-step gradients (3 images)" in audit["verdict"]


def test_a_mean_of_fedavg_updates_is_one_job_replaying_each_clients_round_from_the_shared_start(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from attacker.captures import capture_paths, jobs_from_captures
    from attacker.engine.replay import replayed_update
    from attacker.jobs import model_from_job

    fedavg = {"capture-kind": "update", "capture-images": 2, "batch-size": 1, "optimizer": "sgd", "lr": 0.01}
    cfg, _ = _secagg_run(tmp_path / "run", **fedavg, **{**FINE, "max-weight": 2.0})
    (job,), (oracle,), _ = jobs_from_captures(capture_paths(tmp_path / "run"), tmp_path / "run")
    assert job.plan is not None and job.batch_size == 6 and job.members == ((2, 2.0), (2, 2.0), (2, 2.0))
    assert job.steps == [[0], [1], [2], [3], [4], [5]]  # K = 2 per client, client by client
    # the clients' true images and masks, each client's round from the same start, averaged: the capture
    model = model_from_job(job)
    per_layer = len(oracle.masks) // len(job.steps)
    masks = [list(oracle.masks[t * per_layer : (t + 1) * per_layer]) for t in range(len(job.steps))]
    plan = replace(job.plan, dropout="replay", masks=masks)
    start = {k: v.detach() for k, v in model.named_parameters()}
    replayed = replayed_update(model, start, plan, oracle.images, job.labels, job.members)
    bound = load_capture(list_captures(tmp_path / "run")[0]).aggregate.error_bound
    names = [n for n, _ in model.named_parameters()]
    for name, target in zip(names, job.gradient, strict=True):
        assert (replayed[name].double() - target.double()).abs().max().item() <= bound + 1e-7, name
    # one client's round alone is not it
    alone = replayed_update(model, start, replace(plan, masks=masks[:2]), oracle.images[:2], job.labels[:2])
    assert max((alone[n] - t).abs().max().item() for n, t in zip(names, job.gradient)) > 100 * bound


def _defended_mean(cfg: dict[str, Any], capture: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The num_examples-weighted mean of the 3 clients' plain updates, and of the same replies passed
    through the run's client-side defense (``defense_mod``, as the client chain runs it under SecAgg+)."""
    from fedsim.client_app import defense_mod

    clean, defended, weights = [], [], []
    for part in range(3):
        reply = _plain_reply(cfg, capture.weights, part)
        weights.append(int(reply.content["metrics"]["num-examples"]))
        through = defense_mod(*_round_message(cfg, capture.weights, part), handle_train)
        for replies, out in ((clean, reply), (defended, through)):
            local = out.content["arrays"].to_torch_state_dict()
            replies.append({k: capture.weights[k].double() - local[k].double() for k in capture.weights})
    total = sum(weights)
    mean = [
        {k: sum(w * u[k] for w, u in zip(weights, us)) / total for k in capture.weights} for us in (clean, defended)
    ]
    return mean[0], mean[1]


def _flat(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n].double().flatten() for n in names])


def test_pruning_acts_on_each_reply_before_secagg_masks_it(tmp_path: Path) -> None:
    # Each client prunes its own update (PruneMod, inside SecAgg+'s mod): the server's mean is the mean of
    # the pruned replies, within its quantization step, and not the mean of the unpruned ones.
    # plain SGD: Adam's first step moves every weight by about lr, and its largest 10 % would be a tie
    fedavg = {"capture-kind": "update", "local-steps": 1, "batch-size": 16, "optimizer": "sgd", "lr": 0.01}
    cfg, summary = _secagg_run(tmp_path / "run", defense="prune", **{"prune-fraction": 0.1, **fedavg, **FINE})
    assert summary["failures"] == []
    (capture,) = [load_capture(p) for p in list_captures(tmp_path / "run")]
    clean, pruned = _defended_mean(cfg, capture)
    got, bound = _flat(capture.update, capture.param_names), capture.aggregate.error_bound
    assert (got - _flat(pruned, capture.param_names)).abs().max().item() <= bound
    # each reply keeps its largest 10 % (prune-fraction): an entry all three clients pruned is zero in the
    # mean, where the unpruned mean has almost none
    assert (got.abs() <= bound).double().mean().item() > 0.5
    assert (_flat(clean, capture.param_names).abs() <= bound).double().mean().item() < 0.1


def test_local_dp_noise_survives_secure_aggregation_as_the_mean_of_the_clients_noise(tmp_path: Path) -> None:
    from fedsim.defenses import _local_dp_multiplier

    dp = {"defense": "local-dp", "clip-norm": 1.0, "dp-epsilon": 50.0, "dp-delta": 1e-5}
    fedavg = {"capture-kind": "update", "local-steps": 1, "batch-size": 16}
    cfg, summary = _secagg_run(tmp_path / "run", **dp, **fedavg, **FINE)
    assert summary["failures"] == []
    (capture,) = [load_capture(p) for p in list_captures(tmp_path / "run")]
    clean, _ = _defended_mean(cfg, capture)
    weights = torch.tensor(capture.aggregate.num_examples, dtype=torch.float64)
    # each client's noise has std clip * multiplier (LocalDpMod); the weighted mean's is that times
    # sqrt(sum w_i^2) / sum w_i. The one-step updates are far below the clipping norm, so nothing is clipped.
    assert all(_flat(u, capture.param_names).norm() < 1.0 for u in [clean])
    expected = 1.0 * _local_dp_multiplier(cfg) * weights.pow(2).sum().sqrt().item() / weights.sum().item()
    noise = _flat(capture.update, capture.param_names) - _flat(clean, capture.param_names)
    assert 0.9 < noise.pow(2).mean().sqrt().item() / expected < 1.1
    assert capture.aggregate.error_bound < 1e-3 * expected  # the quantization is not the noise


@pytest.mark.parametrize(
    "settings",
    [
        {"defense": "central-dp-client-clipping", "clip-norm": 1e-3, "noise-multiplier": 0.5},
        {"defense": "dp-sgd", "noise-multiplier": 1.0, "clip-norm": 1.0, "dp-noise-from": "noise-multiplier"},
        {"strategy": "fedprox", "strategy-options": '{"proximal_mu": 0.1}'},
        {"strategy": "fedadam"},
    ],
    ids=["central-dp-client-clipping", "dp-sgd", "fedprox", "fedadam"],
)
def test_secagg_composes_with_the_client_side_defenses_and_the_legacy_strategies(
    settings: dict[str, Any], tmp_path: Path
) -> None:
    fedavg = {"capture-kind": "update", "local-steps": 2, "batch-size": 8}
    cfg, summary = _secagg_run(tmp_path / "run", **{**fedavg, **FINE, "max-weight": 1000.0, **settings})
    assert summary["failures"] == [] and summary["num_captures"] == 1
    (capture,) = [load_capture(p) for p in list_captures(tmp_path / "run")]
    assert capture.kind == "secagg-update" and capture.aggregate.clients == [0, 1, 2]
    got = _flat(capture.update, capture.param_names)
    assert torch.isfinite(got).all() and got.abs().max().item() > 100 * capture.aggregate.error_bound
    if settings.get("defense") == "central-dp-client-clipping":
        # every client clipped its update to the norm before SecAgg+ masked it: so is their mean (the
        # server's Gaussian noise comes after the curious strategy has seen it)
        slack = got.numel() ** 0.5 * capture.aggregate.error_bound
        assert got.norm().item() <= 1e-3 + slack
    if settings.get("defense") == "dp-sgd":
        # each client's Opacus accountant reached the server through the FitRes metrics SecAgg+ leaves in clear
        spent = summary["privacy"]
        assert set(spent["per_client"]) == {"0", "1", "2"} and 0 < spent["epsilon"] < float("inf")


def test_weights_beyond_the_clipping_range_are_named_not_silently_clipped(tmp_path: Path) -> None:
    # The MLP's weights reach about 0.04: a clipping range of 0.01 clips most of them in Flower's quantizer.
    _, summary = _secagg_run(tmp_path / "run", **{**FINE, "max-weight": 1.0, "clipping-range": 0.01})
    (failure,) = summary["failures"]
    assert "reach SecAgg+'s clipping-range 0.01" in failure["reason"]
    assert "set clipping-range above" in failure["reason"]
    largest = float(failure["reason"].rsplit("above ", 1)[1])
    assert 0.01 < largest < 1
    # at the fine grid's range 1 nothing is clipped, and nothing is said
    _, summary = _secagg_run(tmp_path / "fine", **{**FINE, "max-weight": 1.0})
    assert summary["failures"] == []
