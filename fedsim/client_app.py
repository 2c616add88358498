"""Flower ClientApp (Message API): local training with dropout, and one-step rounds for capture.

A train reply holds exactly one ArrayRecord ("arrays") and one MetricRecord ("metrics", with
"num-examples"), as FedAvg requires; what else the client discloses goes in ConfigRecords:
"meta" (mode, batch size, lr, and the labels when the audit assumes them known) and, only in audit
mode, "oracle" (true images, labels and dropout masks as safetensors bytes: a ConfigRecord because
FedAvg allows one ArrayRecord per reply). The server keeps the oracle apart from its captures.
"""

from __future__ import annotations

from fedsim import flower_env

flower_env.apply()  # before anything imports flwr

from typing import Any  # noqa: E402

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from safetensors.torch import save as st_save  # noqa: E402
from torch.utils.data import Dataset, Subset, TensorDataset  # noqa: E402

from fedsim import task  # noqa: E402
from fedsim.client_step import run_local_round  # noqa: E402
from fedsim.run_config import resolve_config  # noqa: E402

app = ClientApp()


def _config(msg: Message, context: Context) -> dict[str, Any]:
    """Run config (pyproject/flwr run) overlaid by what the server sent this round."""
    sent = msg.content.get("config", ConfigRecord())
    return resolve_config(dict(context.run_config), dict(sent), strict=False)


def _partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


def oracle_bytes(images: torch.Tensor, labels: torch.Tensor, masks: list[torch.Tensor]) -> bytes:
    """Serialize the ground truth of a one-step round (safetensors: no pickle on the wire either)."""
    tensors = {"images": images.contiguous(), "labels": labels.to(torch.int64).contiguous()}
    tensors.update({f"masks/{i}": m.contiguous() for i, m in enumerate(masks)})
    return st_save(tensors, metadata={"format": "fedsim.oracle.wire", "num_masks": str(len(masks))})


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
    one_step = bool(msg.content["config"].get("one-step", False)) if "config" in msg.content else False
    _maybe_fail(str(cfg.get("inject-client-failure", "")), server_round, partition_id)
    model = task.make_model(cfg, msg.content["arrays"].to_torch_state_dict())
    train = task.load_split(cfg, train=True)
    indices = task.partition_indices(cfg, train, partition_id, num_partitions)
    seed = hash((int(cfg["seed"]), server_round, partition_id)) & 0x7FFFFFFF
    meta = ConfigRecord({"partition-id": partition_id, "server-round": server_round})
    content = RecordDict()
    # One client step for both kinds of round; a one-step capture round is one setting of it.
    plan = task.local_plan(cfg, one_step=one_step, seed=seed, record_masks=one_step and bool(cfg["audit"]))
    if one_step:
        images, labels = task.victim_batch(cfg, train, indices, server_round, partition_id)
        data: Dataset = TensorDataset(images, labels)
    else:
        data = Subset(train, indices.tolist())
    result = run_local_round(model, data, plan)
    arrays = ArrayRecord(result.weights)
    metrics = MetricRecord({"num-examples": len(data), "train-loss": result.mean_loss})  # type: ignore[arg-type]
    meta.update({"batch-size": plan.schedule.batch_size or len(data), "lr": plan.optimizer.lr,  # type: ignore[arg-type]
                 "local-steps": len(result.steps), "mode": "one-step" if one_step else "train"})
    if one_step:
        if cfg["labels"] == "known":
            meta["labels"] = [int(v) for v in labels]  # the audit's "labels known" assumption
        if cfg["audit"]:
            content["oracle"] = ConfigRecord({"safetensors": oracle_bytes(images, labels, result.steps[0].masks)})
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
app.train()(handle_train)
app.evaluate()(handle_evaluate)
