"""Defenses as Flower parts (fedsim.defenses): client mods and strategy wrappers chosen by the run
config, and captures that hold exactly what reached the curious strategy. Driven in-process (no Ray):
the ClientApp object itself (with its mods) answers the strategy's messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flower_harness import NODE_IDS, FakeGrid, context_for, offline_config, set_task_identity
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedsim import defenses, task
from fedsim.client_app import app, handle_train
from fedsim.run_config import RunConfigError, resolve_config
from fedsim.strategy import CuriousFedAvg


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return offline_config(
        {
            "local-steps": 2,
            "batch-size": 8,
            "capture-images": 8,
            "model-options": '{"width": 64}',
            "optimizer": "sgd",
            "lr": 0.1,
            "clip-norm": 0.05,
            "prune-fraction": 0.2,
        }
    )


_context = context_for


def _update(global_state: dict[str, torch.Tensor], local_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """global - local as the strategy computes it (float64 difference, in the global dtype)."""
    return {k: (v.double() - local_state[k].double()).to(v.dtype) for k, v in global_state.items()}


def _federated_round(cfg: dict[str, Any], kind: str, monkeypatch: pytest.MonkeyPatch):
    """One capture round through the defense's parts: the wrapped strategy configures, the ClientApp
    (with its mods) replies, the wrapper aggregates. Returns the inner strategy, the global state, the
    messages sent, and the replies FedAvg's aggregation received (what it averaged)."""
    inner = CuriousFedAvg(
        task.model_spec(cfg),
        capture_rounds={1},
        capture_kind=kind,
        keep_in_memory=True,
        defense=cfg["defense"],
        min_available_nodes=2,
        min_train_nodes=2,
        fraction_evaluate=0.0,
    )
    server = defenses.wrap_strategy(inner, cfg, 2)
    aggregated: list[dict[str, torch.Tensor]] = []
    original = FedAvg.aggregate_train

    def spy(self: FedAvg, server_round: int, replies: Any) -> Any:
        replies = list(replies)
        aggregated.extend(m.content["arrays"].to_torch_state_dict() for m in replies)
        return original(self, server_round, replies)

    monkeypatch.setattr(FedAvg, "aggregate_train", spy)
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    messages = list(server.configure_train(1, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
    replies = [app(m, _context(m)) for m in messages]
    assert not any(r.has_error() for r in replies), [r.error for r in replies if r.has_error()]
    result, _ = server.aggregate_train(1, replies)
    assert result is not None
    return inner, arrays.to_torch_state_dict(), messages, aggregated, result


def _norm(update: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((v.double() ** 2).sum() for v in update.values())))


def test_no_defense_captures_the_clients_update_bit_for_bit(
    base: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = dict(base, defense="none")
    inner, global_state, messages, _, _ = _federated_round(cfg, "update", monkeypatch)
    assert len(inner.captures) == 2
    for msg in messages:  # the client's own reply, straight from its handler (no mods), is deterministic
        direct = handle_train(msg, _context(msg)).content["arrays"].to_torch_state_dict()
        capture = next(c for c in inner.captures if c.node_id == msg.metadata.dst_node_id)
        expected = _update(global_state, direct)
        assert capture.defense == "none"
        assert all(torch.equal(capture.update[k], expected[k]) for k in expected)
        assert _norm(expected) > 0


@pytest.mark.parametrize("defense", ["local-dp", "central-dp-client-clipping", "central-dp-server-clipping", "prune"])
@pytest.mark.parametrize("kind", ["update", "gradient"])
def test_each_defense_captures_what_the_strategy_aggregated(
    base: dict[str, Any], monkeypatch: pytest.MonkeyPatch, defense: str, kind: str
) -> None:
    cfg = dict(base, defense=defense)
    inner, global_state, messages, aggregated, result = _federated_round(cfg, kind, monkeypatch)
    assert len(inner.captures) == 2 and len(aggregated) == 2
    for capture, local in zip(inner.captures, aggregated, strict=True):
        assert capture.defense == defense and capture.defense_captured == defenses.DEFENSES[defense].captured
        update = _update(global_state, local)
        if kind == "update":
            assert all(torch.equal(capture.update[k], update[k]) for k in update)
        else:  # the one-step gradient is (global - local) / lr of the same reply
            for name, got in zip(capture.param_names, capture.gradient, strict=True):
                want = ((global_state[name].double() - local[name].double()) / capture.lr).to(got.dtype)
                assert torch.equal(got, want)
        direct = _update(
            global_state,
            handle_train(
                next(m for m in messages if m.metadata.dst_node_id == capture.node_id),
                _context(next(m for m in messages if m.metadata.dst_node_id == capture.node_id)),
            )
            .content["arrays"]
            .to_torch_state_dict(),
        )
        if defense.startswith("central-dp"):  # clipped to clip-norm, and no noise in what the server saw
            assert _norm(update) <= cfg["clip-norm"] * (1 + 1e-5)
            scale = _norm(update) / _norm(direct)
            assert all(torch.allclose(update[k].double(), direct[k].double() * scale, atol=1e-7) for k in update)
        elif defense == "local-dp":  # clipped and noised on the client: far from the plain update
            assert not all(torch.allclose(update[k], direct[k]) for k in update)
        else:  # prune: 20% of each tensor's entries survive, each equal to the client's own
            for k, v in update.items():
                kept = v != 0
                assert int(kept.sum()) <= int(np.ceil(0.2 * v.numel()))
                torch.testing.assert_close(v[kept].double(), direct[k][kept].double(), rtol=1e-5, atol=1e-9)
    if defense.startswith("central-dp"):  # the noise is in the aggregate only
        mean = {k: sum(a[k].double() for a in aggregated) / 2 for k in global_state}
        noised = result.to_torch_state_dict()
        assert any(not torch.allclose(noised[k].double(), mean[k], atol=1e-6) for k in mean)


def test_prune_update_keeps_the_largest_entries() -> None:
    update = np.array([[0.1, -3.0, 0.2], [2.0, 0.0, -0.05]], dtype=np.float32)
    np.testing.assert_array_equal(defenses.prune_update(update, 0.3), [[0, -3.0, 0], [2.0, 0, 0]])
    np.testing.assert_array_equal(defenses.prune_update(update, 1.0), update)
    np.testing.assert_array_equal(defenses.prune_update(np.arange(4), 0.5), np.arange(4))  # integers untouched
    with pytest.raises(ValueError, match="prune-fraction"):
        defenses.PruneMod(0.0)


def test_evaluate_messages_pass_no_defense(base: dict[str, Any]) -> None:
    cfg = dict(base, defense="local-dp")
    msg = Message(
        content=RecordDict(
            {"arrays": ArrayRecord(task.make_model(cfg).state_dict()), "config": ConfigRecord(dict(cfg))}
        ),
        dst_node_id=NODE_IDS[0],
        message_type="evaluate",
    )
    reply = app(msg, _context(msg))
    assert not reply.has_error() and "accuracy" in reply.content["metrics"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"defense": "noise"}, "defense must be one of none, local-dp"),
        ({"clip-norm": 0}, "clip-norm must be > 0"),
        ({"clip-norm": -1}, "clip-norm must be > 0"),
        ({"noise-multiplier": 0}, "noise-multiplier must be > 0"),
        ({"dp-epsilon": -0.5}, "dp-epsilon must be > 0"),
        ({"dp-delta": 1}, "dp-delta must be in (0, 1)"),
        ({"dp-delta": 0}, "dp-delta must be in (0, 1)"),
        ({"prune-fraction": 0}, "prune-fraction must be in (0, 1]"),
        ({"prune-fraction": 1.5}, "prune-fraction must be in (0, 1]"),
    ],
)
def test_bad_defense_settings_are_refused(overrides: dict[str, Any], words: str) -> None:
    with pytest.raises(RunConfigError) as err:
        resolve_config(overrides)
    assert words in str(err.value)


def test_dp_needs_a_model_whose_state_flower_can_clip() -> None:
    for name in ("local-dp", "central-dp-client-clipping", "central-dp-server-clipping"):
        problem = defenses.check_run(
            {"defense": name, "model": "resnet18"}, {"fc.weight": torch.float32, "bn1.num_batches_tracked": torch.int64}
        )
        assert problem and "num_batches_tracked" in problem and name in problem
    assert (
        defenses.check_run({"defense": "prune", "model": "resnet18"}, {"bn.num_batches_tracked": torch.int64}) is None
    )
    problem = defenses.check_run({"defense": "central-dp-server-clipping", "inject-client-failure": "1:0"}, None)
    assert problem and "drops a whole round" in problem
    assert defenses.check_run({"defense": "local-dp", "inject-client-failure": "1:0"}, None) is None


@pytest.mark.parametrize("defense", ["prune", "central-dp-server-clipping"])
def test_the_attack_knows_the_defense_and_names_its_adaptation(
    base: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    defense: str,
) -> None:
    from attacker.captures import jobs_from_captures
    from attacker.cli import main as attacker_main
    from attacker.jobs import support_mask
    from fedsim.capture import list_captures, save_capture

    cfg = dict(base, defense=defense)
    inner, *_ = _federated_round(cfg, "gradient", monkeypatch)
    run = tmp_path / "fed"
    for capture in inner.captures:
        save_capture(run / "captures", capture)
    jobs, _, _ = jobs_from_captures(list_captures(run))
    adaptation = defenses.DEFENSES[defense].adaptation
    for job in jobs:
        assert job.meta["defense"] == defense and job.meta["adaptation"] == adaptation
        mask = support_mask(job)
        if defense == "prune":
            assert job.match_support and mask is not None
            assert all(torch.equal(m, g != 0) for m, g in zip(mask, job.gradient)) and not all(m.all() for m in mask)
        else:
            assert not job.match_support and mask is None
    out = tmp_path / "attack"
    code = attacker_main(
        [
            "run",
            "--captures",
            str(run),
            "--attacks",
            "ig_eval",
            "--iterations",
            "2",
            "--no-lpips",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert f"the attack's adaptation: {adaptation}." in report
    assert f"Defense {defense}: the server captured {defenses.DEFENSES[defense].captured};" in report
    if defense.startswith("central-dp"):
        assert "without noise" in report  # the honest threat model, said in the report
    assert f",{defense}," in (out / "metrics.csv").read_text()


def _norms_and_density(run_dir: Path) -> list[tuple[str, float, float]]:
    from fedsim.capture import list_captures, load_capture

    out = []
    for path in list_captures(run_dir):
        capture = load_capture(path)
        update = capture.update
        norm = _norm(update)
        density = sum(int((v != 0).sum()) for v in update.values()) / sum(v.numel() for v in update.values())
        out.append((capture.defense, norm, density))
    return out


def test_a_whole_run_applies_client_clipping_and_the_wrapper(base: dict[str, Any], tmp_path: Path) -> None:
    """A whole run, the ServerApp's rounds with the ClientApp itself (its mods) on the in-process grid:
    the ClientApp's mod clips, the server's wrapper noises the aggregate. Flower's engines call the same
    ClientApp; a deployment's mods across processes: tests/test_deployment.py."""
    from flower_harness import run_in_process

    from fedsim.simulation import load_results

    run_dir = run_in_process(
        {
            "num-clients": 2,
            "num-server-rounds": 1,
            "capture-rounds": "1",
            "capture-kind": "update",
            "download": False,
            "local-steps": 2,
            "batch-size": 4,
            "capture-images": 8,
            "model-options": '{"width": 64}',
            "optimizer": "sgd",
            "lr": 0.05,
            "defense": "central-dp-client-clipping",
            "clip-norm": 0.01,
            "run-dir": str(tmp_path / "run"),
        }
    )
    found = _norms_and_density(run_dir)
    assert len(found) == 2 and load_results(run_dir)["rounds_run"] == 1
    assert all(d == "central-dp-client-clipping" and abs(n - 0.01) < 1e-4 for d, n, _ in found), found


def _halve_mods(cfg: Any) -> list[Any]:
    """A toy defense's one client mod: send half the update (global - (global - local) / 2)."""
    from flwr.app import Array

    def halve(msg: Message, context: Any, call_next: Any) -> Message:
        sent = msg.content["arrays"].to_numpy_ndarrays()
        reply = call_next(msg, context)
        record = reply.content["arrays"]
        reply.content["arrays"] = ArrayRecord(
            {
                key: Array(np.ascontiguousarray(start - (start - local) / 2))
                for key, local, start in zip(record.keys(), record.to_numpy_ndarrays(), sent, strict=True)
            }
        )
        return reply

    return [halve]


def test_a_defense_is_one_table_entry(
    base: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new defense added only as a `Defense` in `DEFENSES`: the run config takes its name, the
    ClientApp runs its mod, the capture names it, and a one-iteration attack reports its adaptation."""
    from attacker.cli import main as attacker_main
    from fedsim.capture import save_capture

    calls: list[int] = []
    toy = defenses.Defense(
        "halve",
        "send half the update",
        lambda c: calls.append(1) or _halve_mods(c),
        None,
        "half the client's update",
        "none needed: a scaled update has the same cosine distance",
        family="halving",
    )
    monkeypatch.setitem(defenses.DEFENSES, "halve", toy)
    cfg = resolve_config(dict(base, defense="halve"))
    inner, *_ = _federated_round(cfg, "gradient", monkeypatch)
    assert len(calls) == 2  # the ClientApp of each client ran the defense's mods
    assert [c.defense for c in inner.captures] == ["halve", "halve"]
    run = tmp_path / "fed"
    for capture in inner.captures:
        save_capture(run / "captures", capture)
    out = tmp_path / "attack"
    code = attacker_main(
        [
            "run",
            "--captures",
            str(run),
            "--attacks",
            "dia",
            "--iterations",
            "1",
            "--no-lpips",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    assert f"the attack's adaptation: {toy.adaptation}." in (out / "report.md").read_text()
