"""Defenses, by name: which Flower parts each one is, configured once from the run config.

A defense is a list of client mods (applied to every train reply, after the client's local round:
``fedsim.client_app`` registers one mod, :func:`fedsim.client_app.defense_mod`, that reads the run
config and runs the mods named here) and an optional wrapper around the server's strategy
(``fedsim.server_app`` calls :func:`wrap_strategy`). This module is the one place that maps a name
to its parts; the run config's ``defense`` choices are the keys of :data:`DEFENSES`. Nothing else
applies a defense: ``fedsim.client_step.run_local_round`` returns the client's plain update.

Flower's own classes do the clipping and the noise (``flwr.clientapp.mod.LocalDpMod``,
``fixedclipping_mod``, ``flwr.serverapp.strategy.DifferentialPrivacy*FixedClipping``). Flower has
no pruning mod, so :func:`prune_mod` is written here, once.

What the curious server records (``fedsim.strategy.CuriousStrategy`` captures each reply as it
reaches it, i.e. after the client's mods and, for server-side clipping, after the wrapper clipped it):

* none: the client's update as it left the client;
* local-dp: the clipped and noised update (the noise is the client's own);
* central-dp-*: the clipped, NOT noised update: central DP adds its noise to the aggregate, after
  the server has seen every individual update, so it does not protect against this server;
* prune: the pruned update (the attacker knows which entries survived: the nonzero ones);
* dp-sgd: the update of a local round whose every step clipped each example's gradient and added
  noise (Opacus, inside ``run_local_round``: fedsim.dp_sgd); the clients report the epsilon spent.

Adding a defense: one :class:`Defense` entry in :data:`DEFENSES` (its client mods and/or strategy
wrapper, built from the run config; what the attacker adapts; its accountant and frontier fields),
and any new setting it reads in ``fedsim.run_config.SCHEMA``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Defense:
    name: str
    help: str
    # The client mods, in order (the first wraps the others), built from the resolved run config.
    client_mods: Callable[[Mapping[str, Any]], list[Any]]
    # The strategy wrapper: (strategy, cfg, num_sampled_clients) -> Strategy; None: no wrapper.
    wrap: Callable[[Any, Mapping[str, Any], int], Any] | None
    # What the capture of one client's reply holds under this defense (stored in its metadata).
    captured: str
    # How the attacker adapts to it (named in the attack report).
    adaptation: str
    # Flower clips the whole ArrayRecord (every state-dict entry): the model must have only floating ones.
    needs_float_state: bool = False
    # The Gaussian noise of one round as a multiple of the sensitivity (clip-norm), for the privacy
    # accountant; None: the defense adds no noise and gives no (epsilon, delta) guarantee.
    noise_multiplier: Callable[[Mapping[str, Any]], float] | None = None
    # Whose guarantee the accountant states: "client" (local: each client's own updates) or "federation".
    accounted: str = ""
    # The (epsilon) each round guarantees by construction, stated beside the composed one; None: none.
    per_round_epsilon: Callable[[Mapping[str, Any]], float] | None = None
    # The attacker's adaptation in data: match only the update's surviving (nonzero) entries.
    match_support: bool = False
    # On the privacy-utility frontier: the family's label, the run-config setting that is its
    # strength (None: no knob), that setting's short name, and whether a smaller value is stronger.
    family: str = ""
    level: str | None = None
    level_name: str = ""
    stronger_when_smaller: bool = False
    # Runs inside the client's local round rather than as a mod on its reply: each step is DP-SGD
    # (fedsim.dp_sgd; fedsim.task.local_plan gives the plan its DpSgdSpec). Its epsilon is the clients'.
    in_local_round: bool = False
    # Under secure aggregation (fedsim.secagg) the server's strategy is a legacy Flower strategy: the
    # same wrapper from flwr.server.strategy, (strategy, cfg, num_sampled_clients) -> Strategy.
    wrap_legacy: Callable[[Any, Mapping[str, Any], int], Any] | None = None
    # What of this defense needs each client's update on the server, in words ("" when nothing does): such
    # a defense cannot run under secure aggregation, where the server only ever holds their mean.
    needs_each_update: str = ""


def _no_mods(cfg: Mapping[str, Any]) -> list[Any]:
    return []


def _local_dp_mods(cfg: Mapping[str, Any]) -> list[Any]:
    from flwr.clientapp.mod import LocalDpMod

    # The L2 sensitivity of a clipped update is the clipping norm (adding or removing one client's
    # update changes a sum by at most that much): Flower's LocalDpMod takes it as a separate argument.
    clip = float(cfg["clip-norm"])
    return [LocalDpMod(clip, clip, float(cfg["dp-epsilon"]), float(cfg["dp-delta"]))]


def _fixed_clipping_mods(cfg: Mapping[str, Any]) -> list[Any]:
    from flwr.clientapp.mod import fixedclipping_mod

    return [fixedclipping_mod]  # the clipping norm comes from the strategy wrapper, in each round's config


def _prune_mods(cfg: Mapping[str, Any]) -> list[Any]:
    return [PruneMod(float(cfg["prune-fraction"]))]


def _wrap_client_clipping(strategy: Any, cfg: Mapping[str, Any], num_sampled: int) -> Any:
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    return DifferentialPrivacyClientSideFixedClipping(
        strategy, float(cfg["noise-multiplier"]), float(cfg["clip-norm"]), num_sampled
    )


def _wrap_client_clipping_legacy(strategy: Any, cfg: Mapping[str, Any], num_sampled: int) -> Any:
    from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping

    return DifferentialPrivacyClientSideFixedClipping(
        strategy, float(cfg["noise-multiplier"]), float(cfg["clip-norm"]), num_sampled
    )


def _wrap_server_clipping(strategy: Any, cfg: Mapping[str, Any], num_sampled: int) -> Any:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    return DifferentialPrivacyServerSideFixedClipping(
        strategy, float(cfg["noise-multiplier"]), float(cfg["clip-norm"]), num_sampled
    )


def _local_dp_multiplier(cfg: Mapping[str, Any]) -> float:
    # LocalDpMod's Gaussian mechanism: std = sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon per round.
    return math.sqrt(2 * math.log(1.25 / float(cfg["dp-delta"]))) / float(cfg["dp-epsilon"])


def _central_multiplier(cfg: Mapping[str, Any]) -> float:
    return float(cfg["noise-multiplier"])


_CENTRAL_CAPTURE = (
    "the client's clipped update, without noise: central DP adds its noise to the aggregate, "
    "after the server has seen each update"
)

NO_DEFENSE = "none"  # the run config's default: the entry whose captures are the plain updates

DEFENSES: dict[str, Defense] = {
    d.name: d
    for d in (
        Defense(NO_DEFENSE, "no defense", _no_mods, None, "the client's update as sent", "none", family="no defense"),
        Defense(
            "local-dp",
            "Flower's LocalDpMod on the client: clip to clip-norm, add Gaussian noise for (dp-epsilon, dp-delta)",
            _local_dp_mods,
            None,
            "the client's clipped and noised update",
            "none: the noised update is attacked as is",
            needs_float_state=True,
            noise_multiplier=_local_dp_multiplier,
            accounted="client",
            per_round_epsilon=lambda cfg: float(cfg["dp-epsilon"]),
            family="local DP (LocalDpMod)",
            level="dp-epsilon",
            level_name="ε/round",
            stronger_when_smaller=True,
        ),
        Defense(
            "central-dp-client-clipping",
            "Flower's fixedclipping_mod on the client and "
            "DifferentialPrivacyClientSideFixedClipping around the strategy (noise-multiplier, clip-norm)",
            _fixed_clipping_mods,
            _wrap_client_clipping,
            _CENTRAL_CAPTURE,
            "none needed: clipping scales the update, which the cosine distance ignores",
            needs_float_state=True,
            noise_multiplier=_central_multiplier,
            accounted="federation",
            family="central DP, client clipping",
            level="noise-multiplier",
            level_name="z",
            wrap_legacy=_wrap_client_clipping_legacy,
        ),
        Defense(
            "central-dp-server-clipping",
            "DifferentialPrivacyServerSideFixedClipping around the strategy (noise-multiplier, clip-norm)",
            _no_mods,
            _wrap_server_clipping,
            _CENTRAL_CAPTURE,
            "none needed: clipping scales the update, which the cosine distance ignores",
            needs_float_state=True,
            noise_multiplier=_central_multiplier,
            accounted="federation",
            family="central DP, server clipping",
            level="noise-multiplier",
            level_name="z",
            needs_each_update="Flower's server-side clipping clips each client's update on the server",
        ),
        Defense(
            "prune",
            "keep the prune-fraction largest entries (by magnitude) of each tensor of the update",
            _prune_mods,
            None,
            "the client's pruned update",
            "only the surviving (nonzero) entries are matched: the dummy's gradient or replayed update is "
            "cut to them (VictimJob.match_support)",
            match_support=True,
            family="pruning",
            level="prune-fraction",
            level_name="keep",
            stronger_when_smaller=True,
        ),
        Defense(
            "dp-sgd",
            "DP-SGD in the client's local round with Opacus: per-example clipping at clip-norm, Gaussian noise "
            "(dp-noise-from: for a total dp-epsilon at dp-delta, a fixed noise-multiplier, or none), Poisson "
            "sampling, an RDP accountant over all the client's rounds",
            _no_mods,
            None,
            "the update of the client's DP-SGD round: per-example clipped gradients and their noise, stepped",
            "gradient captures: attacked as is (noise in the target); update captures of a victim set (fixed "
            "batches): the replay clips each example's gradient as the client did, the noise stays in the target",
            accounted="client",
            family="DP-SGD (Opacus)",
            level="dp-epsilon",
            level_name="ε total",
            stronger_when_smaller=True,
            in_local_round=True,
        ),
    )
}


def get_defense(name: str) -> Defense:
    try:
        return DEFENSES[name]
    except KeyError:
        raise ValueError(f"unknown defense {name!r}; choose from {', '.join(DEFENSES)}") from None


def client_mods(cfg: Mapping[str, Any]) -> list[Any]:
    """The client mods of the run config's defense, in order."""
    return get_defense(str(cfg["defense"])).client_mods(cfg)


def wrap_strategy(strategy: Any, cfg: Mapping[str, Any], num_sampled_clients: int) -> Any:
    """``strategy`` wrapped as the run config's defense asks (the same object when it asks nothing);
    under secure aggregation (``secagg``) ``strategy`` is a legacy one, and so is its wrapper."""
    defense = get_defense(str(cfg["defense"]))
    wrap = defense.wrap_legacy if cfg.get("secagg") else defense.wrap
    if wrap is None and defense.wrap is not None:  # the run config refuses this combination first
        raise ValueError(f"defense {defense.name} has no wrapper for secure aggregation")
    return strategy if wrap is None else wrap(strategy, cfg, num_sampled_clients)


def check_run(cfg: Mapping[str, Any], state_dtypes: Mapping[str, Any] | None) -> str | None:
    """Why the run's strategy or model cannot take its defense, or None. ``state_dtypes``: the model's
    state-dict entries and their dtypes (torch; needed when the defense ``needs_float_state``)."""
    defense = get_defense(str(cfg["defense"]))
    if defense.wrap is not None and cfg.get("inject-client-failure"):
        # Flower's DP wrappers skip a round's aggregation when any client failed: the strategy would
        # neither aggregate nor capture that round, so an injected failure cannot be drilled under them.
        return (
            f"defense {defense.name} cannot run with inject-client-failure: Flower's central DP wrapper "
            "drops a whole round when any client fails"
        )
    if defense.needs_float_state and state_dtypes is not None:
        ints = [k for k, dtype in state_dtypes.items() if not dtype.is_floating_point]
        if ints:
            return (
                f"defense {defense.name} cannot run with model {cfg['model']}: Flower's DP clipping scales every "
                f"entry of the update, and {ints[0]} is not floating point"
            )
    return None


def privacy_spent(cfg: Mapping[str, Any], rounds: int, sampled: int, population: int) -> dict[str, Any] | None:
    """The (epsilon, delta) the run's defense spent over ``rounds`` rounds, by Flower's RdpAccountant
    (``flwr.supercore.privacy_accounting``, backed by Google's dp-accounting). None for a defense
    without noise. No sampling amplification is claimed: the clients of a round are not Poisson-sampled.

    Flower's DP strategy wrappers would account by themselves, but only around a strategy that keeps
    FedAvg's aggregate_train, which the curious strategy overrides; so the rounds are composed here."""
    defense = get_defense(str(cfg["defense"]))
    if defense.noise_multiplier is None or rounds <= 0:
        return None
    delta = float(cfg["dp-delta"])
    z = defense.noise_multiplier(cfg)
    out: dict[str, Any] = {
        "defense": defense.name,
        "noise_multiplier": z,
        "rounds": rounds,
        "delta": delta,
        "guarantee": defense.accounted,
        "accountant": "flwr RdpAccountant (no amplification)",
        "accountant_name": "flwr RdpAccountant",  # the name alone, for a sentence (attacker audit)
    }
    if defense.per_round_epsilon is not None:
        out["per_round"] = {"epsilon": defense.per_round_epsilon(cfg), "delta": delta}
    try:
        from flwr.supercore.privacy_accounting import (
            GaussianPrivacyEvent,
            NeighboringRelation,
            PrivacyConfig,
            SamplingMethod,
        )
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

        n = 1 if defense.accounted == "client" else max(population, sampled)
        k = 1 if defense.accounted == "client" else sampled
        accountant = RdpAccountant(
            PrivacyConfig(
                target_delta=delta,
                population_size=n,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION,
            )
        )
        accountant.compose(GaussianPrivacyEvent(z, k, n), count=rounds)
        out["epsilon"] = float(accountant.get_epsilon(delta))
    except ImportError as err:  # the dp-accounting package is missing: say so, keep the run
        out["epsilon"] = None
        out["why"] = f"no accountant: {err}"
    return out


# -- pruning: no Flower mod exists for it, so it is written once, here, as a client mod -------------


def prune_update(update: np.ndarray, fraction: float) -> np.ndarray:
    """Keep the ``ceil(fraction * size)`` entries of largest magnitude, zero the rest (ties: the
    earlier entries win, so the result is deterministic). A copy; integer arrays pass unchanged."""
    if not np.issubdtype(update.dtype, np.floating) or fraction >= 1.0 or update.size == 0:
        return update.copy()
    keep = max(1, int(np.ceil(fraction * update.size)))
    flat = update.reshape(-1)
    order = np.argsort(-np.abs(flat), kind="stable")
    out = np.zeros_like(flat)
    out[order[:keep]] = flat[order[:keep]]
    return out.reshape(update.shape)


class PruneMod:
    """Client mod: prune the update (global - local) of a train reply, tensor by tensor, and send
    ``global - pruned update``. Flower ships clipping and DP mods but none for pruning / top-k
    sparsification (the defense of Zhu et al., DLG), so it is written here in Flower's mod form and
    runs where the DP mods run, after the client's local round."""

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"prune-fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction

    def __call__(self, msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
        from flwr.app import Array, ArrayRecord

        sent = msg.content["arrays"].to_numpy_ndarrays() if "arrays" in msg.content else None
        reply = call_next(msg, context)
        if sent is None or reply.has_error() or "arrays" not in reply.content:
            return reply
        record = reply.content["arrays"]
        pruned = {}
        for key, local, start in zip(record.keys(), record.to_numpy_ndarrays(), sent, strict=True):
            if np.issubdtype(local.dtype, np.floating):
                update = start.astype(local.dtype) - local
                local = start.astype(local.dtype) - prune_update(update, self.fraction)
            pruned[key] = Array(np.ascontiguousarray(local))
        reply.content["arrays"] = ArrayRecord(pruned)
        return reply
