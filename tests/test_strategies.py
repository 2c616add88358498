"""Any Flower strategy inside the curious capture (fedsim.strategies, fedsim.strategy.CuriousStrategy):
the aggregate is exactly the bare Flower strategy's on the same replies, Flower's DP wrappers still
go around it, and bad strategy settings are one line, exit 2, nothing written. In-process, no Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flower_harness import set_task_identity
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from fedsim import defenses, strategies, task
from fedsim.run_config import RunConfigError, resolve_config
from fedsim.server_app import _curious_strategy
from fedsim.strategy import CuriousStrategy

NODES = [11, 22, 33, 44, 55]  # Krum needs more than 2f + 2 replies to score them
COMMON = dict(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=5, min_evaluate_nodes=1, min_available_nodes=5)
# Options that differ from Flower's defaults, so the test shows they reach the strategy.
OPTIONS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"proximal_mu": 0.1},  # the clients add the proximal term (tests/test_fedprox.py)
    "fedadam": {"eta": 0.05, "beta_1": 0.8, "tau": 1e-4},
    "fedyogi": {"eta": 0.05, "beta_2": 0.9},
    "fedadagrad": {"eta": 0.05, "eta_l": 0.01},
    "fedmedian": {},
    "fedtrimmedavg": {"beta": 0.2},
    "krum": {"num_malicious_nodes": 1},
}


class Grid5:
    """Just enough of a Grid for Flower's node sampling: five nodes."""

    def get_node_ids(self) -> list[int]:
        return list(NODES)


@pytest.fixture(scope="module", autouse=True)
def task_identity() -> None:
    set_task_identity()


@pytest.fixture(scope="module")
def cfg() -> dict[str, Any]:
    return resolve_config({"model-options": '{"width": 8}', "num-clients": 5, "download": False})


def _state(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    return task.make_model(cfg).state_dict()


def _replies(messages: list[Message], state: dict[str, torch.Tensor], server_round: int) -> list[Message]:
    """Fixed fake client results: a seeded perturbation of the global model per node, unequal sizes."""
    replies = []
    for msg in messages:
        node = msg.metadata.dst_node_id
        gen = torch.Generator().manual_seed(1000 * server_round + node)
        local = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        content = RecordDict(
            {
                "arrays": ArrayRecord(local),
                "metrics": MetricRecord({"num-examples": 10 + NODES.index(node), "train-loss": 0.1 * node}),
            }
        )
        replies.append(Message(content=content, reply_to=msg))
    return replies


def _curious(inner: Strategy, cfg: dict[str, Any], **kwargs: Any) -> CuriousStrategy:
    return CuriousStrategy(
        inner, task.model_spec(cfg), capture_rounds="all", capture_kind="update", keep_in_memory=True, **kwargs
    )


def test_the_table_holds_the_strategies_of_the_issue() -> None:
    assert list(strategies.STRATEGIES) == list(OPTIONS)
    for entry in strategies.STRATEGIES.values():
        assert issubclass(entry.flower(), Strategy)
        assert entry.flower().__name__ == entry.flower_class


@pytest.mark.parametrize("name", list(OPTIONS))
def test_wrapper_aggregates_exactly_as_the_bare_strategy(cfg: dict[str, Any], name: str) -> None:
    bare = strategies.build_strategy(name, OPTIONS[name], **COMMON)
    wrapped = _curious(strategies.build_strategy(name, OPTIONS[name], **COMMON), cfg)
    assert type(wrapped.strategy) is type(bare)
    for key, value in OPTIONS[name].items():  # the run config's options reached Flower's object
        assert getattr(wrapped, key) == value
    state = _state(cfg)
    arrays = ArrayRecord(state)
    for server_round in (1, 2):  # two rounds: the adaptive strategies carry state (m_t, v_t) across
        config = ConfigRecord({"lr": 0.1})
        sent = list(bare.configure_train(server_round, arrays, ConfigRecord(dict(config)), Grid5()))
        sent_wrapped = list(wrapped.configure_train(server_round, arrays, ConfigRecord(dict(config)), Grid5()))
        assert len(sent) == len(sent_wrapped) == len(NODES)
        if name == "fedprox":  # Flower's FedProx tells the clients its mu through the round's config
            assert all(m.content["config"]["proximal-mu"] == 0.1 for m in sent_wrapped)
        # The same results for both, built twice: FedMedian and FedTrimmedAvg pop the arrays out of the
        # replies they aggregate (the wrapper captures before handing them on, so it is not affected).
        want, want_metrics = bare.aggregate_train(server_round, _replies(sent, state, server_round))
        got, got_metrics = wrapped.aggregate_train(server_round, _replies(sent, state, server_round))
        assert want is not None and got is not None
        want_state, got_state = want.to_torch_state_dict(), got.to_torch_state_dict()
        assert want_state.keys() == got_state.keys()
        if name == "fedadam":
            # Flower's FedAdam step comes out float64 (its bias-corrected step size is a NumPy float64
            # scalar, which promotes); the wrapper keeps the global model in the model's dtype.
            assert all(want_state[k].dtype == torch.float64 for k in want_state)
            want_state = {k: v.to(state[k].dtype) for k, v in want_state.items()}
        assert all(got_state[k].dtype == state[k].dtype for k in state)
        assert all(torch.equal(want_state[k], got_state[k]) for k in want_state), name
        assert dict(want_metrics or {}) == dict(got_metrics or {})
        assert not any(torch.equal(want_state[k], state[k]) for k in state if state[k].is_floating_point())
        state, arrays = got_state, got  # both go on from the same global model
    assert len(wrapped.captures) == 2 * len(NODES)  # and it captured every reply of both rounds


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "fedmedian", "krum"])
def test_dp_wrapper_goes_around_the_curious_strategy(cfg: dict[str, Any], name: str) -> None:
    dp_cfg = dict(cfg, defense="central-dp-server-clipping", **{"clip-norm": 0.05, "noise-multiplier": 0.5})
    curious = _curious(strategies.build_strategy(name, OPTIONS[name], **COMMON), cfg, defense=dp_cfg["defense"])
    server = defenses.wrap_strategy(curious, dp_cfg, len(NODES))
    bare = defenses.wrap_strategy(strategies.build_strategy(name, OPTIONS[name], **COMMON), dp_cfg, len(NODES))
    assert isinstance(server, DifferentialPrivacyServerSideFixedClipping) and server.strategy is curious
    state = _state(cfg)
    arrays = ArrayRecord(state)
    sent = list(bare.configure_train(1, arrays, ConfigRecord(), Grid5()))
    list(server.configure_train(1, arrays, ConfigRecord(), Grid5()))
    # Each wrapper clips the replies in place: give each its own copy of the same results.
    np.random.seed(0)
    want, _ = bare.aggregate_train(1, _replies(sent, state, 1))
    np.random.seed(0)  # the same central noise on both
    got, _ = server.aggregate_train(1, _replies(sent, state, 1))
    assert want is not None and got is not None
    want_state, got_state = want.to_torch_state_dict(), got.to_torch_state_dict()
    if name == "fedadam":  # float64 from Flower (see above): the noise is added before vs after the rounding
        for k in want_state:
            torch.testing.assert_close(got_state[k], want_state[k].to(state[k].dtype), rtol=0, atol=1e-6)
    else:
        assert all(torch.equal(want_state[k], got_state[k]) for k in want_state)
    assert len(curious.captures) == len(NODES)
    for capture in curious.captures:  # the server saw the clipped, un-noised updates
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in capture.update.values()))
        assert float(norm) <= 0.05 * (1 + 1e-5)


def test_client_clipping_wrapper_takes_any_strategy(cfg: dict[str, Any]) -> None:
    dp_cfg = dict(cfg, defense="central-dp-client-clipping")
    curious = _curious(strategies.build_strategy("fedyogi", {}, **COMMON), cfg)
    server = defenses.wrap_strategy(curious, dp_cfg, len(NODES))
    assert isinstance(server, DifferentialPrivacyClientSideFixedClipping) and server.strategy is curious


def test_server_builds_the_run_configs_strategy(cfg: dict[str, Any], tmp_path: Path) -> None:
    run_cfg = resolve_config(cfg, {"strategy": "fedadam", "strategy-options": '{"eta": 0.02}'})
    strategy = _curious_strategy(run_cfg, tmp_path, 5, 5)
    assert type(strategy.strategy).__name__ == "FedAdam"
    assert strategy.eta == 0.02 and strategy.min_train_nodes == 5  # attributes read through to FedAdam
    assert resolve_config(cfg)["strategy"] == "fedavg"  # the default: the server of earlier versions


@pytest.mark.parametrize(
    ("layer", "says"),
    [
        ({"strategy": "fedsgd"}, "strategy must be one of"),
        ({"strategy": "fedavg", "strategy-options": '{"eta": 0.1}'}, "strategy fedavg does not take 'eta'"),
        ({"strategy": "krum", "strategy-options": '{"num_clients_to_keep": 2}'}, "does not take 'num_clients_to_keep'"),
        ({"strategy": "fedadam", "strategy-options": '{"min_train_nodes": 2}'}, "set by the federation settings"),
        ({"strategy": "fedtrimmedavg", "strategy-options": '{"beta": 0.5}'}, "beta must be in [0, 0.5)"),
        ({"strategy": "fedadam", "strategy-options": '{"eta": "fast"}'}, "eta must be a number"),
        ({"strategy": "krum", "strategy-options": '{"num_malicious_nodes": 1.5}'}, "must be an integer"),
        ({"strategy-options": "[1, 2]"}, "strategy-options must be a JSON object"),
        ({"strategy": "fedprox", "strategy-options": '{"proximal_mu": -0.1}'}, "proximal_mu must be >= 0"),
    ],
)
def test_bad_strategy_settings_are_one_line(layer: dict[str, Any], says: str) -> None:
    with pytest.raises(RunConfigError) as err:
        resolve_config(layer)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_strategy_options_as_a_dict_in_yaml_or_python() -> None:
    cfg = resolve_config({"strategy": "fedyogi", "strategy_options": {"eta": 0.01, "tau": 1e-4}})
    assert strategies.parse_options(cfg["strategy-options"]) == {"eta": 0.01, "tau": 1e-4}


def test_bad_strategy_on_the_command_line_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    from fedsim.cli import main

    run_dir = tmp_path / "run"
    args = ["simulate", "--no-download", "--rounds", "1", "--clients", "2", "--run-dir", str(run_dir)]
    assert main([*args, "--strategy", "fedsgd"]) == 2
    assert main([*args, "--strategy", "fedmedian", "--strategy-options", '{"beta": 0.1}']) == 2
    assert not run_dir.exists()
