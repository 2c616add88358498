"""Live attacks: a watcher attacks round 1's captures while federated training goes on."""

import json
import os
import subprocess
import sys
from pathlib import Path

from attacker.config import parse_config
from attacker.live import watch
from fedsim.flower_env import FLWR_ENV


def test_round_one_is_attacked_while_training_goes_on(tmp_path):
    run_dir = tmp_path / "fed"
    env = dict(os.environ, **FLWR_ENV, PYTHONWARNINGS="ignore")
    fed = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedsim.cli",
            "simulate",
            "--p",
            "0.25",
            "--rounds",
            "8",
            "--clients",
            "3",
            "--local-steps",
            "2",
            "--capture-rounds",
            "1",
            "--audit",
            "--no-download",
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        cfg = parse_config(
            {"attacks": ["dia", "wiig"], "attack_overrides": {"max_iterations": 20}, "lpips": False, "device": "cpu"}
        )
        summaries = watch(run_dir, tmp_path / "attacks", cfg, poll_s=0.2, timeout_s=240, log=lambda m: None)
        out, _ = fed.communicate(timeout=240)
    finally:
        if fed.poll() is None:
            fed.kill()
    assert fed.returncode == 0, out[-2000:]
    assert len(summaries) >= 1
    first = summaries[0]
    assert all(name.startswith("r0001") for name in first["captures"])
    assert sum(len(s["captures"]) for s in summaries) == 3  # every client of round 1
    # Round 1 is attacked while the federation trains its later rounds. When the attack ends depends on
    # how the two share the machine (on a quiet one the 7 rounds left can end first), its start does not.
    attack_run = json.loads((Path(first["run_dir"]) / "run.json").read_text())
    training_done = (run_dir / "results.json").stat().st_mtime
    assert attack_run["started"] < training_done, "round 1's attack must start before training ends"
    rows = json.loads((Path(first["run_dir"]) / "metrics.json").read_text())
    assert {r["attack"] for r in rows} == {"dia", "wiig"} and all(r["ssim_paper"] is not None for r in rows)
