"""Every subcommand of both CLIs, and the throughput benchmark, run as a user types them: a real
process (``python -m attacker.cli ...``, ``python -m fedsim.cli ...``) in a fresh working folder,
on the tiniest settings that still take the real path (MLP on the offline MNIST sample, 1-2 clients,
1 round, 2 attack iterations, no LPIPS). Each test checks the exit status, that the output holds no
traceback, and what the command wrote.

One module-scoped ``fedsim simulate`` run with a capture round (audited, so it has oracles) feeds
``fedsim captures``, ``attacker run --captures`` and ``attacker watch``. About 2.5 minutes on 2 cores,
mostly Ray and Flower start-up (simulate, sweep, deploy-local, demo).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from attacker.attacks import PRESETS
from fedsim.capture import list_captures, list_oracles, load_capture
from fedsim.deployment import _alive
from fedsim.flower_env import FLWR_ENV

ROOT = Path(__file__).resolve().parents[1]
ATTACKER = [sys.executable, "-m", "attacker.cli"]
FEDSIM = [sys.executable, "-m", "fedsim.cli"]
ENV = dict(os.environ, **FLWR_ENV)
TINY_ATTACK = ["--iterations", "2", "--no-lpips", "--quiet"]  # the attack flags every attacker test shares
RAY_TIMEOUT = 240.0  # a command that starts Ray and Flower: ~20 s here, generous for a loaded machine
PLAIN_TIMEOUT = 120.0  # a command without Ray


def _kill(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` and its process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(
    args: list[str], cwd: Path, timeout: float = PLAIN_TIMEOUT, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``args`` in ``cwd`` and return (exit status, stdout + stderr); fails the test when the
    command outlives ``timeout`` seconds (killed with its process group) or printed a traceback."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args[1:])} ran past {timeout:.0f} s; its output ends:\n{out[-3000:]}")
    assert "Traceback" not in out, f"{' '.join(args[1:])} printed a traceback:\n{out[-5000:]}"
    return proc.returncode, out


def _one_error_line(out: str, *words: str) -> str:
    """The whole output is one line ``error: ...`` holding ``words``."""
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _tree(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its size: to show a folder was only read."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _metrics(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "metrics.json").read_text())


def _attack_folder(run_dir: Path) -> None:
    """``run_dir`` is a finished attack run folder with all its files."""
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    for name in (
        "config.yaml",
        "metrics.csv",
        "metrics.json",
        "summary.csv",
        "summary.json",
        "report.md",
        "grid.png",
        "loss_curves.png",
        "reconstructions.safetensors",
    ):
        assert (run_dir / name).stat().st_size > 0, name


def _copy_atomically(src: Path, dest: Path) -> None:
    """Copy the record folder ``src`` to ``dest`` the way the curious server writes one: under a
    hidden temporary name in the same folder, then renamed into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.copytree(src, tmp)
    os.rename(tmp, dest)


def _wait_for(
    condition: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen[str] | None = None
) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` s or when ``proc`` has exited."""
    deadline = time.time() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the watcher exited ({proc.returncode}) before {what}")
        if time.time() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dataset folder for the whole module: empty, so the commands use the offline MNIST sample
    (and a machine with internet downloads MNIST at most once)."""
    return tmp_path_factory.mktemp("data")


@dataclass
class Simulated:
    """The module's one ``fedsim simulate`` run."""

    rc: int
    out: str
    run_dir: Path


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Simulated:
    """``fedsim simulate``: 2 clients, 1 round, captured and audited (captures and oracles)."""
    cwd = tmp_path_factory.mktemp("simulate")
    rc, out = run(
        [
            *FEDSIM,
            "simulate",
            "--clients",
            "2",
            "--rounds",
            "1",
            "--local-steps",
            "1",
            "--capture-rounds",
            "1",
            "--audit",
            "--victim-batch-size",
            "1",
            "--no-download",
            "--data-root",
            str(data_root),
            "--run-dir",
            "fed",
        ],
        cwd,
        RAY_TIMEOUT,
    )
    assert rc == 0, out[-5000:]
    return Simulated(rc, out, cwd / "fed")


# ---------------------------------------------------------------------------------------------
# fedsim
# ---------------------------------------------------------------------------------------------


def test_fedsim_simulate(simulated: Simulated) -> None:
    """simulate writes a run folder (relative --run-dir under the working folder) with results, rounds,
    the final model, and one capture and one oracle record per client of the captured round."""
    run_dir = simulated.run_dir
    for name in ("config.json", "results.json", "rounds.csv", "final_model.safetensors"):
        assert (run_dir / name).stat().st_size > 0, name
    results = json.loads((run_dir / "results.json").read_text())
    assert results["rounds_run"] == 1 and results["num_captures"] == 2
    rounds = list(csv.DictReader((run_dir / "rounds.csv").read_text().splitlines()))
    assert [r["round"] for r in rounds] == ["0", "1"] and rounds[1]["captured"] == "1"
    captures = sorted(p.name for p in (run_dir / "captures").iterdir())
    assert [c[:10] for c in captures] == ["r0001_c000", "r0001_c001"]
    assert sorted(p.name for p in (run_dir / "oracle").iterdir()) == captures
    assert "2 captures" in simulated.out and "final accuracy" in simulated.out


def test_fedsim_captures(simulated: Simulated) -> None:
    """captures lists every capture of the run folder with its kind and model, uncut when piped."""
    rc, out = run([*FEDSIM, "captures", str(simulated.run_dir)], simulated.run_dir.parent)
    assert rc == 0, out
    for path in (simulated.run_dir / "captures").iterdir():
        assert path.name in out
    assert out.count("gradient") == 2 and "mlp" in out


def test_fedsim_sweep(tmp_path: Path, data_root: Path) -> None:
    """sweep: one federation per p, then accuracy_vs_p.csv (one row per p) and its plot. The model is
    the user's own, a file in the working folder (the example CNN copied there): the clients build it
    in Ray's workers, which find it there as the command does."""
    shutil.copy(ROOT / "examples" / "own_model.py", tmp_path / "my_cnn.py")
    rc, out = run(
        [
            *FEDSIM,
            "sweep",
            "--model",
            "my_cnn:small_cnn",
            "--model-options",
            '{"width": 8}',
            "--p",
            "0",
            "0.5",
            "--clients",
            "1",
            "--rounds",
            "1",
            "--local-steps",
            "1",
            "--no-download",
            "--data-root",
            str(data_root),
            "--out",
            "sweep",
        ],
        tmp_path,
        RAY_TIMEOUT,
    )
    assert rc == 0, out[-5000:]
    out_dir = tmp_path / "sweep"
    rows = list(csv.DictReader((out_dir / "accuracy_vs_p.csv").read_text().splitlines()))
    assert [float(r["p"]) for r in rows] == [0.0, 0.5] and all(r["rounds"] == "1" for r in rows)
    assert all(0 <= float(r["final_accuracy"]) <= 1 for r in rows)
    assert (out_dir / "accuracy_vs_p.png").stat().st_size > 0
    for p in ("p0.0", "p0.5"):
        assert json.loads((out_dir / p / "results.json").read_text())["rounds_run"] == 1
        assert json.loads((out_dir / p / "config.json").read_text())["model"] == "my_cnn:small_cnn"
        rounds = list(csv.DictReader((out_dir / p / "rounds.csv").read_text().splitlines()))
        assert rounds[-1]["num_replies"] == "1"  # the client built the model and trained it
    assert "wrote" in out


def _processes_with_env(entry: str) -> list[int]:
    """Live pids whose environment holds ``entry`` (e.g. ``FLWR_HOME=...``)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if entry.encode() in (proc / "environ").read_bytes().split(b"\0") and _alive(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def test_fedsim_deploy_local(tmp_path: Path, data_root: Path) -> None:
    """deploy-local: SuperLink + two SuperNodes on loopback run a captured round, with TLS and SuperNode
    authentication where openssl can make the certificates (deploy/make-certs.sh), else --insecure;
    the run folder holds the results, the captures, the deployment's logs, and no oracle (no audit in
    a deployment), and nothing started for the deployment is left running. The one deploy-local run
    of the suite (the plain deployment engine: tests/test_deployment.py)."""
    tls = shutil.which("openssl") is not None
    extra: list[str] = []
    if tls:
        certs = tmp_path / "certs"
        subprocess.run(
            ["bash", str(ROOT / "deploy" / "make-certs.sh"), str(certs), "2"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        extra = ["--tls-dir", str(certs), "--node-auth"]
    rc, out = run(
        [
            *FEDSIM,
            "deploy-local",
            "--clients",
            "2",
            "--rounds",
            "1",
            "--capture-rounds",
            "1",
            "--victim-batch-size",
            "2",
            "--no-download",
            "--data-root",
            str(data_root),
            "--quiet",
            "--timeout",
            "300",
            "--run-dir",
            "dep",
            *extra,
        ],
        tmp_path,
        RAY_TIMEOUT + 120,
    )
    run_dir = tmp_path / "dep"
    logs = run_dir / "deployment" / "logs"
    assert rc == 0, out[-3000:] + "\n".join(f.read_text()[-2000:] for f in sorted(logs.glob("*.log")))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["rounds_run"] == 1 and results["num_captures"] == 2
    assert sorted(p.name[:10] for p in (run_dir / "captures").iterdir()) == ["r0001_c000", "r0001_c001"]
    # each client's one-step gradient, readable by load_capture as the simulation's
    captures = [load_capture(p) for p in list_captures(run_dir)]
    assert {(c.round, c.client) for c in captures} == {(1, 0), (1, 1)}
    assert all(c.kind == "gradient" and c.batch_size == 2 and c.labels is not None for c in captures)
    # audit mode is off in a deployment: the server never gets the clients' ground truth
    assert json.loads((run_dir / "config.json").read_text())["audit"] is False
    assert list_oracles(run_dir) == [] and not (run_dir / "oracle").exists()
    assert logs.is_dir() and (run_dir / "rounds.csv").is_file()
    assert "completed" in out and "every process stopped" in out
    conf = (run_dir / "deployment" / "flwr-home" / "config.toml").read_text()
    superlink_log = (logs / "superlink.log").read_text()
    if tls:
        assert "https://127.0.0.1:" in superlink_log  # TLS on the SuperLink's API
        assert superlink_log.count("RegisterNode] Created node_id") == 2  # both SuperNode keys registered
        assert "insecure" not in conf and str(certs / "ca.crt") in conf
    else:
        assert "insecure = true" in conf
    # nothing started for this deployment is left running
    assert _processes_with_env(f"FLWR_HOME={run_dir / 'deployment' / 'flwr-home'}") == []


def test_fedsim_bad_value_is_one_line(tmp_path: Path) -> None:
    """simulate with p out of range: exit 2, one line, nothing written."""
    rc, out = run([*FEDSIM, "simulate", "--p", "1.5", "--no-download", "--run-dir", "run"], tmp_path)
    assert rc == 2
    _one_error_line(out, "p must be in [0, 1)")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# attacker
# ---------------------------------------------------------------------------------------------


def test_attacker_presets(tmp_path: Path) -> None:
    """presets prints every preset and writes nothing."""
    rc, out = run([*ATTACKER, "presets"], tmp_path)
    assert rc == 0, out
    for name in PRESETS:
        assert name in out
    assert list(tmp_path.iterdir()) == []


def test_attacker_demo(tmp_path: Path, data_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """demo: a two-client federation with dropout captures round 1, IG (eval), WIIG and DIA attack each
    client's capture, one report; a second demo into the same folder is refused (the suite's one demo
    federation: tests/test_cli.py runs the demo without one)."""
    from attacker.cli import main as attacker_main

    rc, out = run(
        [*ATTACKER, "demo", "--victims", "2", *TINY_ATTACK, "--data-root", str(data_root), "--out", "demo"],
        tmp_path,
        RAY_TIMEOUT,
    )
    assert rc == 0, out[-5000:]
    demo = tmp_path / "demo"
    report = (demo / "report.md").read_text()
    assert "test accuracy" in report and all(a in report for a in ("ig_eval", "wiig", "dia"))
    assert json.loads((demo / "federated" / "results.json").read_text())["num_captures"] == 2
    _attack_folder(demo / "attack")
    rows = _metrics(demo / "attack")
    assert sorted(r["attack"] for r in rows) == ["dia", "dia", "ig_eval", "ig_eval", "wiig", "wiig"]
    assert {r["job"] for r in rows} == {"r0001_c000", "r0001_c001"}
    assert all(r["iterations"] == 2 and r["ssim_paper"] is not None for r in rows)
    assert "main job report" in out
    capsys.readouterr()
    assert attacker_main(["demo", "--out", str(demo), "--quiet"]) == 2
    printed = capsys.readouterr()
    assert "already holds a finished main job" in printed.out + printed.err


def test_attacker_run_a_shipped_config(tmp_path: Path, data_root: Path) -> None:
    """run configs/attacks/demo.yaml with overrides and no --out: a new run folder under ./runs."""
    rc, out = run(
        [
            *ATTACKER,
            "run",
            str(ROOT / "configs" / "attacks" / "demo.yaml"),
            "--victims",
            "1",
            *TINY_ATTACK,
            "--data-root",
            str(data_root),
        ],
        tmp_path,
    )
    assert rc == 0, out[-5000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("run-")
    _attack_folder(run_dir)
    rows = _metrics(run_dir)
    assert sorted(r["attack"] for r in rows) == ["dia", "ig_eval", "wiig"] and {r["iterations"] for r in rows} == {2}


def test_attacker_run_on_captures(simulated: Simulated, tmp_path: Path) -> None:
    """run --captures attacks every capture of the federated run and leaves that folder as it was."""
    before = _tree(simulated.run_dir)
    rc, out = run([*ATTACKER, "run", "--captures", str(simulated.run_dir), *TINY_ATTACK, "--out", "attack"], tmp_path)
    assert rc == 0, out[-5000:]
    _attack_folder(tmp_path / "attack")
    rows = _metrics(tmp_path / "attack")
    assert {r["job"] for r in rows} == {"r0001_c000", "r0001_c001"}
    assert {r["attack"] for r in rows} == {"ig_eval", "wiig", "dia"} and all(r["ssim_paper"] is not None for r in rows)
    assert _tree(simulated.run_dir) == before


def test_attacker_experiment(tmp_path: Path, data_root: Path) -> None:
    """experiment on a shipped config, one MLP cell with builtin victims: the cell's run folder,
    results.md/csv and the experiment's figure."""
    cell = "table1-mlp-mnist-p0.25"
    rc, out = run(
        [
            *ATTACKER,
            "experiment",
            str(ROOT / "configs" / "experiments" / "table1.yaml"),
            "--cells",
            "mlp-mnist-p0.25",
            "--victim-source",
            "builtin",
            "--victims",
            "1",
            "--no-accuracy",
            *TINY_ATTACK,
            "--data-root",
            str(data_root),
            "--out",
            "exp",
        ],
        tmp_path,
    )
    assert rc == 0, out[-5000:]
    exp = tmp_path / "exp"
    _attack_folder(exp / "cells" / cell)
    assert sorted(r["attack"] for r in _metrics(exp / "cells" / cell)) == ["ig_eval", "wiig"]
    assert [p.name for p in (exp / "cells").iterdir()] == [cell]
    assert "mlp-mnist-p0.25" in (exp / "results.md").read_text()
    assert (exp / "results.csv").read_text().startswith("experiment,cell,model")
    assert (exp / "figures" / "table1_ssim_vs_p.png").stat().st_size > 0
    assert "1 cells: 1 run, 0 already finished" in out


def test_attacker_watch_attacks_a_capture_that_appears_while_it_watches(simulated: Simulated, tmp_path: Path) -> None:
    """watch on a run folder with no captures yet: a capture (and its oracle) renamed into place while
    it watches is attacked before the run ends; once results.json appears the watcher exits 0."""
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    shutil.copy(simulated.run_dir / "config.json", run_dir / "config.json")  # the server writes it first
    out_dir = tmp_path / "attacks"
    log = tmp_path / "watch.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [
                *ATTACKER,
                "watch",
                str(run_dir),
                "--out",
                str(out_dir),
                "--poll",
                "0.2",
                "--timeout",
                "150",
                *TINY_ATTACK,
            ],
            cwd=tmp_path,
            env=ENV,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
    try:
        _wait_for(out_dir.is_dir, 90, "watch start (its --out folder)", proc)
        time.sleep(1.0)  # a few empty polls
        assert proc.poll() is None and not (out_dir / "attacked.json").exists()

        capture = sorted((simulated.run_dir / "captures").iterdir())[0]
        _copy_atomically(simulated.run_dir / "oracle" / capture.name, run_dir / "oracle" / capture.name)
        _copy_atomically(capture, run_dir / "captures" / capture.name)
        done = out_dir / "attacked.json"
        _wait_for(
            lambda: done.is_file() and capture.name in json.loads(done.read_text()),
            90,
            "attack of the new capture",
            proc,
        )
        assert proc.poll() is None, "the watcher must go on while the run has no results.json"

        tmp = run_dir / ".results.json.tmp"
        shutil.copy(simulated.run_dir / "results.json", tmp)
        os.rename(tmp, run_dir / "results.json")
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the watcher did not exit within 60 s of results.json; its output ends:\n{log.read_text()[-3000:]}"
        )
    finally:
        if proc.poll() is None:
            _kill(proc)
            proc.wait()
    out = log.read_text()
    assert rc == 0 and "Traceback" not in out, out[-5000:]
    assert "federated run finished; 1 capture(s) attacked" in out
    assert json.loads((out_dir / "attacked.json").read_text()) == [capture.name]
    (batch,) = [p for p in out_dir.iterdir() if p.is_dir()]
    assert batch.name == "r0001-00"
    _attack_folder(batch)
    rows = _metrics(batch)
    assert {r["job"] for r in rows} == {capture.name[:10]}
    assert {r["attack"] for r in rows} == {"ig_eval", "wiig", "dia"} and all(r["ssim_paper"] is not None for r in rows)


def test_attacker_bad_inputs_are_one_line(tmp_path: Path) -> None:
    """run with a missing victim file, and watch on a missing run folder: exit 2, one line, nothing written."""
    rc, out = run([*ATTACKER, "run", "--victim-file", "/nonexistent/v.tdump", "--quiet", "--out", "bad"], tmp_path)
    assert rc == 2
    _one_error_line(out, "does not exist")
    rc, out = run([*ATTACKER, "watch", "missing", "--out", "bad", "--timeout", "5"], tmp_path)
    assert rc == 2
    _one_error_line(out, "is not a folder")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------


def test_attack_throughput_benchmark(tmp_path: Path) -> None:
    """The benchmark prints a baseline row and dense and factored rows per V, and writes nothing."""
    rc, out = run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "attack_throughput.py"),
            "--models",
            "mlp",
            "--jobs",
            "1",
            "4",
            "--iterations",
            "2",
            "--repeats",
            "1",
            "--baseline-victims",
            "1",
        ],
        tmp_path,
    )
    assert rc == 0, out
    rows = [line.split()[:3] for line in out.splitlines() if line.startswith("mlp ")]
    assert rows == [
        ["mlp", "1", "baseline"],
        ["mlp", "1", "dense"],
        ["mlp", "1", "factored"],
        ["mlp", "4", "dense"],
        ["mlp", "4", "factored"],
    ]
    assert "GEMM peak" in out
    assert list(tmp_path.iterdir()) == []
