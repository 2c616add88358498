"""SSIM against the iteration (attacker.curves): scored by a callback that holds the ground truth,
kept through a resume, and summarized as "iterations to SSIM 0.9"."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from attacker.cli import main
from attacker.curves import iterations_to


def test_iterations_to_is_the_first_scored_iteration_at_the_target() -> None:
    assert iterations_to([(1, 0.1), (100, 0.89), (200, 0.91), (300, 0.95)]) == 200
    assert iterations_to([(1, 0.1), (100, 0.5)]) is None
    assert iterations_to([(1, 0.1), (100, 0.5)], target=0.5) == 100


def test_a_run_writes_its_ssim_curves_and_the_iterations_to_ssim_09(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "run",
            "--victims",
            "2",
            "--iterations",
            "250",
            "--attacks",
            "ig_eval",
            "dia",
            "--quiet",
            "--no-lpips",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    with open(out / "ssim_curves.csv") as fh:
        points = list(csv.DictReader(fh))
    by_job: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for p in points:
        by_job.setdefault((p["job"], p["attack"]), []).append((int(p["iteration"]), float(p["ssim_paper"])))
    assert set(by_job) == {(f"victim00{i}", a) for i in range(2) for a in ("ig_eval", "dia")}
    for curve in by_job.values():
        its = [it for it, _ in curve]
        # iteration 1, every 100th, and the iteration the job stopped at (the cap, 250, or earlier)
        assert its[0] == 1 and its[1:-1] == list(range(100, 100 * (len(its) - 1), 100)) and its[-1] <= 250
        assert curve[0][1] < 0.2  # a random start
    rows = json.loads((out / "metrics.json").read_text())
    for row in rows:
        expected = iterations_to(by_job[(row["job"], row["attack"])])
        assert row["iters_to_ssim90"] == expected
    dia = [r for r in rows if r["attack"] == "dia"]
    assert all(r["iters_to_ssim90"] is not None for r in dia)  # DIA reconstructs the MLP's digits quickly
    summary = {e["attack"]: e for e in json.loads((out / "summary.json").read_text())}
    assert summary["dia"]["reached_ssim90"] == 2
