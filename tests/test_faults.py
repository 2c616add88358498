"""Injected faults on the federated side: a failing client, and rounds with 100 clients."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from fedsim.capture import list_captures, load_capture
from fedsim.flower_env import FLWR_ENV

# Two Ray actors, whatever the worker's share of the cores (conftest): the 200 client calls mostly
# wait on Ray's scheduling, not on the CPU, so a second actor halves the wait.
ENV = dict(os.environ, **FLWR_ENV, PYTHONWARNINGS="ignore", FEDSIM_RAY_CPUS="2")


def _simulate(run_dir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fedsim.cli", "simulate", "--no-download", "--run-dir", str(run_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def test_100_clients_all_captured_and_a_client_that_raises_mid_round(tmp_path):
    """One simulation for both faults (each Ray start costs about 30 s): 100 virtual clients, two
    captured rounds, client 1 raising in round 1."""
    run_dir = tmp_path / "fed100"
    proc = _simulate(
        run_dir,
        *("--clients", "100", "--rounds", "2", "--capture-rounds", "all"),
        *("--set", "inject-client-failure=1:1"),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["rounds_run"] == 2, "training goes on after the failure"
    failures = results["failures"]
    assert [f["round"] for f in failures] == [1] and "injected failure" in failures[0]["reason"]
    rows = {r["round"]: r for r in results["rounds"]}
    assert rows[1]["num_replies"] == 99 and rows[2]["num_replies"] == 100
    by_round: dict[int, list[int]] = {}
    for path in list_captures(run_dir):
        cap = load_capture(path)  # every capture intact and readable
        by_round.setdefault(cap.round, []).append(cap.client)
    assert sorted(by_round[1]) == [c for c in range(100) if c != 1]
    assert sorted(by_round[2]) == list(range(100))
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    print(f"\n100 virtual clients, 2 captured rounds: peak RSS of the largest process {peak_gb:.2f} GB")
    assert peak_gb < 8, f"memory not bounded: {peak_gb:.1f} GB"
