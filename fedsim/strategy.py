"""The honest-but-curious server: a wrapper around any Flower strategy that records what each client
sends in chosen rounds.

Recording is a side channel only: aggregation is the wrapped strategy's own code on the same
replies (``fedsim.strategies`` builds it: FedAvg, FedProx, FedAdam, ...), so the global model is the
same with capture on or off. In capture rounds of kind "gradient" the server asks clients for a
one-step round (plain SGD, one step on B victim images) and recovers the exact gradient as
(global - local) / lr; otherwise it stores the update (global - local).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.supercore import log
from safetensors.torch import load as st_load

from fedsim.capture import Capture, CaptureError, OracleRecord, save_capture, save_oracle
from fedsim.capture_kinds import CAPTURE_KINDS
from fedsim.defenses import get_defense
from fedsim.models import ModelSpec, build_model
from fedsim.run_config import LABEL_POLICIES

logger = logging.getLogger("fedsim.strategy")


class CuriousStrategy(Strategy):
    """Any Flower strategy, by composition, capturing client replies in ``capture_rounds`` (a set of
    rounds, or "all"). Every Strategy method delegates to ``strategy``; only ``configure_train``
    (the capture flags in the round's config) and ``aggregate_train`` (recording the replies before
    the wrapped strategy aggregates them) add anything. Other attributes (``fraction_train``, FedOpt's
    ``eta``, ...) read through to the wrapped strategy.

    Captures go to ``capture_dir`` and oracle records (audit mode) to ``oracle_dir`` when given,
    and to ``self.captures`` / ``self.oracles`` when ``keep_in_memory``. Setting ``stopped`` makes
    every later round a no-op (early stopping without leaving Flower's ``start`` loop).
    ``label_policy`` is the run config's ``labels`` (known | recovered); each capture records
    "known" when the client's reply carried its labels, else "recovered".

    A capture is the reply as it reaches this strategy: after the client's mods (local DP, clipping,
    pruning) and, when a DP wrapper from ``fedsim.defenses`` wraps this strategy, after its
    server-side clipping but before its noise (added to the aggregate): what the server really sees.
    """

    def __init__(
        self,
        strategy: Strategy,
        spec: ModelSpec,
        *,
        capture_rounds: Iterable[int] | str | None = None,
        capture_kind: str = "gradient",
        label_policy: str = "known",
        capture_dir: str | Path | None = None,
        oracle_dir: str | Path | None = None,
        keep_in_memory: bool = False,
        defense: str = "none",
    ) -> None:
        self.strategy = strategy
        self.defense = get_defense(defense)  # recorded in every capture (what the capture holds under it)
        if capture_kind not in CAPTURE_KINDS:
            raise ValueError(f"capture_kind must be one of {tuple(CAPTURE_KINDS)}, got {capture_kind!r}")
        if label_policy not in LABEL_POLICIES:
            raise ValueError(f"label_policy must be one of {LABEL_POLICIES}, got {label_policy!r}")
        self.spec = spec
        self.capture_rounds: set[int] | str = (
            "all" if capture_rounds == "all" else set(capture_rounds or ())  # type: ignore[arg-type]
        )
        self.capture_kind = capture_kind
        self.label_policy = label_policy
        self.capture_dir = Path(capture_dir) if capture_dir is not None else None
        self.oracle_dir = Path(oracle_dir) if oracle_dir is not None else None
        self.keep_in_memory = keep_in_memory
        self.captures: list[Capture] = []
        self.oracles: list[OracleRecord] = []
        self.capture_paths: list[Path] = []
        self.train_metrics: dict[int, dict[str, float]] = {}
        self.num_replies: dict[int, int] = {}
        self.failures: list[dict[str, Any]] = []  # client errors and failed captures, per round
        # dp-sgd: the epsilon each client reported it had spent, per round (round -> partition -> epsilon)
        self.client_epsilon: dict[int, dict[int, float]] = {}
        self.stopped = False
        # aggregate_train does not receive what was sent: keep it from configure_train.
        self._sent: dict[int, tuple[ArrayRecord, dict[str, Any]]] = {}
        self._param_names = [n for n, _ in build_model(spec).named_parameters()]

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes this wrapper lacks: read them from the wrapped strategy. "strategy"
        # itself is excluded so a half-built wrapper (or copy/pickle probing) cannot recurse.
        if name == "strategy" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def summary(self) -> None:
        log(  # Flower's logger, so the line sits with the wrapped strategy's own summary
            INFO,
            "\t├──> curious capture (rounds %s, kind %s) around %s:",
            "all" if self.capture_rounds == "all" else sorted(self.capture_rounds),  # type: ignore[arg-type]
            self.capture_kind,
            type(self.strategy).__name__,
        )
        self.strategy.summary()

    def is_capture_round(self, server_round: int) -> bool:
        return self.capture_rounds == "all" or server_round in self.capture_rounds  # type: ignore[operator]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.stopped:
            return []
        config = ConfigRecord(dict(config))  # a copy: start() reuses one ConfigRecord for every round
        # "one-step" / "capture-update": the kind's own flag in a capture round, both False otherwise.
        config.update(CAPTURE_KINDS[self.capture_kind].round_config(self.is_capture_round(server_round)))
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        # After the wrapped strategy's configure_train: FedProx writes its proximal-mu into this config.
        self._sent = {server_round: (arrays, dict(config))}  # only the current round is needed
        return messages

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.stopped:
            return []
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)  # may be a one-shot iterable; we read it twice
        valid = [m for m in replies if not m.has_error()]
        self.num_replies[server_round] = len(valid)
        for msg in valid:
            if "metrics" in msg.content and "dp-epsilon-spent" in msg.content["metrics"]:
                part = int(msg.content["meta"].get("partition-id", -1)) if "meta" in msg.content else -1
                spent = float(msg.content["metrics"]["dp-epsilon-spent"])  # type: ignore[arg-type]
                self.client_epsilon.setdefault(server_round, {})[part] = spent if spent >= 0 else float("inf")
        for msg in replies:
            if msg.has_error():  # a client that failed: recorded, and the strategy goes on without it
                self._record_failure(server_round, msg, f"client error: {msg.error.reason}")
        if self.is_capture_round(server_round) and server_round in self._sent:
            global_arrays, sent_config = self._sent[server_round]
            global_state = global_arrays.to_torch_state_dict()
            for msg in valid:
                try:
                    self._capture(server_round, msg, global_state, sent_config)
                except (CaptureError, KeyError, ValueError, OSError) as err:
                    # One bad reply or a failed write must not cost the other clients' captures.
                    self._record_failure(server_round, msg, f"capture failed: {err}")
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is not None and server_round in self._sent:
            arrays = _match_dtypes(arrays, self._sent[server_round][0])
        if metrics is not None:
            self.train_metrics[server_round] = {k: float(v) for k, v in metrics.items() if not isinstance(v, list)}
        return arrays, metrics

    def _record_failure(self, server_round: int, msg: Message, reason: str) -> None:
        # Ray wraps the client's exception in a long traceback: keep its last line, without colours.
        lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", reason).splitlines() if line.strip()]
        text = lines[-1] if lines else reason
        if lines and not text.startswith(lines[0].split(":")[0]):
            text = f"{lines[0].split(':')[0]}: {text}"
        entry = {"round": server_round, "node_id": int(msg.metadata.src_node_id), "reason": text[:500]}
        self.failures.append(entry)
        logger.warning("round %d, node %d: %s", server_round, entry["node_id"], entry["reason"])

    # ------------------------------------------------------------------------------------------

    def _capture(
        self, server_round: int, msg: Message, global_state: dict[str, torch.Tensor], sent: dict[str, Any]
    ) -> None:
        content = msg.content
        meta = dict(content["meta"]) if "meta" in content else {}
        local_state = content["arrays"].to_torch_state_dict()
        metrics = content["metrics"]
        lr = float(meta.get("lr", sent.get("lr", 0.0)))
        one_step = meta.get("mode") == "one-step"
        labels = torch.tensor(meta["labels"], dtype=torch.int64) if "labels" in meta else None
        common = dict(
            spec=self.spec,
            weights=global_state,
            round=server_round,
            client=int(meta.get("partition-id", -1)),
            node_id=int(msg.metadata.src_node_id),
            batch_size=int(meta.get("batch-size", 0)),
            num_examples=int(metrics["num-examples"]),
            lr=lr,
            param_names=self._param_names,
            hyperparameters=sent,
            defense=self.defense.name,
            defense_captured=self.defense.captured,
        )
        if one_step:
            if lr <= 0:
                raise CaptureError(f"round {server_round}: one-step reply without a positive lr")
            # float64 difference: with float64 local weights this is the client's gradient exactly
            gradient = [
                ((global_state[n].double() - local_state[n].double()) / lr).to(global_state[n].dtype)
                for n in self._param_names
            ]
            capture = Capture(
                kind="gradient",
                gradient=gradient,
                labels=labels,
                label_policy="known" if labels is not None else "recovered",
                **common,
            )
        else:
            update = {
                k: (v.double() - local_state[k].double()).to(v.dtype) if v.is_floating_point() else local_state[k]
                for k, v in global_state.items()
            }
            step_labels = torch.tensor(meta["step-labels"], dtype=torch.int64) if "step-labels" in meta else None
            capture = Capture(
                kind="update",
                update=update,
                labels=labels,
                step_labels=step_labels,
                label_policy="known" if labels is not None else "recovered",
                local_steps=int(meta.get("local-steps", 1)),
                proximal_mu=float(meta.get("proximal-mu", sent.get("proximal-mu", 0.0))),
                **common,
            )
        if self.capture_dir is not None:
            self.capture_paths.append(save_capture(self.capture_dir, capture))
        if self.keep_in_memory:
            self.captures.append(capture)
        if "oracle" in content:
            oracle = _parse_oracle(content["oracle"], server_round, capture.client, capture.node_id)
            if self.oracle_dir is not None:
                save_oracle(self.oracle_dir, oracle)
            if self.keep_in_memory:
                self.oracles.append(oracle)


class CuriousFedAvg(CuriousStrategy):
    """The curious capture around Flower's FedAvg: ``fedavg_kwargs`` go to FedAvg, the rest as
    :class:`CuriousStrategy` takes them (the shape of the server before any strategy could be chosen)."""

    def __init__(self, spec: ModelSpec, **kwargs: Any) -> None:
        curious = {k: kwargs.pop(k) for k in _CURIOUS_ARGS if k in kwargs}
        super().__init__(FedAvg(**kwargs), spec, **curious)


_CURIOUS_ARGS = (
    "capture_rounds",
    "capture_kind",
    "label_policy",
    "capture_dir",
    "oracle_dir",
    "keep_in_memory",
    "defense",
)


def _parse_oracle(record: ConfigRecord, server_round: int, client: int, node_id: int) -> OracleRecord:
    blob = bytes(record["safetensors"])
    tensors = st_load(blob)
    num_masks = sum(1 for k in tensors if k.startswith("masks/"))
    batches = _wire_batches(blob)
    return OracleRecord(
        images=tensors["images"],
        labels=tensors["labels"],
        masks=[tensors[f"masks/{i}"] for i in range(num_masks)],
        round=server_round,
        client=client,
        node_id=node_id,
        batches=batches,
    )


def _wire_batches(blob: bytes) -> list[list[int]] | None:
    """The batch order a client put in its oracle's safetensors metadata (JSON lists of ints)."""
    header_len = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8 : 8 + header_len]).get("__metadata__", {})
    if "batches" not in metadata:
        return None
    batches = json.loads(metadata["batches"])
    if not (
        isinstance(batches, list) and all(isinstance(b, list) and all(isinstance(i, int) for i in b) for b in batches)
    ):
        raise CaptureError("oracle batch order is not a list of index lists")
    return batches


def _match_dtypes(arrays: ArrayRecord, like: ArrayRecord) -> ArrayRecord:
    """Keep the global model in its own dtype (one-step replies may come in float64)."""
    if all(k not in like or arrays[k].dtype == like[k].dtype for k in arrays):  # cheap: no tensor copies
        return arrays
    state, ref = arrays.to_torch_state_dict(), like.to_torch_state_dict()
    return ArrayRecord({k: v.to(ref[k].dtype) if k in ref else v for k, v in state.items()})
