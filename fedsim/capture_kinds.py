"""The capture kinds: what the curious server keeps of a client's reply in a capture round, one entry each.

A capture of kind "gradient" holds the gradient of one plain SGD step on the client's victim batch; one
of kind "update" holds the FedAvg update (global − local) of a normal local round, which the attacker
replays step by step. Everything that depends on the kind asks its entry here: the capture store (which
tensors, how many labels), the strategy (which round-config flag it sends), the run's checks and its
privacy schedule (one step or a local round), the attacker (replay a local plan or not) and the audit
(how it names the setting).

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
}
