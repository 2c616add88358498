"""Flower ServerApp: the run config's Flower strategy inside the curious capture, with central test evaluation.

Per run folder:
  config.json     the resolved run config
  rounds.csv      one row per round (round 0: the initial model), written as rounds finish
  results.json    summary: per-round rows, final and best accuracy, early stop, wall time
  final_model.safetensors, captures/, oracle/ (audit mode)
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from safetensors.torch import save_file

from fedsim import defenses, dp_sgd, strategies, task
from fedsim.atomic import atomic_path, atomic_write
from fedsim.run_config import capture_rounds, resolve_config
from fedsim.secagg import sampled_clients
from fedsim.strategy import CuriousStrategy

ROUND_FIELDS = ["round", "accuracy", "loss", "train_loss", "num_replies", "captured", "elapsed_s"]


def run_server(grid: Grid, cfg: Mapping[str, Any], context: Context | None = None) -> dict[str, Any]:
    """Run the whole federation on ``grid`` and write its results; returns the summary. Under secure
    aggregation (``secagg``: fedsim.secagg_server) the rounds are Flower's SecAgg+ workflow, which runs in
    a LegacyContext around ``context`` (the ServerApp's; a bare one when None)."""
    t0 = time.time()
    run_dir = Path(cfg["run-dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.json", json.dumps(dict(cfg), indent=1, sort_keys=True))
    n = int(cfg["num-clients"])
    model = task.make_model(cfg)
    sampled = sampled_clients(cfg)
    test = task.load_split(cfg, train=False)
    rows: list[dict[str, Any]] = []
    patience = int(cfg["early-stop-patience"])
    best = {"accuracy": -1.0, "round": 0, "stale": 0}
    csv_path = run_dir / "rounds.csv"
    with open(csv_path, "w", newline="") as fh:
        csv.DictWriter(fh, ROUND_FIELDS).writeheader()

    def evaluate(server_round: int, state: dict[str, Any]) -> dict[str, float] | None:
        if strategy.stopped:
            return None
        model.load_state_dict(state)
        stats = task.evaluate(model, test, int(cfg["eval-batch-size"]))
        row = {
            "round": server_round,
            "accuracy": stats["accuracy"],
            "loss": stats["loss"],
            "train_loss": strategy.train_metrics.get(server_round, {}).get("train-loss", float("nan")),
            "num_replies": strategy.num_replies.get(server_round, 0),
            "captured": int(server_round > 0 and strategy.is_capture_round(server_round)),
            "elapsed_s": round(time.time() - t0, 3),
        }
        rows.append(row)
        with open(csv_path, "a", newline="") as fh:  # appended per round: a live run can be followed
            csv.DictWriter(fh, ROUND_FIELDS).writerow(row)
        if stats["accuracy"] > best["accuracy"]:
            best.update(accuracy=stats["accuracy"], round=server_round, stale=0)
        elif server_round > 0:
            best["stale"] += 1
            if patience > 0 and best["stale"] >= patience:
                strategy.stopped = True  # later rounds become no-ops
        return stats

    strategy: Any
    if cfg["secagg"]:
        from fedsim import secagg_server

        strategy = secagg_server.curious_strategy(cfg, run_dir, n, sampled, model.state_dict(), evaluate)
        base = context or Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
        final_state = secagg_server.run(grid, base, cfg, strategy, sampled)
    else:
        strategy = _curious_strategy(cfg, run_dir, n, sampled)
        final_state = _run_message_api(grid, cfg, model, strategy, sampled, evaluate)
    with atomic_path(run_dir / "final_model.safetensors") as tmp:
        save_file(
            {k: v.contiguous() for k, v in final_state.items()},
            str(tmp),
            metadata={"spec": json.dumps(task.model_spec(cfg).to_dict())},
        )
    rounds_run = rows[-1]["round"] if rows else 0
    summary = {
        "rounds": rows,
        "final_accuracy": rows[-1]["accuracy"] if rows else None,
        "best_accuracy": best["accuracy"],
        "best_round": best["round"],
        "rounds_run": rounds_run,
        "stopped_early": strategy.stopped,
        "num_captures": len(strategy.capture_paths),
        "failures": strategy.failures,
        "privacy": (
            dp_sgd.privacy_summary(cfg, strategy.client_epsilon)
            if defenses.get_defense(str(cfg["defense"])).in_local_round
            else defenses.privacy_spent(cfg, rounds_run, sampled, n)
        ),
        "wall_s": round(time.time() - t0, 3),
    }
    # Standard JSON: a value that is not a number (round 0 has no training loss) is written as null.
    atomic_write(run_dir / "results.json", json.dumps(_finite(summary), indent=1, allow_nan=False))
    return summary


def _run_message_api(
    grid: Grid, cfg: Mapping[str, Any], model: Any, strategy: CuriousStrategy, sampled: int, evaluate: Any
) -> dict[str, Any]:
    """The rounds as Flower's Message API runs them: the strategy's ``start``; the final state dict."""
    # The defense's strategy wrapper (central DP), if any, goes around the curious strategy: Flower's
    # server-side clipping happens in the wrapper before the strategy sees the replies, and the noise
    # after it aggregated them, so the captures hold clipped, un-noised updates (fedsim.defenses).
    server = defenses.wrap_strategy(strategy, cfg, sampled)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        stats = evaluate(server_round, arrays.to_torch_state_dict())
        return None if stats is None else MetricRecord(stats)

    sent = ConfigRecord({k: v for k, v in cfg.items()})
    result = server.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=sent,
        evaluate_config=ConfigRecord(dict(sent)),
        evaluate_fn=evaluate_fn,
    )
    return result.arrays.to_torch_state_dict() if result.arrays is not None else model.state_dict()


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, nested containers included."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _curious_strategy(cfg: Mapping[str, Any], run_dir: Path, n: int, sampled: int) -> CuriousStrategy:
    """The run config's Flower strategy (``strategy``, ``strategy-options``: fedsim.strategies) inside
    the curious capture, which records into ``run_dir`` and leaves aggregation to that strategy.
    Adaptive strategies (FedAdam, ...) take their starting point from the initial model that
    ``start`` sends in round 1 (their configure_train keeps it), so nothing more is passed here."""
    inner = strategies.build_strategy(
        str(cfg["strategy"]),
        str(cfg["strategy-options"]),
        fraction_train=float(cfg["fraction-train"]),
        fraction_evaluate=float(cfg["fraction-evaluate"]),
        min_train_nodes=sampled,
        min_evaluate_nodes=max(1, int(n * float(cfg["fraction-evaluate"]))),
        min_available_nodes=n,  # else round 1 may sample only the nodes connected so far
    )
    return CuriousStrategy(
        inner,
        task.model_spec(cfg),
        capture_rounds=capture_rounds(cfg),
        capture_kind=cfg["capture-kind"],
        label_policy=cfg["labels"],
        defense=cfg["defense"],
        capture_dir=run_dir / "captures",
        oracle_dir=run_dir / "oracle",
    )


def make_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose config is the run config (``flwr run``) overlaid by ``overrides``."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = resolve_config(dict(context.run_config), dict(overrides or {}), strict=False)
        run_server(grid, cfg, context)

    return server_app


app = make_server_app()
