"""The main job: the whole story on an embedded default, offline in a few minutes on 2 cores.

A short Flower simulation (Ray) trains an MLP with dropout p = 0.25 on MNIST; in round 1 the
honest-but-curious server captures each client's one-step gradient (audit on, so the clients'
true images and masks are kept apart for WIIG and scoring); IG (eval), WIIG and DIA attack the
captured gradients; one report shows the accuracy per round, the attack table and the pictures.

With ``capture_kind="update"`` the same story runs on a FedAvg training round instead: in round 1
every client trains on a victim set of 4 images, one epoch in batches of 1 with plain SGD
(K = 4 local steps, fresh dropout masks at each), and the server captures its update; the attacks
replay the 4 steps (and the Δ/(lr·K) baseline treats the update as one gradient).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsim.run_config import DEFAULTS, resolve_config

from .config import parse_config
from .pipeline import RunDirError, run_attack
from .profiles import DEFAULT_PROFILE
from .report import atomic_write

# Where the main job differs from the run config's defaults (fedsim.run_config.SCHEMA: an MLP with
# p = 0.25 on MNIST, one local epoch of Adam, one image per victim batch).
FEDERATION: dict[str, Any] = {
    "num-clients": 8,  # 8 victims: one one-step image per client in the captured round
    "num-server-rounds": 3,
    "capture-rounds": "1",  # round 1: the model at its random initialization, as in the paper
    "audit": True,
}
ATTACKS = {
    "attacks": ["ig_eval", "wiig", "dia"],
    # The paper allows 20,000 iterations; 2,000 finish in minutes here and WIIG and DIA are
    # near their final SSIM by then on the MLP (IG stays where it is).
    "attack_overrides": {"max_iterations": 2000},
}
# `attacker demo --offline-victims`: the same attacks on as many victims taken from a client's partition
# (configs/attacks/demo.yaml writes it out as a config to copy; a test keeps the two equal).
OFFLINE_DEMO: dict[str, Any] = {"victims": {"source": "builtin", "count": FEDERATION["num-clients"]}, **ATTACKS}
# The FedAvg variant: every round trains (batch size 1, SGD); round 1's updates are captured, each
# from a client's victim set of N = 4 images (K = 4 steps). Replaying K steps costs about K times a
# one-step iteration, so the demo runs 4 clients and 1,000 iterations.
UPDATE_FEDERATION: dict[str, Any] = dict(
    FEDERATION,
    **{
        "num-clients": 4,
        "capture-kind": "update",
        "capture-images": 4,
        "batch-size": 1,
        "optimizer": "sgd",
        "lr": 0.01,
    },
)  # shuffled batches: in-order ones see a class-sorted partition
UPDATE_ATTACKS = {"attacks": ["ig_eval", "wiig", "dia", "dia_onestep"], "attack_overrides": {"max_iterations": 1000}}


@dataclass(frozen=True)
class StoryVariant:
    """The main job on one capture kind: its federation and attacks, and how its report tells them."""

    federation: dict[str, Any]
    attacks: dict[str, Any]
    shared: Callable[[dict[str, Any]], str]  # what the server captured, from the run's config.json
    attacked: str  # what the attacks did with it


# One variant per capture kind (fedsim.capture_kinds.CAPTURE_KINDS; `attacker demo --capture-kind` offers them all).
STORIES: dict[str, StoryVariant] = {
    "gradient": StoryVariant(
        FEDERATION,
        ATTACKS,
        lambda fed: f"a one-step gradient of {fed['victim-batch-size']} training image(s) per client",
        "on the captured gradients: IG (eval) ignores dropout, WIIG replays the client's true masks "
        "(an oracle), DIA learns the masks from the gradient alone",
    ),
    "update": StoryVariant(
        UPDATE_FEDERATION,
        UPDATE_ATTACKS,
        lambda fed: (
            f"the update of a FedAvg training round: {fed['capture-images']} training images per client, "
            f"{fed['local-epochs']} epoch(s) in batches of {fed['batch-size']} with {fed['optimizer']} "
            f"(lr {fed['lr']}), fresh dropout masks at every local step"
        ),
        "on the captured updates, each replaying the client's local steps: IG (eval) ignores dropout, "
        "WIIG replays the client's true masks of every step (an oracle), DIA learns one set of masks per "
        "step from the update alone; dia_onestep is the cheap baseline that takes Δ/(lr·K) as one gradient",
    ),
}


def run_story(
    out: Path,
    *,
    attack_overrides: dict[str, Any] | None = None,
    lpips: bool = True,
    data_root: str = "data",
    device: str = "auto",
    progress: bool = True,
    log: Callable[[str], Any] = print,
    num_clients: int | None = None,
    capture_kind: str = "gradient",
    profile: str = DEFAULT_PROFILE,
) -> dict[str, Any]:
    """Run the main job into ``out`` (federated/, attack/, report.md). ``num_clients`` = victims;
    ``capture_kind`` "update" captures a FedAvg training round instead of a one-step round."""
    federation, attacks = STORIES[capture_kind].federation, STORIES[capture_kind].attacks
    out = Path(out)
    if (out / "report.md").exists():
        raise RunDirError(f"{out} already holds a finished main job; choose another --out or remove it")
    fed_dir = out / "federated"
    if not (fed_dir / "results.json").exists():
        if fed_dir.exists() and any(fed_dir.iterdir()):
            raise RunDirError(f"{fed_dir} holds an unfinished federated run; remove it to start again")
        from fedsim.simulation import run_simulation_job

        cfg = resolve_config(federation, {"run-dir": str(fed_dir), "data-root": data_root})
        if num_clients:
            cfg["num-clients"] = num_clients
        log(
            f"federated training: {cfg['model']}/{cfg['dataset']}, p = {cfg['p']}, {cfg['num-clients']} clients, "
            f"{cfg['num-server-rounds']} rounds; the curious server captures round {cfg['capture-rounds']}"
        )
        run_simulation_job(cfg, quiet=True)  # the accuracy per round is printed below; Flower's warnings stay
    rounds = list(csv.DictReader((fed_dir / "rounds.csv").read_text().splitlines()))
    for row in rounds:
        log(
            f"  round {row['round']}: test accuracy {100 * float(row['accuracy']):.2f} %"
            + (" (captured)" if row.get("captured") == "1" else "")
        )
    attack_cfg = parse_config(
        {
            "victims": {"source": "captures", "captures": str(fed_dir)},
            "attacks": attacks["attacks"],
            "attack_overrides": dict(attacks["attack_overrides"], **(attack_overrides or {})),
            "lpips": lpips,
            "device": device,
            "profile": profile,
        }
    )
    result = run_attack(attack_cfg, out / "attack", progress=progress, log=log)
    write_story_report(out, rounds, result)
    return result


def write_story_report(out: Path, rounds: list[dict[str, str]], result: dict[str, Any]) -> None:
    attack_report = (out / "attack" / "report.md").read_text()
    table = attack_report[attack_report.index("| attack") : attack_report.index("![")].strip()
    acc = "\n".join(
        f"| {r['round']} | {100 * float(r['accuracy']):.2f} | {r['num_replies']} | "
        f"{'yes' if r.get('captured') == '1' else ''} |"
        for r in rounds
    )
    fed = json.loads((out / "federated" / "config.json").read_text())
    story = STORIES[fed.get("capture-kind", DEFAULTS["capture-kind"])]
    shared, attacks = story.shared(fed), story.attacked
    text = f"""# Dropout does not protect clients: the main job

1. **Federated training** (Flower simulation engine): {fed["model"]} on {fed["dataset"]} with dropout
   p = {fed["p"]}, {fed["num-clients"]} clients, {fed["num-server-rounds"]} rounds, FedAvg.

| round | test accuracy % | replies | captured |
|---|---|---|---|
{acc}

2. **The honest-but-curious server** recorded every client's reply in round {fed["capture-rounds"]}:
   {shared} (`federated/captures/`). Audit mode kept the clients' true images and dropout masks apart
   (`federated/oracle/`), for WIIG and scoring only.

3. **The attacks** {attacks}.

{table}

![originals against each attack's reconstructions](attack/grid.png)

![reconstruction loss](attack/loss_curves.png)

SSIM in *paper space* is computed on normalized tensors (data range 1/std, as in the paper's tables),
*[0,1]* on images mapped back to [0,1]. Per-job metrics: `attack/metrics.csv`.
"""
    atomic_write(out / "report.md", text)
