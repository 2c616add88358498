"""The audited run's setting in words, from the captures' records: the model, p, what the server
captured (by the capture kind's entry), the defense and the privacy it spent."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fedsim.capture import Capture
from fedsim.capture_kinds import CAPTURE_KINDS
from fedsim.client_step import CLIENT_OPTIMIZERS
from fedsim.defenses import DEFENSES, NO_DEFENSE


def describe_setting(capture: Capture) -> dict[str, Any]:
    """p, the model, what the server captured (one-step gradient, or a FedAvg update with K and the
    optimizer) and the defense, as one capture's record states them."""
    hp = capture.hyperparameters
    kind = CAPTURE_KINDS[capture.kind]
    opt = ""  # the client's optimizer matters where its local round is replayed
    if kind.replays_local_round:
        algorithm = CLIENT_OPTIMIZERS.get(str(hp.get("optimizer")))
        opt = str(hp.get("optimizer")) if algorithm is None else algorithm.words(hp.get("momentum", 0))
    short, text = kind.setting(capture, opt)
    defense = capture.defense
    strength = ""
    if defense in DEFENSES and DEFENSES[defense].level and DEFENSES[defense].level in hp:
        strength = f" ({DEFENSES[defense].level_name} = {hp[DEFENSES[defense].level]})"
    return {
        "model": capture.spec.name,
        "dataset": capture.spec.dataset,
        "p": capture.p,
        "capture_kind": capture.kind,
        "capture": short,
        "capture_text": text,
        "local_steps": capture.local_steps,
        "optimizer": hp.get("optimizer") if kind.replays_local_round else None,
        "defense": defense,
        "defense_short": "no defense" if defense == NO_DEFENSE else f"defense {defense}{strength}",
        "defense_text": "no defense"
        if defense == NO_DEFENSE
        else f"defense {defense}{strength}: the server captured {capture.defense_captured or 'the defended reply'}",
    }


def with_privacy_spent(setting: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Under a DP defense the setting says the epsilon spent over the whole run, as the run's
    results.json (``privacy``) has it: the clients' Opacus accountant for dp-sgd, Flower's accountant
    composed over the rounds for the update-level DP defenses. Unchanged where the run has no such
    record (still running, or a defense without noise)."""
    if setting["defense"] == NO_DEFENSE:
        return setting
    try:
        privacy = json.loads((run_dir / "results.json").read_text()).get("privacy")
        eps, delta = privacy.get("epsilon"), float(privacy["delta"])
        # the accountant's name alone (older runs' records hold only its description)
        accountant = str(privacy.get("accountant_name") or privacy.get("accountant") or "the run's accountant")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return setting
    if eps is None or not math.isfinite(float(eps)):
        if DEFENSES.get(setting["defense"]) is None or not DEFENSES[setting["defense"]].in_local_round:
            return setting
        spent = "clipping only, no noise: no privacy guarantee"  # dp-sgd with dp-noise-from none
    else:
        spent = f"spent ε = {float(eps):.3g} at δ = {delta:g} over the run ({accountant})"
        setting = {**setting, "privacy": {"epsilon": float(eps), "delta": delta, "accountant": accountant}}
    return {
        **setting,
        "defense_short": f"{setting['defense_short']}, {spent}",
        "defense_text": f"{setting['defense_text']}; {spent}",
    }
