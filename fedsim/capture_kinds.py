"""The capture kinds: what the curious server keeps of a client's reply in a capture round, one entry each.

A capture of kind "gradient" holds the gradient of one plain SGD step on the client's victim batch; one
of kind "update" holds the FedAvg update (global − local) of a normal local round, which the attacker
replays step by step. Everything that depends on the kind asks its entry here: the capture store (which
tensors, how many labels), the strategy (which round-config flag it sends), the run's checks and its
privacy schedule (one step or a local round), the attacker (replay a local plan or not) and the audit
(how it names the setting).

Under secure aggregation (``secagg``: Flower's SecAgg+) the server never holds one client's reply, only
the num_examples-weighted mean of the round's replies, quantized: each client kind has an aggregate kind
(``aggregate_of`` names the client kind it averages) that the server records in its place, one capture
per round. A run chooses a client kind (``capture-kind``); the aggregate kind follows from ``secagg``.

A leaf module (only the standard library): the run config, DP-SGD's schedule and the capture store all
import it, and each other, so it must import none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# The round-config flags the strategy sends every client in every round (True only in a capture round,
# for the flag of the run's kind): "one-step" runs one plain SGD step on the victim batch,
# "capture-update" a normal local round whose update and step labels the server keeps.
CLIENT_FLAGS = ("one-step", "capture-update")


class CapturedRound(Protocol):
    """The fields of a capture (fedsim.capture.Capture) the audit's setting text is written from."""

    batch_size: int
    num_examples: int
    local_steps: int
    hyperparameters: dict[str, Any]
    aggregate: Any  # an aggregate capture's members and quantization (fedsim.capture.Aggregate); None otherwise


def _plural(n: int) -> str:
    return "s" if n > 1 else ""


def _gradient_setting(capture: CapturedRound, optimizer: str) -> tuple[str, str]:
    b = capture.batch_size
    return (
        f"one-step gradients of {b} image{_plural(b)} each",
        f"one-step gradients, each of {b} training image{_plural(b)} of a client",
    )


def _update_setting(capture: CapturedRound, optimizer: str) -> tuple[str, str]:
    hp = capture.hyperparameters
    return (
        f"FedAvg K = {capture.local_steps} {optimizer}",
        f"FedAvg updates: each client trained {capture.num_examples} images for {hp.get('local-epochs')} "
        f"epoch(s) in batches of {hp.get('batch-size')}, K = {capture.local_steps} local {optimizer} steps "
        f"(lr {hp.get('lr')}) with fresh dropout masks at every step",
    )


def _aggregate_words(capture: CapturedRound, what: str) -> str:
    agg = capture.aggregate
    n = len(agg.clients)
    return (
        f"the mean of {n} clients' {what} (SecAgg+: the server never holds one client's), quantized with step "
        f"{agg.step:.2g} (the captured mean's RMS entry, quantization noise included: {agg.rms:.2g})"
    )


def _secagg_gradient_setting(capture: CapturedRound, optimizer: str) -> tuple[str, str]:
    n, b = len(capture.aggregate.clients), capture.batch_size
    return (
        f"SecAgg+ mean of {n} one-step gradients ({b} images)",
        f"{_aggregate_words(capture, 'one-step gradients')}: the gradient of one batch of the {b} images of the "
        f"{n} clients, each image with its own dropout masks",
    )


def _secagg_update_setting(capture: CapturedRound, optimizer: str) -> tuple[str, str]:
    agg, hp = capture.aggregate, capture.hyperparameters
    n, counts = len(agg.clients), sorted(set(agg.images))
    each = counts[0] if len(counts) == 1 else "/".join(map(str, agg.images))
    return (
        f"SecAgg+ mean of {n} FedAvg K = {capture.local_steps} {optimizer} updates",
        f"{_aggregate_words(capture, 'FedAvg updates')}: each client trained {each} images for "
        f"{hp.get('local-epochs')} epoch(s) in batches of {hp.get('batch-size')}, K = {capture.local_steps} local "
        f"{optimizer} steps (lr {hp.get('lr')}) with fresh dropout masks at every step, from the same global model",
    )


@dataclass(frozen=True)
class CaptureKind:
    name: str
    # What it holds: True, the gradient of one plain SGD step (Δ/lr), a tensor per parameter, stored as
    # "gradient/NAME"; False, the update global − local of a local round per state-dict entry ("update/KEY").
    one_step_gradient: bool
    # The Capture field, and the record.json key of the same name, that counts its images (so its labels):
    # the one step's victim batch ("batch_size") or the local round's images ("num_examples").
    images_field: str
    # How the attacker matches it: by replaying the client's local round (attacker.captures.replay_plan
    # builds the plan from the capture's hyperparameters), or as a gradient directly (no plan).
    replays_local_round: bool
    # The flag of CLIENT_FLAGS the strategy sets in a capture round of this kind.
    client_flag: str
    # The audit's words for what the server captured: (capture, the optimizer's words) -> (short, long).
    setting: Callable[[CapturedRound, str], tuple[str, str]]
    # An aggregate kind: the client kind whose replies it averages (secure aggregation); "" for a client kind.
    aggregate_of: str = ""

    def __post_init__(self) -> None:
        if self.client_flag not in CLIENT_FLAGS:
            raise ValueError(f"capture kind {self.name}: client flag must be one of {CLIENT_FLAGS}")

    def round_config(self, captured: bool) -> dict[str, bool]:
        """The flags the strategy sends the clients of a round: this kind's set in a capture round only."""
        return {flag: captured and flag == self.client_flag for flag in CLIENT_FLAGS}


# A new capture kind is one entry here (the run config's capture-kind choices follow).
CAPTURE_KINDS: dict[str, CaptureKind] = {
    "gradient": CaptureKind(
        "gradient",
        one_step_gradient=True,
        images_field="batch_size",
        replays_local_round=False,
        client_flag="one-step",
        setting=_gradient_setting,
    ),
    "update": CaptureKind(
        "update",
        one_step_gradient=False,
        images_field="num_examples",
        replays_local_round=True,
        client_flag="capture-update",
        setting=_update_setting,
    ),
    "secagg-gradient": CaptureKind(
        "secagg-gradient",
        one_step_gradient=True,
        images_field="batch_size",  # all the clients' victim images: one batch
        replays_local_round=False,
        client_flag="one-step",
        setting=_secagg_gradient_setting,
        aggregate_of="gradient",
    ),
    "secagg-update": CaptureKind(
        "secagg-update",
        one_step_gradient=False,
        images_field="num_examples",
        replays_local_round=True,
        client_flag="capture-update",
        setting=_secagg_update_setting,
        aggregate_of="update",
    ),
}


def client_kinds() -> tuple[str, ...]:
    """The kinds a run chooses (``capture-kind``): what one client's reply is; not the aggregates."""
    return tuple(name for name, kind in CAPTURE_KINDS.items() if not kind.aggregate_of)


def aggregate_kind(client_kind: str) -> str:
    """The kind the server records under secure aggregation in place of ``client_kind``'s captures."""
    for name, kind in CAPTURE_KINDS.items():
        if kind.aggregate_of == client_kind:
            return name
    raise ValueError(f"capture kind {client_kind!r} has no aggregate kind for secure aggregation")
