"""The ServerApp under secure aggregation (``secagg``): Flower's DefaultWorkflow with SecAggPlusWorkflow
as its fit round, driving a legacy ``flwr.server.strategy`` strategy inside the curious capture.

SecAggPlusWorkflow accepts only a ``LegacyContext`` and calls a legacy strategy's ``aggregate_fit`` with
every client's FitRes holding the same vector: the unmasked, dequantized num_examples-weighted mean of
the clients' weights. So the curious server here (:class:`CuriousSecAggStrategy`) records one aggregate
capture per capture round (``fedsim.capture_kinds``: the aggregate kinds): global − mean (divided by the
lr in a one-step round), the clients in it with their weights (num_examples travel in clear), the
quantization settings and the mean's quantization step. No capture holds one client's update: the
server never has one. The clients' meta (mode, lr, labels when known) and, in audit mode, their oracles
arrive in clear in the FitRes metrics (``fedsim.client_app.legacy_mod``); the oracles are kept apart.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context
from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerConfig
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
from flwr.supercore import log

from fedsim import defenses, secagg, strategies, task
from fedsim.capture import Aggregate, Capture, CaptureError, OracleRecord, save_capture, save_oracle
from fedsim.capture_kinds import CAPTURE_KINDS, aggregate_kind
from fedsim.defenses import get_defense
from fedsim.models import ModelSpec, build_model
from fedsim.run_config import LABEL_POLICIES, capture_rounds
from fedsim.secagg import META_METRIC, ORACLE_METRIC
from fedsim.strategy import _parse_oracle

logger = logging.getLogger("fedsim.secagg")

EvaluateFn = Callable[[int, dict[str, torch.Tensor]], dict[str, float] | None]


def weighted_metrics(results: list[tuple[int, dict[str, Scalar]]]) -> dict[str, Scalar]:
    """The num_examples-weighted mean of each numeric metric (what the Message API's FedAvg does for its
    replies' metrics; the legacy strategies take it as their metrics aggregation function)."""
    total = sum(n for n, _ in results)
    keys = {k for _, m in results for k, v in m.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return {k: sum(n * float(m[k]) for n, m in results if k in m) / total for k in sorted(keys)} if total else {}


class CuriousSecAggStrategy(Strategy):
    """A legacy Flower strategy (``flwr.server.strategy``), by composition, recording the aggregate that
    SecAgg+ hands it in ``capture_rounds``. Every Strategy method delegates to ``strategy``; only
    ``configure_fit`` (the capture flags in the round's config) and ``aggregate_fit`` (the capture, the
    oracles kept apart, and the aggregate cast back to the model's dtypes) add anything. The run's
    bookkeeping (``stopped``, ``train_metrics``, ``num_replies``, ``failures``, ``client_epsilon``,
    ``capture_paths``) is the Message-API :class:`fedsim.strategy.CuriousStrategy`'s."""

    def __init__(
        self,
        strategy: Strategy,
        spec: ModelSpec,
        *,
        quantization: Mapping[str, Any],
        capture_rounds: Iterable[int] | str | None = None,
        capture_kind: str = "gradient",
        label_policy: str = "known",
        capture_dir: str | Path | None = None,
        oracle_dir: str | Path | None = None,
        keep_in_memory: bool = False,
        defense: str = "none",
    ) -> None:
        super().__init__()
        self.strategy = strategy
        if CAPTURE_KINDS.get(capture_kind) is None or CAPTURE_KINDS[capture_kind].aggregate_of:
            raise ValueError(f"capture_kind must be a client kind, got {capture_kind!r}")
        if label_policy not in LABEL_POLICIES:
            raise ValueError(f"label_policy must be one of {LABEL_POLICIES}, got {label_policy!r}")
        self.spec = spec
        self.quantization = dict(quantization)
        self.capture_rounds: set[int] | str = "all" if capture_rounds == "all" else set(capture_rounds or ())  # type: ignore[arg-type]
        self.capture_kind = capture_kind
        self.label_policy = label_policy
        self.defense = get_defense(defense)
        self.capture_dir = Path(capture_dir) if capture_dir is not None else None
        self.oracle_dir = Path(oracle_dir) if oracle_dir is not None else None
        self.keep_in_memory = keep_in_memory
        self.captures: list[Capture] = []
        self.oracles: list[OracleRecord] = []
        self.capture_paths: list[Path] = []
        self.train_metrics: dict[int, dict[str, float]] = {}
        self.num_replies: dict[int, int] = {}
        self.failures: list[dict[str, Any]] = []
        self.client_epsilon: dict[int, dict[int, float]] = {}
        self.stopped = False
        model = build_model(spec)
        self.state_keys = list(model.state_dict())
        self._dtypes = {k: v.dtype for k, v in model.state_dict().items()}
        self._param_names = [n for n, _ in model.named_parameters()]
        self._sent: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    def __repr__(self) -> str:
        return f"curious capture (SecAgg+ aggregates) around {self.strategy!r}"

    def is_capture_round(self, server_round: int) -> bool:
        return self.capture_rounds == "all" or server_round in self.capture_rounds  # type: ignore[operator]

    def state_dict(self, parameters: Parameters) -> dict[str, torch.Tensor]:
        """Legacy Parameters (no names) as the model's state dict, in its dtypes."""
        arrays = parameters_to_ndarrays(parameters)
        if len(arrays) != len(self.state_keys):
            raise CaptureError(f"{len(arrays)} arrays for a model of {len(self.state_keys)} state entries")
        return {k: torch.from_numpy(np.array(a)).to(self._dtypes[k]) for k, a in zip(self.state_keys, arrays)}

    # -- delegation ---------------------------------------------------------------------------------

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, Any]]:
        if self.stopped:
            return []
        instructions = self.strategy.configure_fit(server_round, parameters, client_manager)
        flags = CAPTURE_KINDS[self.capture_kind].round_config(self.is_capture_round(server_round))
        for _, fit_ins in instructions:
            fit_ins.config.update(flags)
        if instructions:
            self._sent = {server_round: (self.state_dict(parameters), dict(instructions[0][1].config))}
        return instructions

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, Any]]:
        if self.stopped:
            return []
        return self.strategy.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> tuple[float | None, dict]:
        return self.strategy.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.strategy.evaluate(server_round, parameters)

    # -- what the server sees ---------------------------------------------------------------------------

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        self.num_replies[server_round] = len(results)
        # A client that dropped out: SecAgg+ unmasked the mean without it. Its workflow lists an error
        # reply once per loop over the replies, so each distinct failure is recorded once.
        for failure in dict.fromkeys(_failure_text(f) for f in failures):
            self._record_failure(server_round, failure)
        metas = [self._meta(fitres) for _, fitres in results]
        for meta, (_, fitres) in zip(metas, results):
            if "dp-epsilon-spent" in fitres.metrics:
                spent = float(fitres.metrics["dp-epsilon-spent"])
                part = int(meta.get("partition-id", -1))
                self.client_epsilon.setdefault(server_round, {})[part] = spent if spent >= 0 else float("inf")
        if results and not all(np.isfinite(a).all() for a in parameters_to_ndarrays(results[0][1].parameters)):
            # A weight above max-weight overflows Flower's quantized sum (its mod warns of it): no mean, no
            # round; the global model stays as it was.
            heaviest = max(r.num_examples for _, r in results)
            self._record_failure(
                server_round,
                f"SecAgg+ returned a non-finite mean (a client's num_examples {heaviest} against max-weight "
                f"{self.quantization['max_weight']:g} overflowed the quantized sum); round skipped",
            )
            return None, {}
        if results and server_round in self._sent:
            clipped, largest = secagg.clipped_entries(
                self._sent[server_round][0], [r.num_examples for _, r in results], self.quantization
            )
            if clipped:
                self._record_failure(
                    server_round,
                    f"{clipped} weights of the global model, times their client's weight num_examples/max-weight, "
                    f"reach SecAgg+'s clipping-range {self.quantization['clipping_range']:g} (largest {largest:.3g}): "
                    "Flower's quantizer clips them and the mean is wrong there; "
                    f"set clipping-range above {largest:.3g}",
                )
        if results and self.is_capture_round(server_round) and server_round in self._sent:
            try:
                self._capture(server_round, results, metas)
            except (CaptureError, KeyError, ValueError, OSError) as err:
                self._record_failure(server_round, f"capture failed: {err}")
        # The strategy aggregates what it would without the capture: the metrics without meta and oracle.
        plain = [
            (proxy, FitRes(r.status, r.parameters, r.num_examples, _plain_metrics(r.metrics))) for proxy, r in results
        ]
        parameters, metrics = self.strategy.aggregate_fit(server_round, plain, failures)
        if parameters is not None:  # dequantized in float64: back to the model's dtypes
            state = self.state_dict(parameters)
            parameters = ndarrays_to_parameters([v.numpy() for v in state.values()])
        if metrics:
            self.train_metrics[server_round] = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        return parameters, metrics

    def _meta(self, fitres: FitRes) -> dict[str, Any]:
        text = fitres.metrics.get(META_METRIC)
        return json.loads(str(text)) if text is not None else {}

    def _record_failure(self, server_round: int, failure: tuple[int, str] | str) -> None:
        node_id, reason = failure if isinstance(failure, tuple) else (-1, failure)
        lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", reason).splitlines() if line.strip()]
        entry = {"round": server_round, "node_id": node_id, "reason": (lines[-1] if lines else reason)[:500]}
        self.failures.append(entry)
        logger.warning("round %d, node %d: %s", server_round, node_id, entry["reason"])

    def _capture(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], metas: list[dict[str, Any]]
    ) -> None:
        global_state, sent = self._sent[server_round]
        members = sorted(zip(metas, results), key=lambda m: int(m[0].get("partition-id", -1)))
        modes = {meta.get("mode") for meta, _ in members}
        if len(modes) != 1:
            raise CaptureError(f"round {server_round}: the clients ran different rounds ({sorted(map(str, modes))})")
        one_step = modes == {"one-step"}
        lrs = {float(meta.get("lr", sent.get("lr", 0.0))) for meta, _ in members}
        if len(lrs) != 1:
            raise CaptureError(f"round {server_round}: the clients' lr differ ({sorted(lrs)})")
        lr = lrs.pop()
        # SecAgg+ wrote the one unmasked mean into every FitRes: the first one's is the server's view.
        mean = self.state_dict_float64(results[0][1].parameters)
        num_examples = [int(r.num_examples) for _, (_, r) in members]
        images = [int(meta["batch-size"]) if one_step else int(r.num_examples) for meta, (_, r) in members]
        step = secagg.aggregate_step(num_examples, self.quantization)
        known = all("labels" in meta for meta, _ in members)
        labels = torch.tensor([v for meta, _ in members for v in meta["labels"]], dtype=torch.int64) if known else None
        update = {k: global_state[k].double() - mean[k] for k in self._param_names}
        scale = lr if one_step else 1.0  # a one-step capture holds the gradient: the update over lr
        rms = float(torch.cat([u.flatten() for u in update.values()]).pow(2).mean().sqrt()) / scale
        aggregate = Aggregate(
            clients=[int(meta.get("partition-id", -1)) for meta, _ in members],
            node_ids=[int(proxy.node_id) for _, (proxy, _) in members],
            num_examples=num_examples,
            images=images,
            quantization=self.quantization,
            step=step / scale,
            rms=rms,
        )
        common = dict(
            spec=self.spec,
            weights=global_state,
            round=server_round,
            client=-1,  # no one client: the mean of aggregate.clients
            node_id=0,
            num_examples=sum(num_examples),
            lr=lr,
            param_names=self._param_names,
            hyperparameters=sent,
            defense=self.defense.name,
            defense_captured=f"the SecAgg+ mean of the clients' replies, each {self.defense.captured}",
            labels=labels,
            label_policy="known" if labels is not None else "recovered",
            aggregate=aggregate,
        )
        if one_step:
            if lr <= 0:
                raise CaptureError(f"round {server_round}: one-step replies without a positive lr")
            gradient = [
                ((global_state[n].double() - mean[n]) / lr).to(global_state[n].dtype) for n in self._param_names
            ]
            capture = Capture(kind=aggregate_kind("gradient"), gradient=gradient, batch_size=sum(images), **common)
        else:
            steps = {int(meta.get("local-steps", 1)) for meta, _ in members}
            step_labels = None
            if all("step-labels" in meta for meta, _ in members):
                step_labels = torch.tensor([v for meta, _ in members for v in meta["step-labels"]], dtype=torch.int64)
            update = {
                k: (v.double() - mean[k]).to(v.dtype) if v.is_floating_point() else v for k, v in global_state.items()
            }
            capture = Capture(
                kind=aggregate_kind("update"),
                update=update,
                batch_size=int(members[0][0].get("batch-size", 0)),
                step_labels=step_labels,
                local_steps=max(steps),
                proximal_mu=float(members[0][0].get("proximal-mu", sent.get("proximal-mu", 0.0))),
                **common,
            )
        if self.capture_dir is not None:
            self.capture_paths.append(save_capture(self.capture_dir, capture))
        if self.keep_in_memory:
            self.captures.append(capture)
        for meta, (proxy, fitres) in members:  # the ground truth, kept apart (audit mode)
            if ORACLE_METRIC in fitres.metrics:
                oracle = _oracle(fitres.metrics[ORACLE_METRIC], server_round, meta, int(proxy.node_id))
                if self.oracle_dir is not None:
                    save_oracle(self.oracle_dir, oracle)
                if self.keep_in_memory:
                    self.oracles.append(oracle)

    def state_dict_float64(self, parameters: Parameters) -> dict[str, torch.Tensor]:
        arrays = parameters_to_ndarrays(parameters)
        return {k: torch.from_numpy(np.asarray(a, dtype=np.float64)) for k, a in zip(self.state_keys, arrays)}


def _failure_text(failure: Any) -> tuple[int, str]:
    """(node id or -1, reason) of a failure the workflow passes: a (proxy, FitRes) or an Exception
    wrapping the reply's Error (which does not name the node)."""
    if isinstance(failure, tuple):
        return int(failure[0].node_id), f"client error: {failure[1].status.message}"
    error = failure.args[0] if getattr(failure, "args", None) else failure
    return -1, f"client error: {getattr(error, 'reason', error)}"


def _plain_metrics(metrics: dict[str, Scalar]) -> dict[str, Scalar]:
    return {k: v for k, v in metrics.items() if k not in (META_METRIC, ORACLE_METRIC)}


def _oracle(blob: Any, server_round: int, meta: dict[str, Any], node_id: int) -> OracleRecord:
    """A client's oracle from its FitRes metrics, read as the Message-API server reads its record."""
    record = ConfigRecord({"safetensors": bytes(blob)})
    return _parse_oracle(record, server_round, int(meta.get("partition-id", -1)), node_id)


def curious_strategy(
    cfg: Mapping[str, Any],
    run_dir: Path,
    n: int,
    sampled: int,
    initial: dict[str, torch.Tensor],
    evaluate: EvaluateFn,
) -> CuriousSecAggStrategy:
    """The run config's strategy in its legacy form (``fedsim.strategies.build_legacy_strategy``) inside
    the curious capture of aggregates. The legacy API sends each round's config from ``on_fit_config_fn``:
    the resolved run config and the round, as the Message-API server sends them."""
    sent = {k: v for k, v in cfg.items()}
    holder: list[CuriousSecAggStrategy] = []

    def fit_config(server_round: int) -> dict[str, Scalar]:
        return dict(sent, **{"server-round": server_round})

    def evaluate_fn(server_round: int, arrays: list[np.ndarray], config: dict[str, Scalar]) -> Any:
        stats = evaluate(server_round, holder[0].state_dict(ndarrays_to_parameters(arrays)))
        return None if stats is None else (float(stats["loss"]), dict(stats))

    inner = strategies.build_legacy_strategy(
        str(cfg["strategy"]),
        str(cfg["strategy-options"]),
        fraction_train=float(cfg["fraction-train"]),
        fraction_evaluate=float(cfg["fraction-evaluate"]),
        min_train_nodes=sampled,
        min_evaluate_nodes=max(1, int(n * float(cfg["fraction-evaluate"]))),
        min_available_nodes=n,
        evaluate_fn=evaluate_fn,
        on_fit_config_fn=fit_config,
        on_evaluate_config_fn=fit_config,
        initial_parameters=ndarrays_to_parameters([v.numpy() for v in initial.values()]),
        fit_metrics_aggregation_fn=weighted_metrics,
        evaluate_metrics_aggregation_fn=weighted_metrics,
    )
    strategy = CuriousSecAggStrategy(
        inner,
        task.model_spec(cfg),
        quantization=secagg.quantization(cfg),
        capture_rounds=capture_rounds(cfg),
        capture_kind=cfg["capture-kind"],
        label_policy=cfg["labels"],
        defense=cfg["defense"],
        capture_dir=run_dir / "captures",
        oracle_dir=run_dir / "oracle",
    )
    holder.append(strategy)
    return strategy


def run(grid: Any, context: Context, cfg: Mapping[str, Any], strategy: CuriousSecAggStrategy, sampled: int) -> Any:
    """Flower's DefaultWorkflow with SecAggPlusWorkflow as its fit round, on ``grid``: the run's rounds
    in a ``LegacyContext`` around ``context``, the defense's legacy wrapper (central DP with client
    clipping) around the curious strategy. Returns the final global model as a state dict."""
    server = defenses.wrap_strategy(strategy, cfg, sampled)
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=int(cfg["num-server-rounds"])), strategy=server)
    log(logging.INFO, "secure aggregation: SecAgg+ with %s", secagg.workflow_options(cfg))
    secagg.make_workflow(cfg)(grid, legacy)
    from flwr.compat.common.recorddict_compat import arrayrecord_to_parameters

    return strategy.state_dict(arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], True))
