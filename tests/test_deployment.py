"""The same Flower app in the deployment engine: SuperLink + SuperNodes as real processes on loopback.

A deployment starts the processes, runs federations with capture on, reads the captures back from
the run folder, and checks that every process it started (and every process those started: the
SuperExecs, ServerApp and ClientApp processes) is gone afterwards, by pid. Each run costs a
ClientApp process per node and message (a round of SecAgg+ is four messages), about 6 s of CPU each,
so one deployment serves every run of the module (the `deployed` fixture) and each run serves several
tests where it can: a SuperNode serving several messages of a run is met in the SecAgg+ run and the
killed run. The
`fedsim deploy-local` command, with TLS and SuperNode authentication, is run in tests/test_commands.py.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedsim import task
from fedsim.capture import list_captures, list_oracles, load_capture
from fedsim.data import DataUnavailableError
from fedsim.deployment import COMPLETED, CONNECTION, LocalDeployment, marked_pids
from fedsim.run_config import resolve_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def offline_mnist() -> None:
    try:
        task.load_split(resolve_config({"download": False}), train=False)
    except DataUnavailableError as exc:
        pytest.skip(f"no offline MNIST sample: {exc}")


def _config(run_dir: Path, **extra: Any) -> dict[str, Any]:
    cfg = resolve_config(
        {
            "num-clients": 2,
            "num-server-rounds": 2,
            "capture-rounds": "all",
            "download": False,
            "victim-batch-size": 2,
            "run-dir": str(run_dir),
            **extra,
        }
    )
    cfg["data-root"] = str(Path(cfg["data-root"]).resolve())
    return cfg


@dataclass
class Deployed:
    """What the module's one deployment did: a SecAgg+ round, a run that fails, then a pruned run whose
    SuperNode 1 is killed once round 1 is captured; then every process is stopped."""

    direct: dict[str, int]  # the deployment's own processes, by name, at the start
    running_at_start: list[int]
    secure: Any  # DeployResult of the SecAgg+ round
    secure_status: str  # read back from the SuperLink (`flwr ls`)
    failed: Any  # DeployResult of the run with an unknown model
    killed: dict[str, Any]  # the killed run's outcome: "result" or "error"
    seen_pids: set[int]
    running: list[int]  # after the deployment stopped
    marked: list[int]
    returncodes: list[int | None]
    flwr_run_log: str
    work_dir: Path
    superlink_port: int
    secagg_dir: Path
    killed_captures: list[Any]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Deployed:
    """One deployment (SuperLink and two SuperNodes) serves every run of this module: starting one costs
    half a minute of CPU on the 2-core machine. The run that kills a SuperNode goes last."""
    import threading
    import time

    from fedsim.deployment import DeploymentError

    tmp_path = tmp_path_factory.mktemp("deployed")
    secagg_dir, killed_dir = tmp_path / "secagg", tmp_path / "killed"
    pruned = _config(
        killed_dir,
        **{"num-server-rounds": 4, "local-steps": 2, "capture-kind": "update"},
        **{"defense": "prune", "prune-fraction": 0.1},
    )
    killed: dict[str, Any] = {}
    with LocalDeployment(2, tmp_path / "work") as dep:
        direct = {name: proc.pid for name, proc in dep.procs.items()}
        running_at_start = dep.running()
        secure = dep.run(_config(secagg_dir, secagg=True, **{"num-server-rounds": 1}), timeout=300)
        secure_status = dep.run_status(secure.run_id)["status"]
        flwr_run_log = dep.log_tail("flwr-run")  # the SecAgg+ run's, for its assertion's message
        # `flwr run --stream` exits 0 for a failed run too: the status from `flwr ls` tells
        failed = dep.run(_config(tmp_path / "failed", model="no-such-model"), timeout=120)

        def submit() -> None:
            try:
                killed["result"] = dep.run(pruned, timeout=90)
            except DeploymentError as err:
                killed["error"] = str(err)

        worker = threading.Thread(target=submit)
        worker.start()
        deadline = time.time() + 240
        while len([p for p in list_captures(killed_dir) if p.name.startswith("r0001")]) < 2 and time.time() < deadline:
            time.sleep(0.2)
        dep.procs["supernode-1"].kill()
        worker.join(timeout=200)
        assert not worker.is_alive(), "the run neither finished nor stopped"
    return Deployed(
        direct=direct,
        running_at_start=running_at_start,
        secure=secure,
        secure_status=secure_status,
        failed=failed,
        killed=killed,
        seen_pids=set(dep.seen_pids),
        running=dep.running(),
        marked=marked_pids(dep.marker),
        returncodes=[proc.returncode for proc in dep.procs.values()],
        flwr_run_log=flwr_run_log,
        work_dir=tmp_path / "work",
        superlink_port=dep.superlink_port,
        secagg_dir=secagg_dir,
        killed_captures=[load_capture(p) for p in list_captures(killed_dir)],  # every capture written is intact
    )


def test_loopback_deployment_runs_the_app_and_stops_every_process(deployed: Deployed) -> None:
    """A round of SecAgg+ (Flower's workflow and mod across processes: four messages per node) and a
    run that fails, on one deployment; then every process it started is gone. A plain captured
    round, with its per-client captures, is `fedsim deploy-local`'s (tests/test_commands.py)."""
    direct = deployed.direct
    assert set(direct) == {"superlink", "supernode-0", "supernode-1"}
    assert set(direct.values()) <= set(deployed.running_at_start)
    assert deployed.secure_status == COMPLETED  # read back from the SuperLink
    assert deployed.failed.status == "finished:failed" and not deployed.failed.ok
    assert "unknown model" in str(deployed.failed.details.get("status-details"))
    # everything stopped, by pid: the direct children and what they started (SuperExecs, apps)
    secure = deployed.secure
    assert secure.ok and secure.status == COMPLETED, (secure, deployed.flwr_run_log)
    assert set(direct.values()) <= deployed.seen_pids and len(deployed.seen_pids) > len(direct) + 1
    assert deployed.running == []
    assert deployed.marked == []
    assert all(code is not None for code in deployed.returncodes)

    # the same run folder as the simulation: results, rounds, the aggregate capture
    run_dir = deployed.secagg_dir
    (aggregate,) = [load_capture(p) for p in list_captures(run_dir)]
    assert aggregate.kind == "secagg-gradient" and aggregate.aggregate.clients == [0, 1]
    assert aggregate.batch_size == 4 and aggregate.aggregate.num_examples == [2, 2]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["rounds_run"] == 1 and results["num_captures"] == 1
    assert [row["num_replies"] for row in results["rounds"]] == [0, 2]
    # audit mode is off in a deployment: the server never gets the clients' ground truth
    assert json.loads((run_dir / "config.json").read_text())["audit"] is False
    assert list_oracles(run_dir) == [] and not (run_dir / "oracle").exists()
    # the CLI's connection lived in a private FLWR_HOME, with the real SuperLink address
    conf = (deployed.work_dir / "flwr-home" / "config.toml").read_text()
    assert f'address = "127.0.0.1:{deployed.superlink_port}"' in conf and "insecure = true" in conf


def test_stop_never_signals_a_process_that_was_given_a_seen_pid(tmp_path: Path) -> None:
    """Once a process of the deployment has ended, the system may give its pid to an unrelated
    process (pids wrap at 32768 here, within minutes on a busy machine): stop() signals the
    processes it saw, not whatever runs under their pids later; a process it saw still goes."""
    unrelated = subprocess.Popen(["sleep", "60"])
    ours = subprocess.Popen(["sleep", "60"])
    try:
        dep = LocalDeployment(1, tmp_path / "work")
        dep.seen_pids.add(unrelated.pid)  # seen as a process that started earlier and has ended
        dep._start_times[unrelated.pid] = "0"
        dep._see(ours.pid)
        assert dep.running() == [ours.pid]
        assert dep.stop(grace=1) == []
        assert ours.wait(timeout=10) != 0  # stopped by a signal
        assert unrelated.poll() is None  # never signalled
    finally:
        for proc in (unrelated, ours):
            proc.kill()
            proc.wait()


def test_a_process_that_loses_its_port_while_being_checked_is_restarted_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving CI met: the process is still running when its exit is checked, then exits
    (its port taken) before the check of the other processes; it is a lost port, not a crash."""
    import sys

    dep = LocalDeployment(1, tmp_path / "work")
    lost_its_port = "import sys; print('[Errno 98] address already in use'); sys.exit(1)"
    dep._spawn("supernode-0", [sys.executable, "-c", lost_its_port])

    proc = dep.procs["supernode-0"]
    real_poll, polls = proc.poll, []

    def poll_running_once() -> int | None:  # still running at its own check, exited at every later one
        polls.append(1)
        return None if len(polls) == 1 else real_poll()

    def listens_after_it_exited(name: str, port: int) -> bool:
        proc.wait()  # it exits between its own poll() and the check of the rest
        return False

    monkeypatch.setattr(proc, "poll", poll_running_once)
    monkeypatch.setattr(dep, "_listens", listens_after_it_exited)
    try:
        assert dep._wait_for_ports({"supernode-0": 1}, timeout=5) == ["supernode-0"]
        assert len(polls) >= 2  # seen once running, then as exited
    finally:
        dep.stop()


def test_a_port_taken_before_the_process_binds_it_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program binds the port free_ports picked before the SuperLink (or a SuperNode) does,
    as a deployment starting at the same moment may: the deployment does not take that program for
    its own server, it restarts the process that lost its port on another one, and the CLI and the
    SuperNodes use the new address."""
    import socket

    import fedsim.deployment as deployment

    real_free_ports = deployment.free_ports
    calls: list[list[int]] = []
    squatters: dict[int, socket.socket] = {}

    def free_ports_taken_first(n: int, host: str = "127.0.0.1") -> list[int]:
        calls.append(real_free_ports(n, host))
        if len(calls) in (1, 3):  # the SuperLink's first port, then the SuperNode's first port
            port = calls[-1][0]
            squatters[port] = socket.socket()
            squatters[port].bind((host, port))
            squatters[port].listen()
        return calls[-1]

    monkeypatch.setattr(deployment, "free_ports", free_ports_taken_first)
    try:
        with LocalDeployment(1, tmp_path / "work") as dep:
            link_taken, node_taken = squatters
            assert len(calls) == 4 and dep.superlink_port == calls[1][0] != link_taken
            assert all(dep.procs[name].poll() is None for name in ("superlink", "supernode-0"))
            assert f"127.0.0.1:{dep.superlink_port}" in dep.procs["supernode-0"].args
            assert str(node_taken) not in dep.procs["supernode-0"].args
            for lost in (f"superlink.port-{link_taken}-taken.log", f"supernode-0.port-{node_taken}-taken.log"):
                assert "address already in use" in (dep.log_dir / lost).read_text(), lost
            conf = (tmp_path / "work" / "flwr-home" / "config.toml").read_text()
            assert f'address = "127.0.0.1:{dep.superlink_port}"' in conf
            dep.flwr("ls", CONNECTION, "--format", "json")  # the CLI reaches this deployment's SuperLink
    finally:
        for squatter in squatters.values():
            squatter.close()
    assert dep.running() == [] and marked_pids(dep.marker) == []


def test_a_run_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    """run()'s timeout: a `flwr run` that never ends (a stand-in script named flwr, as a hung stream
    would) is killed and reported with the timeout, and nothing of it keeps running."""
    import sys
    import time

    from fedsim.deployment import DeploymentError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    flwr = bin_dir / "flwr"
    hangs = "import time\nprint('Successfully started run 7', flush=True)\ntime.sleep(60)\n"
    flwr.write_text(f"#!{sys.executable}\n{hangs}")
    flwr.chmod(0o755)
    dep = LocalDeployment(1, tmp_path / "work", bin_dir=bin_dir)
    dep.work_dir.mkdir(parents=True)
    started = time.monotonic()
    with pytest.raises(DeploymentError, match="did not finish within 2 s"):
        dep.run(_config(tmp_path / "run"), timeout=2)
    assert time.monotonic() - started < 30
    assert dep.procs["flwr-run"].returncode is not None  # killed and waited for
    assert dep.running() == []


def test_a_supernode_killed_mid_run_stops_cleanly_and_keeps_captures(deployed: Deployed) -> None:
    """The run ends (completed with the other node, or stopped), every process goes away, and the
    captures already written stay readable."""
    assert "result" in deployed.killed or "error" in deployed.killed
    assert deployed.running == [] and deployed.marked == []
    assert {(c.round, c.client) for c in deployed.killed_captures if c.round == 1} == {(1, 0), (1, 1)}


def _density(update: dict[str, Any]) -> float:
    return sum(int((v != 0).sum()) for v in update.values()) / sum(v.numel() for v in update.values())


def test_deployment_applies_the_prune_mod(deployed: Deployed) -> None:
    """The deployment engine (SuperLink + SuperNodes on loopback) runs the same ClientApp, mods included:
    round 1's updates, which both nodes sent before the kill, are pruned to 10% of their entries."""
    first = [c for c in deployed.killed_captures if c.round == 1]
    assert len(first) == 2 and all(c.kind == "update" and c.defense == "prune" for c in first)
    assert all(0 < _density(c.update) <= 0.11 for c in first), [_density(c.update) for c in first]
