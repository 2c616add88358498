"""SSIM against the iteration (attacker.curves): scored by a callback that holds the ground truth,
kept through a resume, and summarized as "iterations to SSIM 0.9"."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from attacker.cli import main
from attacker.curves import iterations_to, mean_curve, time_to
from attacker.experiments.report import time_to_paper


def test_iterations_to_is_the_first_scored_iteration_at_the_target() -> None:
    assert iterations_to([(1, 0.1), (100, 0.89), (200, 0.91), (300, 0.95)]) == 200
    assert iterations_to([(1, 0.1), (100, 0.5)]) is None
    assert iterations_to([(1, 0.1), (100, 0.5)], target=0.5) == 100


def test_time_to_a_target_reads_the_jobs_mean_curve() -> None:
    # job b stopped at 200: it holds its last value in the mean
    jobs = [[(1, 0.1), (100, 0.5), (200, 0.7), (300, 0.9)], [(1, 0.2), (100, 0.6), (200, 0.9)]]
    assert mean_curve(jobs) == [(1, 0.15000000000000002), (100, 0.55), (200, 0.8), (300, 0.9)]
    assert time_to(jobs, 0.8, 0.5) == (200, 100.0)
    assert time_to(jobs, 0.95, 0.5) == (None, None)


def test_time_to_the_papers_ssim_from_a_run_folder(tmp_path: Path) -> None:
    (tmp_path / "ssim_curves.csv").write_text(
        "job,attack,iteration,ssim_paper\nv0,dia,1,0.1\nv0,dia,100,0.9\nv1,dia,1,0.2\nv1,dia,100,0.7\nv0,ig,1,0.3\n"
    )
    (tmp_path / "run.json").write_text(json.dumps({"status": "finished", "seconds": 30.0}))
    metrics = [
        {"attack": "dia", "iterations": 100},
        {"attack": "dia", "iterations": 100},
        {"attack": "ig", "iterations": 100},
    ]
    # dia: 200 of 300 victim-iterations, so 20 s for its 100 iterations; mean 0.8 at iteration 100
    assert time_to_paper(tmp_path, "dia", metrics, 0.8) == (100, 20.0)
    assert time_to_paper(tmp_path, "dia", metrics, 0.85) == (None, None)
    assert time_to_paper(tmp_path, "dia", metrics, None) == (None, None)


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
