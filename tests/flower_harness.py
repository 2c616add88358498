"""A federation of two clients driven in this process, without Ray: the node ids, a Grid that only
samples them, and the Context a ClientApp handler receives. Shared by the tests that drive the
strategy and the client handlers by hand."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context, Message, RecordDict

NODE_IDS = [1111, 2222]


class FakeGrid:
    """Just enough of a Grid for FedAvg's node sampling."""

    def get_node_ids(self) -> list[int]:
        return list(NODE_IDS)


def client_context(partition_id: int, node_id: int) -> Context:
    return Context(
        run_id=1,
        node_id=node_id,
        node_config={"partition-id": partition_id, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )


def context_for(msg: Message) -> Context:
    """The Context of the node a message is addressed to."""
    node = msg.metadata.dst_node_id
    return client_context(NODE_IDS.index(node), node)


def set_task_identity() -> None:
    """Messages built outside a running Flower app need a task identity (a run sets its own)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1


def offline_config(overrides: dict) -> dict:
    """A resolved run config of two clients on the offline sample; the test is skipped without it."""
    import pytest

    from fedsim import task
    from fedsim.data import DataUnavailableError
    from fedsim.run_config import resolve_config

    config = resolve_config({"num-clients": 2, "download": False, **overrides})
    try:
        task.load_split(config, train=True)
    except DataUnavailableError as exc:
        pytest.skip(f"no offline MNIST sample: {exc}")
    return config


class AppGrid:
    """A Grid that hands every message to the ClientApp itself (``fedsim.client_app.app``, its mods
    included) in this process, each node with a Context that lasts the run (SecAgg+ keeps its keys in
    it), a copy of each message as a real transport would deliver. A node in ``fail`` raises in
    every train message that carries an instruction (its client's round): an error reply, as Flower's
    runtime turns a raising ClientApp into one."""

    def __init__(self, node_ids: list[int], fail: tuple[int, ...] = ()) -> None:
        from types import SimpleNamespace

        self.node_ids = list(node_ids)
        self.fail = set(fail)
        self.run = SimpleNamespace(run_id=1)
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": i, "num-partitions": len(node_ids)},
                state=RecordDict(),
                run_config={},
            )
            for i, node in enumerate(node_ids)
        }

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        import copy

        from flwr.app import Error

        from fedsim.client_app import app

        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            delivered = copy.deepcopy(msg)
            try:
                if node in self.fail and "fitins.parameters" in msg.content.array_records:
                    raise RuntimeError(f"node {node} dropped out")
                replies.append(app(delivered, self.contexts[node]))
            except Exception as err:  # noqa: BLE001 - any client failure is an error reply
                replies.append(Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=delivered))
        return replies


def run_in_process(config: dict) -> Path:
    """``fedsim.simulation.run_simulation_job`` without Ray: the same run config and run folder, the
    ServerApp's rounds with the ClientApp itself on an :class:`AppGrid` of ``num-clients`` nodes in this
    process. For tests whose subject is what a federation's run folder feeds, not the simulation
    engine (Ray runs in tests/test_simulation.py and the console commands' tests)."""
    from fedsim.server_app import run_server
    from fedsim.simulation import new_run_config

    cfg, run_dir = new_run_config(config)
    set_task_identity()
    run_server(AppGrid([1000 + i for i in range(int(cfg["num-clients"]))]), cfg)
    return run_dir
