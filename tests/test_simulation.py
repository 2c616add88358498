"""The federated side: client app, curious strategy, and a real Ray simulation on offline MNIST."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from flower_harness import NODE_IDS, FakeGrid, client_context, offline_config, set_task_identity
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedsim import task
from fedsim.capture import find_oracle, list_captures, list_oracles, load_capture
from fedsim.client_app import handle_evaluate, handle_train
from fedsim.models import set_dropout_mode, set_masks
from fedsim.run_config import resolve_config
from fedsim.strategy import CuriousFedAvg


class InProcessGrid(FakeGrid):
    """A Grid that runs the ClientApp's handlers in this process: the server loop without Ray."""

    def send_and_receive(self, messages: Any, timeout: float | None = None) -> list[Message]:
        handlers = {"train": handle_train, "evaluate": handle_evaluate}
        return [
            handlers[m.metadata.message_type](
                m, _context(NODE_IDS.index(m.metadata.dst_node_id), m.metadata.dst_node_id)
            )
            for m in messages
        ]


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


@pytest.fixture(scope="module")
def cfg() -> dict[str, Any]:
    return offline_config({"local-steps": 2, "victim-batch-size": 2, "audit": True, "model-options": '{"width": 64}'})


_context = client_context


def _strategy(cfg: dict[str, Any], **kwargs: Any) -> CuriousFedAvg:
    return CuriousFedAvg(
        task.model_spec(cfg), min_available_nodes=2, min_train_nodes=2, fraction_evaluate=0.0, **kwargs
    )


def _round(strategy: CuriousFedAvg, cfg: dict[str, Any], server_round: int) -> tuple[ArrayRecord, list[Message]]:
    """One training round driven by hand: configure, run each client directly, return the replies."""
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
    replies = []
    for msg in messages:
        partition = NODE_IDS.index(msg.metadata.dst_node_id)
        replies.append(handle_train(msg, _context(partition, msg.metadata.dst_node_id)))
    return arrays, replies


def test_captured_one_step_gradient_is_the_clients_gradient(cfg: dict[str, Any]) -> None:
    strategy = _strategy(cfg, capture_rounds="all", keep_in_memory=True)
    arrays, replies = _round(strategy, cfg, 1)
    strategy.aggregate_train(1, replies)
    assert len(strategy.captures) == 2 and len(strategy.oracles) == 2
    for capture, oracle in zip(strategy.captures, strategy.oracles):
        assert capture.kind == "gradient" and capture.batch_size == 2 and capture.lr == cfg["onestep-lr"]
        assert torch.equal(capture.labels, oracle.labels)  # known-label policy
        assert capture.node_id in NODE_IDS and capture.client == NODE_IDS.index(capture.node_id)
        assert all(torch.equal(capture.weights[k], v) for k, v in arrays.to_torch_state_dict().items())
        # the client's gradient, computed directly: same model, weights, masks and batch
        model = task.make_model(cfg, capture.weights)
        set_dropout_mode(model, "replay")
        set_masks(model, oracle.masks)
        model.train()
        loss = F.cross_entropy(model(oracle.images), oracle.labels)
        expected = torch.autograd.grad(loss, list(model.parameters()))
        for got, want in zip(capture.gradient, expected, strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-10)
        assert sum(float(g.abs().sum()) for g in expected) > 0


def test_capture_never_changes_aggregation(cfg: dict[str, Any], tmp_path: Path) -> None:
    for kind, one_step in (("update", False), ("gradient", True)):
        driver = _strategy(cfg, capture_rounds="all" if one_step else None)
        _, replies = _round(driver, cfg, 1)  # the same replies go to both strategies
        on = _strategy(
            cfg,
            capture_rounds="all",
            capture_kind=kind,
            capture_dir=tmp_path / kind / "captures",
            oracle_dir=tmp_path / kind / "oracle",
        )
        off = _strategy(cfg)
        arrays = ArrayRecord(task.make_model(cfg).state_dict())
        for strategy in (on, off):  # both must have "sent" the round's global model
            list(strategy.configure_train(1, arrays, ConfigRecord(dict(cfg)), FakeGrid()))
        agg_on, metrics_on = on.aggregate_train(1, replies)
        agg_off, metrics_off = off.aggregate_train(1, replies)
        sd_on, sd_off = agg_on.to_torch_state_dict(), agg_off.to_torch_state_dict()
        assert list(sd_on) == list(sd_off)
        assert all(torch.equal(sd_on[k], sd_off[k]) and sd_on[k].dtype == torch.float32 for k in sd_on)
        assert dict(metrics_on) == dict(metrics_off)
        captures = [load_capture(p) for p in list_captures(tmp_path / kind)]
        assert len(captures) == 2 and {c.kind for c in captures} == {kind}
        assert len(list_oracles(tmp_path / kind)) == (2 if one_step else 0)
        if kind == "update":
            assert captures[0].update is not None and captures[0].labels is None


def test_client_evaluate(cfg: dict[str, Any]) -> None:
    arrays = ArrayRecord(task.make_model(cfg).state_dict())
    msg = Message(
        content=RecordDict({"arrays": arrays, "config": ConfigRecord(dict(cfg))}),
        dst_node_id=NODE_IDS[0],
        message_type="evaluate",
    )
    reply = handle_evaluate(msg, _context(0, NODE_IDS[0]))
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] > 0 and 0.0 <= metrics["accuracy"] <= 1.0 and metrics["loss"] > 0


def test_server_loop_early_stop_and_round_files(cfg: dict[str, Any], tmp_path: Path) -> None:
    from fedsim.server_app import run_server

    # lr 0: the model never changes, so accuracy cannot improve and patience 1 stops after round 1
    run_cfg = resolve_config(
        cfg,
        {
            "optimizer": "sgd",
            "lr": 0.0,
            "num-server-rounds": 4,
            "early-stop-patience": 1,
            "capture-rounds": "1",
            "capture-kind": "update",
            "run-dir": str(tmp_path),
        },
    )
    summary = run_server(InProcessGrid(), run_cfg)
    assert summary["stopped_early"] and summary["rounds_run"] == 1
    assert [row["round"] for row in summary["rounds"]] == [0, 1]
    assert summary["rounds"][0]["accuracy"] == summary["rounds"][1]["accuracy"]
    with open(tmp_path / "rounds.csv") as fh:
        assert [int(r["round"]) for r in csv.DictReader(fh)] == [0, 1]
    captures = [load_capture(p) for p in list_captures(tmp_path)]
    assert len(captures) == 2 and all(c.kind == "update" for c in captures)
    assert all(float(t.abs().max()) == 0.0 for c in captures for t in c.update.values())  # lr 0: no change
    assert (tmp_path / "final_model.safetensors").is_file() and (tmp_path / "results.json").is_file()


def test_pyproject_app_config_matches_the_run_config_defaults() -> None:
    """`flwr run` rejects run-config keys that pyproject's [tool.flwr.app.config] lacks, and takes its
    defaults from there: every key and every value must be the schema's (same type too)."""
    import tomllib
    from pathlib import Path

    from fedsim.run_config import DEFAULTS

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    app_config = pyproject["tool"]["flwr"]["app"]["config"]
    assert set(app_config) == set(DEFAULTS)
    for key, default in DEFAULTS.items():
        assert (app_config[key], type(app_config[key])) == (default, type(default)), key


def test_run_config_schema_validates_and_maps_snake_case() -> None:
    from fedsim.run_config import DEFAULTS, SCHEMA, RunConfigError, from_run_config, resolve_config, to_run_config

    assert [s.key for s in SCHEMA] == list(DEFAULTS) and len(DEFAULTS) == len(SCHEMA)
    assert all(s.describe() for s in SCHEMA if s.choices or s.range)
    snake = {"num_server_rounds": 2, "model_options": {"width": 64}, "labels": "recovered", "onestep_float64": False}
    flat = to_run_config(snake)
    assert flat == {
        "num-server-rounds": 2,
        "model-options": '{"width": 64}',
        "labels": "recovered",
        "onestep-float64": False,
    }
    assert to_run_config(flat) == flat  # hyphenated keys pass through
    assert from_run_config(flat) == snake
    cfg = resolve_config(snake)
    assert cfg["num-server-rounds"] == 2 and cfg["model-options"] == '{"width": 64}' and cfg["labels"] == "recovered"
    assert from_run_config(cfg)["model_options"] == {"width": 64}
    assert resolve_config({"num-clients": "3", "audit": "yes", "lr": 0})["num-clients"] == 3
    for bad, match in (
        ({"labels": "unknown"}, "labels must be one of known, recovered"),
        ({"label-policy": "known"}, "is now labels"),
        ({"p": 1.0}, r"p must be in \[0, 1\)"),
        ({"num-server-rounds": 0}, "must be >= 1"),
        ({"onestep-lr": 0}, "must be > 0"),
        ({"batch-size": 2.5}, "expected an int"),
        ({"audit": "maybe"}, "expected a boolean"),
        ({"capture-rounds": "1,x"}, "capture-rounds"),
        ({"model-options": "[1]"}, "JSON object"),
        ({"colour": "red"}, "unknown run config key"),
    ):
        with pytest.raises(RunConfigError, match=match):
            resolve_config(bad)
    assert resolve_config({"colour": "red"}, strict=False) == DEFAULTS


@dataclass
class Simulated:
    """The module's one Ray simulation, run as `attacker` runs it (under its logging, in a process of its own)."""

    run_dir: Path
    returncode: int
    output: str


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    """3 clients, 2 rounds, round 2 captured and audited; `attacker`'s root logging configured first."""
    import subprocess
    import sys

    tmp_path = tmp_path_factory.mktemp("simulated")
    config = {
        "num-clients": 3,
        "num-server-rounds": 2,
        "capture-rounds": "2",
        "audit": True,
        "download": False,
        "local-steps": 3,
        "victim-batch-size": 2,
        "run-dir": str(tmp_path / "run"),
    }
    code = (
        "from attacker.cli import configure_logging; configure_logging(); "
        f"from fedsim.simulation import run_simulation_job; run_simulation_job({config!r})"
    )
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    return Simulated(tmp_path / "run", proc.returncode, proc.stdout + proc.stderr)


def test_ray_simulation_writes_captures_and_accuracy(simulated: Simulated) -> None:
    from fedsim.simulation import load_results, run_simulation_job

    assert simulated.returncode == 0, simulated.output[-4000:]
    run_dir = simulated.run_dir
    with open(run_dir / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["round"]) for r in rows] == [0, 1, 2]
    assert [int(r["num_replies"]) for r in rows] == [0, 3, 3]
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rows)
    assert float(rows[1]["accuracy"]) > float(rows[0]["accuracy"])  # a round of training helps
    results = load_results(run_dir)
    assert results["num_captures"] == 3 and results["rounds_run"] == 2
    assert json.loads((run_dir / "config.json").read_text())["num-clients"] == 3
    paths = list_captures(run_dir)
    assert len(paths) == 3 and len(list_oracles(run_dir)) == 3
    captures = [load_capture(p) for p in paths]
    assert {c.client for c in captures} == {0, 1, 2} and {c.round for c in captures} == {2}
    for capture in captures:
        assert capture.kind == "gradient" and capture.batch_size == 2
        oracle = find_oracle(run_dir, capture)
        assert torch.equal(oracle.labels, capture.labels) and oracle.images.shape == (2, 1, 28, 28)
    with pytest.raises(FileExistsError):
        run_simulation_job({"run-dir": str(run_dir), "download": False})


def test_flower_log_lines_are_printed_once_under_the_attacker_logging(simulated: Simulated) -> None:
    """`attacker` configures root logging; Flower's logger has a handler of its own. A tiny
    simulation under that configuration prints each Flower line once (it used to print twice)."""
    import re

    assert simulated.returncode == 0, simulated.output[-4000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", simulated.output)
    lines = [re.sub(r"^(DEBUG|INFO|WARNING|ERROR)\s*:\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    assert sum("[ROUND 1/2]" in line for line in lines) == 1, text[-3000:]
    assert sum("[ROUND 2/2]" in line for line in lines) == 1, text[-3000:]
    assert sum("Starting CuriousStrategy strategy" in line for line in lines) == 1
    assert [a for a, b in zip(lines, lines[1:]) if a == b] == [], text[-3000:]


def test_ray_cpus_are_the_machines_unless_the_environment_names_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedsim.simulation import RAY_CPUS_ENV, ray_num_cpus

    monkeypatch.delenv(RAY_CPUS_ENV, raising=False)
    assert ray_num_cpus() == (os.cpu_count() or 1)
    monkeypatch.setenv(RAY_CPUS_ENV, " 1 ")
    assert ray_num_cpus() == 1
    for bad in ("0", "-2", "1.5", "all"):
        monkeypatch.setenv(RAY_CPUS_ENV, bad)
        with pytest.raises(ValueError, match=f"{RAY_CPUS_ENV} must be a whole number of CPUs, at least 1; got '{bad}'"):
            ray_num_cpus()
