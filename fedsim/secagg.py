"""Secure aggregation (``secagg``): Flower's SecAgg+ on the server (``SecAggPlusWorkflow`` inside
``DefaultWorkflow``) and on the clients (``secaggplus_mod``), configured once from the run config.

Under it the server never holds one client's reply: the workflow unmasks only the num_examples-weighted
mean of the clients' returned weights, dequantized, and hands that one vector to the (legacy) strategy
in every client's FitRes. What the curious server can keep is therefore one aggregate capture per round
(``fedsim.capture_kinds``: the aggregate kinds), and this module says how fine the quantization left it.

The quantization, as Flower's mod and workflow do it (``flwr.common.secure_aggregation.quantization``):
client i multiplies its weights by ``r_i = round(n_i / max_weight * Q) / Q`` (n_i its num_examples, Q the
quantization range), clips them to [-C, C] (C the clipping range) and rounds them stochastically to the
grid of step ``2C / Q``; the server divides the unmasked sum by ``sum_i r_i``. So the mean's error is
below ``N * step`` per entry, with ``step = (2C / Q) / sum_i r_i`` in the weights' units (divided by the
one-step lr for a gradient), as long as no weighted entry reached the clipping range.

This module imports Flower only inside functions: the run config reads its checks (``--help`` included).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The FitRes metrics that carry a reply's meta (JSON) and, in audit mode, its oracle (safetensors bytes)
# under secure aggregation: the legacy FitRes keeps its metrics and nothing else of the reply (in clear:
# SecAgg+ masks only the weights). fedsim.client_app writes them, fedsim.secagg_server reads them.
META_METRIC = "fedsim-meta"
ORACLE_METRIC = "fedsim-oracle"

# Flower's SecAgg+ modulus (SecAggPlusWorkflow's default modulus_range): masked sums are taken mod 2**32.
MODULUS_RANGE = 2**32
# Flower's quantizer rounds into numpy int32 (quantization._stochastic_round).
_INT32_MAX = 2**31 - 1


def sampled_clients(cfg: Mapping[str, Any]) -> int:
    """The clients a training round samples: the strategies' min_train_nodes (fedsim.server_app)."""
    return max(1, int(int(cfg["num-clients"]) * float(cfg["fraction-train"])))


def flower_count(value: float) -> int | float:
    """A num-shares / reconstruction-threshold setting in Flower's form: a value above 1 is a count
    (an int), one in (0, 1] a fraction (a float), as SecAggPlusWorkflow reads the two types."""
    return int(value) if value > 1 else float(value)


def problem(cfg: Mapping[str, Any]) -> str | None:
    """Why the run config cannot run under secure aggregation (one line), or None; None too when
    ``secagg`` is off. The settings' own ranges are the schema's; these are the combinations."""
    from fedsim.defenses import get_defense
    from fedsim.strategies import get_strategy

    if not cfg["secagg"]:
        return None
    sampled = sampled_clients(cfg)
    if sampled < 2:
        return (
            f"secagg needs at least 2 sampled clients per round (num-clients {cfg['num-clients']} x fraction-train "
            f"{cfg['fraction-train']:g} samples {sampled}): SecAgg+ hides each reply inside the mean of several"
        )
    strategy = get_strategy(str(cfg["strategy"]))
    if not strategy.legacy_class:
        return (
            f"strategy {strategy.name} cannot run under secagg: it aggregates each client's model ({strategy.help}), "
            "and SecAgg+ gives the server only their weighted mean"
        )
    defense = get_defense(str(cfg["defense"]))
    if defense.needs_each_update:
        return (
            f"defense {defense.name} cannot run under secagg: {defense.needs_each_update}, and under SecAgg+ "
            "the server never holds one (central-dp-client-clipping clips on the clients)"
        )
    shares, threshold = float(cfg["num-shares"]), float(cfg["reconstruction-threshold"])
    for key, value, least in (("num-shares", shares, 3), ("reconstruction-threshold", threshold, 2)):
        if value > 1 and (not value.is_integer() or value < least):
            return (
                f"{key} must be a fraction in (0, 1] or an integer >= {least} (Flower's SecAgg+ forms), got {value:g}"
            )
    if shares > 1 and shares > sampled:
        return f"num-shares {shares:g} is more than the {sampled} sampled clients; use at most {sampled}, or a fraction"
    if threshold > 1:
        limit = shares if shares > 1 else sampled
        if threshold >= limit:
            what = f"num-shares {shares:g}" if shares > 1 else f"the {sampled} sampled clients"
            return f"reconstruction-threshold {threshold:g} must be below {what} (or a fraction of num-shares)"
    q = int(cfg["quantization-range"])
    if sampled * q >= MODULUS_RANGE or q > _INT32_MAX:
        return (
            f"quantization-range {q} is too large for {sampled} clients: their quantized sum must stay below "
            f"Flower's SecAgg+ modulus 2**32 (use at most {(MODULUS_RANGE - 1) // sampled})"
        )
    return None


def workflow_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """SecAggPlusWorkflow's arguments from the run config."""
    return {
        "num_shares": flower_count(float(cfg["num-shares"])),
        "reconstruction_threshold": flower_count(float(cfg["reconstruction-threshold"])),
        "max_weight": float(cfg["max-weight"]),
        "clipping_range": float(cfg["clipping-range"]),
        "quantization_range": int(cfg["quantization-range"]),
        "modulus_range": MODULUS_RANGE,
    }


def make_workflow(cfg: Mapping[str, Any]) -> Any:
    """The server's round: Flower's DefaultWorkflow whose fit round is Flower's SecAggPlusWorkflow."""
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    return DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(**workflow_options(cfg)))


def quantization(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The quantization settings a capture records (what the server knows of them)."""
    options = workflow_options(cfg)
    return {k: options[k] for k in ("max_weight", "clipping_range", "quantization_range", "modulus_range")}


def weight_ratios(num_examples: Sequence[int], settings: Mapping[str, Any]) -> list[float]:
    """Each client's weight as the mod applies it: ``round(n / max_weight * Q) / Q`` (secaggplus_mod)."""
    q = int(settings["quantization_range"])
    return [round(n / float(settings["max_weight"]) * q) / q for n in num_examples]


def aggregate_step(num_examples: Sequence[int], settings: Mapping[str, Any]) -> float:
    """The quantization step of the aggregate in the weights' units: ``(2C / Q) / sum_i r_i``. The
    aggregate's error per entry is below ``len(num_examples)`` such steps (one per client)."""
    step = 2 * float(settings["clipping_range"]) / int(settings["quantization_range"])
    return step / sum(weight_ratios(num_examples, settings))


def clipped_entries(
    state: Mapping[str, Any], num_examples: Sequence[int], settings: Mapping[str, Any]
) -> tuple[int, float]:
    """How many floating entries of ``state`` (the global model the clients start from), times the largest
    client weight ``r_i``, reach the clipping range, and the largest such product. Flower's quantizer
    clips each client's weighted weights to [-C, C]: an entry beyond it comes back wrong in the mean (the
    ViT's position embedding reaches 4.3 at its initialization, beyond a clipping range of 1)."""
    r = max(weight_ratios(num_examples, settings), default=0.0)
    c = float(settings["clipping_range"])
    floats = [v.detach().abs().max() for v in state.values() if v.is_floating_point() and v.numel()]
    largest = float(max(floats)) * r if floats else 0.0
    if largest < c:
        return 0, largest
    count = sum(int((v.detach().abs() * r >= c).sum()) for v in state.values() if v.is_floating_point())
    return count, largest
