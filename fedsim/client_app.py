"""Flower ClientApp (Message API): local training with dropout, and one-step rounds for capture.

A train reply holds exactly one ArrayRecord ("arrays") and one MetricRecord ("metrics", with
"num-examples"), as FedAvg requires; what else the client discloses goes in ConfigRecords:
"meta" (mode, batch size, lr, and the labels when the audit assumes them known: for an update also
per step, in the order the steps used the images) and, only in audit
mode, "oracle" (true images, labels and dropout masks as safetensors bytes: a ConfigRecord because
FedAvg allows one ArrayRecord per reply). The server keeps the oracle apart from its captures.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from safetensors.torch import save as st_save
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from fedsim import defenses, dp_sgd, task
from fedsim.client_step import StepRecord, run_local_round
from fedsim.run_config import resolve_config
from fedsim.secagg import META_METRIC, ORACLE_METRIC

app = ClientApp()


def secagg_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's ``secaggplus_mod`` on the messages of Flower's SecAgg+ workflow, the rest of the chain
    otherwise. Why a dispatching mod rather than ``ClientApp(mods=[secaggplus_mod])``: the app's mods are
    fixed when the one module-level app is built (see :func:`defense_mod`), and whether a round runs
    under SecAgg+ is the server's choice; the workflow's messages say it themselves (they carry its
    ``secaggplus_configs`` record), so the client needs no setting of its own (under ``run_simulation``
    its run config is empty)."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def legacy_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """A legacy FitIns / EvaluateIns (what Flower's DefaultWorkflow sends, under SecAgg+) as this app's
    message ("arrays" keyed by the model's state dict, "config"), and the reply back as a FitRes /
    EvaluateRes; a message of this app's own form passes unchanged. Written here because Flower converts
    only between the legacy records and its legacy Client class (``flwr.compat``), not a Message-API
    handler; the record layouts are Flower's own (``recorddict_compat``)."""
    import flwr.compat.common.recorddict_compat as compat
    from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    records = msg.content.array_records
    fit = "fitins.parameters" in records
    if not fit and "evaluateins.parameters" not in records:
        return call_next(msg, context)
    ins = (compat.recorddict_to_fitins if fit else compat.recorddict_to_evaluateins)(msg.content, True)
    config = dict(ins.config)
    if "proximal_mu" in config:  # the legacy FedProx's key; the Message API's FedProx sends "proximal-mu"
        config.setdefault("proximal-mu", config["proximal_mu"])
    # Legacy Parameters carry no names: the arrays are the model's state dict in its order.
    keys = list(task.make_model(_config_of(config, context)).state_dict())
    ndarrays = parameters_to_ndarrays(ins.parameters)
    if len(ndarrays) != len(keys):
        raise ValueError(f"the server sent {len(ndarrays)} arrays for a model of {len(keys)} state entries")
    msg.content = RecordDict(
        {
            "arrays": ArrayRecord(dict(zip(keys, (torch.from_numpy(a.copy()) for a in ndarrays)))),
            "config": ConfigRecord(config),
        }
    )
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    content, ok = reply.content, Status(code=Code.OK, message="")
    metrics = {k: v for k, v in content["metrics"].items() if k != "num-examples"}
    num_examples = int(content["metrics"]["num-examples"])  # type: ignore[arg-type]
    if fit:
        arrays = content["arrays"]
        # In float64: Flower's quantize computes in the arrays' dtype, and float32 would round the shifted
        # weight (w + C) * Q / 2C to 24 bits, coarser than the grid once Q > 2**24. Only the mod sees these
        # arrays: what leaves the client is the masked integers either way.
        weights = [_float64(arrays[k].numpy()) for k in keys]
        if "meta" in content:
            metrics[META_METRIC] = json.dumps(dict(content["meta"]))
        if "oracle" in content:
            metrics[ORACLE_METRIC] = bytes(content["oracle"]["safetensors"])  # type: ignore[arg-type]
        fitres = FitRes(ok, ndarrays_to_parameters(weights), num_examples, metrics)  # type: ignore[arg-type]
        out = compat.fitres_to_recorddict(fitres, keep_input=True)
    else:
        loss = float(metrics.get("loss", 0.0))  # type: ignore[arg-type]
        out = compat.evaluateres_to_recorddict(EvaluateRes(ok, loss, num_examples, metrics))  # type: ignore[arg-type]
    return Message(content=out, reply_to=msg)


def _float64(array: Any) -> Any:
    import numpy as np

    return array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) else array


def _config_of(sent: dict[str, Any], context: Context) -> dict[str, Any]:
    return resolve_config(dict(context.run_config), sent, strict=False)


def defense_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """The run config's defense, as Flower client mods around the train handler (``fedsim.defenses``).

    Why one dispatching mod rather than ``ClientApp(mods=...)`` built per config: Flower fixes an
    app's mods when the app is built, but this app is one module-level object that the simulation,
    ``flwr run`` and the deployment's SuperNodes all load, and the run config a client must obey is
    the one the server sends in each round's message (the legacy simulation API gives apps an empty
    run config). So the app carries this one mod on its train handler; it resolves the config
    exactly as the handler does and runs the defense's mods (Flower's own where they exist) around
    the rest of the chain. Evaluate messages pass no mod at all.
    """
    mods = defenses.client_mods(_config(msg, context))
    chain = call_next
    for mod in reversed(mods):
        chain = _link(mod, chain)
    return chain(msg, context)


def _link(mod: Any, call_next: Any) -> Any:
    """``mod`` with the rest of the chain bound: a handler of (message, context)."""

    def handler(msg: Message, context: Context) -> Message:
        return mod(msg, context, call_next)

    return handler


def _config(msg: Message, context: Context) -> dict[str, Any]:
    """Run config (pyproject/flwr run) overlaid by what the server sent this round."""
    return _config_of(dict(msg.content.get("config", ConfigRecord())), context)


def _partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


def oracle_bytes(images: torch.Tensor, labels: torch.Tensor, steps: list[StepRecord]) -> bytes:
    """Serialize the ground truth of a captured round (safetensors: no pickle on the wire either):
    the images, their labels, every step's masks (step-major) and which images each step used."""
    masks = [m for step in steps for m in step.masks]
    tensors = {"images": images.contiguous(), "labels": labels.to(torch.int64).contiguous()}
    tensors.update({f"masks/{i}": m.contiguous() for i, m in enumerate(masks)})
    batches = json.dumps([step.indices for step in steps])
    return st_save(tensors, metadata={"format": "fedsim.oracle.wire", "num_masks": str(len(masks)), "batches": batches})


def proximal_mu(sent: ConfigRecord) -> float:
    """FedProx's mu as Flower's FedProx sends it ("proximal-mu" in the round's config); 0 without it.
    The client takes it from the message, not the run config: it is what the server's strategy asked for."""
    value = sent.get("proximal-mu", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"proximal-mu must be a number, got {value!r}")
    return float(value)


def _maybe_fail(spec: str, server_round: int, partition_id: int) -> None:
    """Fault injection: ``"2:0,3"`` makes partitions 0 and 3 raise in round 2 (reliability drills)."""
    if not spec:
        return
    round_part, _, parts = spec.partition(":")
    if int(round_part) == server_round and str(partition_id) in parts.split(","):
        raise RuntimeError(f"injected failure in partition {partition_id}, round {server_round}")


def handle_train(msg: Message, context: Context) -> Message:
    cfg = _config(msg, context)
    partition_id, num_partitions = _partition(context)
    server_round = int(msg.content["config"].get("server-round", 0)) if "config" in msg.content else 0
    sent = msg.content["config"] if "config" in msg.content else ConfigRecord()
    one_step = bool(sent.get("one-step", False))
    capture_update = bool(sent.get("capture-update", False))
    _maybe_fail(str(cfg.get("inject-client-failure", "")), server_round, partition_id)
    model = task.make_model(cfg, msg.content["arrays"].to_torch_state_dict())
    train = task.load_split(cfg, train=True)
    indices = task.partition_indices(cfg, train, partition_id, num_partitions)
    seed = hash((int(cfg["seed"]), server_round, partition_id)) & 0x7FFFFFFF
    meta = ConfigRecord({"partition-id": partition_id, "server-round": server_round})
    content = RecordDict()
    # One client step for every kind of round; a one-step capture round is one setting of it.
    captured = one_step or capture_update
    images = labels = None
    victim_set = one_step or (capture_update and int(cfg["capture-images"]) > 0)
    if victim_set:  # a victim set: small enough to reconstruct
        count = None if one_step else int(cfg["capture-images"])
        images, labels = task.victim_batch(cfg, train, indices, server_round, partition_id, count)
        data: Dataset = TensorDataset(images, labels)
    else:
        data = Subset(train, indices.tolist())
    plan = task.local_plan(
        cfg,
        one_step=one_step,
        seed=seed,
        record_masks=captured and bool(cfg["audit"]),
        num_examples=len(indices),
        victim_set=victim_set,
    )
    plan = replace(plan, proximal_mu=proximal_mu(sent))
    # DP-SGD: the client's accountant lives in its context.state, so epsilon composes over its rounds.
    accountant = dp_sgd.load_accountant(context.state) if plan.dp is not None else None
    result = run_local_round(model, data, plan, accountant=accountant)
    arrays = ArrayRecord(result.weights)
    metrics = MetricRecord({"num-examples": len(data), "train-loss": result.mean_loss})  # type: ignore[arg-type]
    if accountant is not None:
        dp_sgd.save_accountant(context.state, accountant)
        spent = dp_sgd.epsilon(accountant, float(cfg["dp-delta"]))
        metrics["dp-epsilon-spent"] = spent if math.isfinite(spent) else -1.0  # -1: no noise, no guarantee
    mode = "one-step" if one_step else "update" if capture_update else "train"
    meta.update(
        {
            "batch-size": plan.schedule.batch_size or len(data),
            "lr": plan.optimizer.lr,  # type: ignore[arg-type]
            "local-steps": len(result.steps),
            "mode": mode,
            "proximal-mu": plan.proximal_mu,  # the objective the steps followed: the replay needs it
        }
    )
    if captured:
        if images is None:  # the whole partition was the local set
            images, labels = next(iter(DataLoader(data, batch_size=len(data))))  # type: ignore[arg-type]
        if cfg["labels"] == "known":
            meta["labels"] = [int(v) for v in labels]  # the audit's "labels known" assumption
            if capture_update:  # and the labels in the order the steps used the images (an unknown batch order)
                meta["step-labels"] = [int(labels[i]) for step in result.steps for i in step.indices]
        if cfg["audit"]:
            content["oracle"] = ConfigRecord({"safetensors": oracle_bytes(images, labels, result.steps)})
    content["arrays"] = arrays
    content["metrics"] = metrics
    content["meta"] = meta
    return Message(content=content, reply_to=msg)


def handle_evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this client's share of the test split."""
    cfg = _config(msg, context)
    partition_id, num_partitions = _partition(context)
    model = task.make_model(cfg, msg.content["arrays"].to_torch_state_dict())
    test = task.load_split(cfg, train=False)
    indices = task.partition_indices(cfg, test, partition_id, num_partitions)
    stats = task.evaluate(model, Subset(test, indices.tolist()), int(cfg["eval-batch-size"]))
    metrics = MetricRecord({"num-examples": len(indices), "accuracy": stats["accuracy"], "loss": stats["loss"]})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


# Plain functions above so tests can call them directly; registered with the app here.
# Outermost first: SecAgg+ masks the reply of everything inside it (the defense's mods included).
app.train(mods=[secagg_mod, legacy_mod, defense_mod])(handle_train)
app.evaluate(mods=[legacy_mod])(handle_evaluate)
