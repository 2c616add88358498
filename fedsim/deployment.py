"""Run the same Flower app in Flower's *deployment* engine, on loopback, as real processes.

One SuperLink and N SuperNodes are started as separate processes on free 127.0.0.1 ports (plain
or TLS, optionally with SuperNode authentication), then ``flwr run <app> <connection> --stream``
submits the app with the run config. The CLI's connection lives in a private ``FLWR_HOME`` (its
``config.toml``), so the user's ``~/.flwr`` is never read or written. ``flwr run --stream`` exits
0 even when the run failed, so the run's final status is read back with
``flwr ls <connection> --run-id ID --format json``.

Every process this module starts, and every process they start in turn (the SuperExecs, the
``flwr-serverapp`` / ``flwr-clientapp`` processes, a detached SuperLink if one were ever started),
carries a unique marker in its environment; :meth:`LocalDeployment.stop` stops the direct children
by pid and then every process still carrying the marker, by pid, even when the run failed. A pid
is only taken for the process seen under it while that process's start time still matches: once a
process has ended, the system may give its pid to an unrelated one, which is never signalled.

Audit mode (the clients' ground-truth oracle) is off unless the run config sets ``audit``: in a
deployment the server is the attacker and must not get the ground truth.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fedsim.flower_env import FLWR_ENV
from fedsim.simulation import new_run_config

MARKER_ENV = "FEDSIM_DEPLOYMENT_ID"
CONNECTION = "fedsim-local"
COMPLETED = "finished:completed"


class DeploymentError(RuntimeError):
    """The deployment could not start, or the run did not finish as completed."""


@dataclass
class TLSFiles:
    """PEM files for TLS between the CLI/SuperNodes and the SuperLink (see deploy/make-certs.sh)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def from_dir(cls, directory: str | Path) -> TLSFiles:
        d = Path(directory).expanduser().resolve()
        files = cls(d / "ca.crt", d / "server.pem", d / "server.key")
        missing = [str(p) for p in (files.ca_cert, files.server_cert, files.server_key) if not p.is_file()]
        if missing:
            raise DeploymentError(f"missing TLS files {missing}; generate them with deploy/make-certs.sh {d}")
        return files


@dataclass
class DeployResult:
    run_id: int
    status: str
    run_dir: Path
    work_dir: Path
    wall_s: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == COMPLETED


def project_root() -> Path:
    """The Flower app folder (the one holding pyproject.toml with ``[tool.flwr.app]``)."""
    return Path(__file__).resolve().parents[1]


# How often a SuperLink or SuperNode is restarted on another port when it lost its port to another
# process between free_ports() and its own bind (another deployment starting at the same moment).
PORT_ATTEMPTS = 3
# What uvicorn logs when its bind fails because the port is taken (errno EADDRINUSE).
_PORT_TAKEN = re.compile(r"address already in use|errno 98|errno 48", re.IGNORECASE)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that are free now. Another process may still bind one before the server
    meant for it does: :meth:`LocalDeployment.start` checks that the listener on each port is its own
    process and restarts that process on another port when it lost the race."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the IPv4 TCP sockets listening on ``port`` (Linux /proc/net/tcp); None where that
    table cannot be read (then only a connection tells that something listens)."""
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    inodes = set()
    for row in rows:
        # sl, local_address (HEXIP:HEXPORT), rem_address, st (0A: LISTEN), ..., inode (the tenth field)
        fields = row.split()
        if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(fields[9])
    return inodes


def _holds_socket(pid: int, inodes: set[str]) -> bool:
    """True when process ``pid`` has one of the sockets ``inodes`` open (Linux /proc/PID/fd)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[len("socket:[") : -1] in inodes:
            return True
    return False


def _alive(pid: int) -> bool:
    """True while ``pid`` is a live (non-zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (Linux /proc/PID/stat, clock ticks since boot); None where that
    cannot be read. With the pid it names one process: a pid alone may be reused once its process ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def marked_pids(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``MARKER_ENV=marker`` (Linux /proc)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and _alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return sorted(found)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string (JSON escapes are valid TOML escapes)


class LocalDeployment:
    """SuperLink + N SuperNodes on loopback, as processes; use as a context manager.

    ``tls``: a :class:`TLSFiles` (or a folder made by deploy/make-certs.sh), else ``--insecure``.
    ``node_keys``: per SuperNode an OpenSSH EC private key (with ``.pub`` next to it) to enable
    SuperNode authentication (requires TLS); the public keys are registered with ``flwr supernode
    register`` before the nodes start.
    """

    def __init__(
        self,
        num_clients: int,
        work_dir: str | Path,
        *,
        app_dir: str | Path | None = None,
        tls: TLSFiles | str | Path | None = None,
        node_keys: Iterable[str | Path] | None = None,
        bin_dir: str | Path | None = None,
        echo: IO[str] | None = None,
    ) -> None:
        if num_clients < 1:
            raise ValueError("num_clients must be >= 1")
        self.num_clients = num_clients
        self.work_dir = Path(work_dir).expanduser().resolve()
        self.app_dir = Path(app_dir or project_root()).resolve()
        self.tls = TLSFiles.from_dir(tls) if isinstance(tls, (str, Path)) else tls
        self.node_keys = [Path(k).expanduser().resolve() for k in (node_keys or [])]
        if self.node_keys and self.tls is None:
            raise DeploymentError("SuperNode authentication requires TLS (Flower refuses it with --insecure)")
        if self.node_keys and len(self.node_keys) != num_clients:
            raise DeploymentError(
                f"need one SuperNode key per client: {len(self.node_keys)} keys, {num_clients} clients"
            )
        self.bin_dir = Path(bin_dir) if bin_dir else Path(sys.executable).parent
        self.echo = echo
        self.marker = uuid.uuid4().hex
        self.flwr_home = self.work_dir / "flwr-home"
        self.log_dir = self.work_dir / "logs"
        self.superlink_port = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self.seen_pids: set[int] = set()  # every pid started here or found carrying the marker
        self._start_times: dict[int, str | None] = {}  # when each seen pid's process started
        self.left_running: list[int] = []  # what stop() could not stop (always empty so far)

    # ----------------------------------------------------------------- environment and commands
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(FLWR_ENV)
        env[MARKER_ENV] = self.marker
        env["FLWR_HOME"] = str(self.flwr_home)
        # SuperLink and SuperNodes start `flower-superexec` by name: it must be on PATH.
        env["PATH"] = os.pathsep.join([str(self.bin_dir), env.get("PATH", "")])
        env["PYTHONUNBUFFERED"] = "1"
        # Each SuperExec asks for a task to launch (a ServerApp, a ClientApp per message) once a second
        # by default: on loopback, a few times a second costs nothing and starts each message sooner.
        env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.25")
        return env

    def _exe(self, name: str) -> str:
        path = self.bin_dir / name
        if path.exists():
            return str(path)
        found = shutil.which(name)
        if not found:
            raise DeploymentError(f"{name} not found in {self.bin_dir} or on PATH")
        return found

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.superlink_port}"

    def _write_flwr_config(self) -> None:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        lines = [
            "[superlink]",
            f'default = "{CONNECTION}"',
            "",
            f"[superlink.{CONNECTION}]",
            f'address = "{self.address}"',
        ]
        if self.tls is None:
            lines.append("insecure = true")
        else:
            lines.append(f"root-certificates = {_toml_value(str(self.tls.ca_cert))}")
        (self.flwr_home / "config.toml").write_text("\n".join(lines) + "\n")

    def superlink_command(self) -> list[str]:
        cmd = [
            self._exe("flower-superlink"),
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.superlink_port),
        ]
        if self.tls is None:
            cmd.append("--insecure")
        else:
            cmd += [
                "--ssl-ca-certfile",
                str(self.tls.ca_cert),
                "--ssl-certfile",
                str(self.tls.server_cert),
                "--ssl-keyfile",
                str(self.tls.server_key),
            ]
        if self.node_keys:
            cmd.append("--enable-supernode-auth")
        return cmd

    def supernode_command(self, partition_id: int, runtime_port: int) -> list[str]:
        cmd = [
            self._exe("flower-supernode"),
            "--superlink",
            self.address,
            "--host",
            "127.0.0.1",
            "--port",
            str(runtime_port),
            "--node-config",
            f"partition-id={partition_id} num-partitions={self.num_clients}",
        ]
        cmd += ["--insecure"] if self.tls is None else ["--root-certificates", str(self.tls.ca_cert)]
        if self.node_keys:
            cmd += ["--auth-supernode-private-key", str(self.node_keys[partition_id])]
        return cmd

    def flwr(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one short ``flwr`` CLI command against this deployment."""
        proc = subprocess.Popen(
            [self._exe("flwr"), *args],
            cwd=self.work_dir,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._see(proc.pid)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise DeploymentError(f"flwr {' '.join(args)} timed out after {timeout} s") from None
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise DeploymentError(f"flwr {' '.join(args)} failed ({proc.returncode}): {err.strip() or out.strip()}")
        return result

    # ----------------------------------------------------------------- lifecycle
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        proc = subprocess.Popen(
            cmd, cwd=self.work_dir, env=self.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs[name] = proc
        self._see(proc.pid)
        return proc

    def _check_alive(self, ignore: Iterable[str] = ()) -> None:
        for name, proc in self.procs.items():
            if name != "flwr-run" and name not in ignore and proc.poll() is not None:
                raise self._exited(name)

    def _exited(self, name: str) -> DeploymentError:
        return DeploymentError(
            f"{name} exited with code {self.procs[name].returncode}; see {self.log_dir / (name + '.log')}:\n"
            + self.log_tail(name)
        )

    def log_tail(self, name: str, n: int = 20) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _listens(self, name: str, port: int) -> bool:
        """True once process ``name`` itself listens on ``port``; where the socket table cannot be
        read, once anything answers there."""
        inodes = _listening_inodes(port)
        if inodes is not None:
            return bool(inodes) and _holds_socket(self.procs[name].pid, inodes)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _wait_for_ports(self, ports: Mapping[str, int], timeout: float) -> list[str]:
        """Wait until each process of ``ports`` (name: port) listens on its port. Returns the names of
        those that exited because another process had bound their port first; any other exit, of
        these or of the processes already running, is a DeploymentError."""
        deadline = time.monotonic() + timeout
        waiting, lost = dict(ports), []
        while True:
            for name, port in list(waiting.items()):
                if self.procs[name].poll() is not None:
                    if not _PORT_TAKEN.search(self.log_tail(name, 50)):
                        raise self._exited(name)
                    lost.append(name)
                    del waiting[name]
                elif self._listens(name, port):
                    del waiting[name]
            # The waiting ones are judged above, once per pass: one that exits after its own check is
            # seen (port taken or not) on the next pass rather than taken for a crash here.
            self._check_alive(ignore=[*lost, *waiting])
            if not waiting:
                return lost
            if time.monotonic() > deadline:
                where = ", ".join(f"{name} on 127.0.0.1:{port}" for name, port in waiting.items())
                raise DeploymentError(f"nothing listens after {timeout} s: {where}")
            time.sleep(0.1)

    def start(self, timeout: float = 60.0) -> None:
        """Start the SuperLink, register node keys (if any), start the SuperNodes.

        A process whose port was taken (another program bound it after :func:`free_ports` picked it)
        is started again on another port, up to :data:`PORT_ATTEMPTS` times."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._start_on_free_ports({"superlink": self._superlink_on}, timeout)
        for key in self.node_keys:
            self.flwr("supernode", "register", str(key.with_name(key.name + ".pub")), CONNECTION)
        self._start_on_free_ports(
            {f"supernode-{i}": lambda port, i=i: self.supernode_command(i, port) for i in range(self.num_clients)},
            timeout,
        )

    def _superlink_on(self, port: int) -> list[str]:
        self.superlink_port = port
        self._write_flwr_config()
        return self.superlink_command()

    def _start_on_free_ports(self, commands: Mapping[str, Callable[[int], list[str]]], timeout: float) -> None:
        """Spawn each process of ``commands`` (name: its command line for a port) on a free port and
        wait until all listen; restart those that lost their port on new ones."""
        pending = list(commands)
        for _ in range(PORT_ATTEMPTS):
            ports = dict(zip(pending, free_ports(len(pending))))
            for name, port in ports.items():
                self._spawn(name, commands[name](port))
            pending = self._wait_for_ports(ports, timeout)
            if not pending:
                return
            for name in pending:  # its log says so; kept beside the next attempt's
                (self.log_dir / f"{name}.log").replace(self.log_dir / f"{name}.port-{ports[name]}-taken.log")
        raise DeploymentError(f"{', '.join(pending)} found its port taken {PORT_ATTEMPTS} times; see {self.log_dir}")

    def run(self, run_config: Mapping[str, Any], timeout: float = 600.0) -> DeployResult:
        """Submit the app with ``run_config`` (run config keys), stream it, return its final status."""
        t0 = time.time()
        cfg_path = self.work_dir / "run-config.toml"
        cfg_path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
        cmd = [self._exe("flwr"), "run", str(self.app_dir), CONNECTION, "--stream", "--run-config", str(cfg_path)]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            cmd,
            cwd=self.work_dir,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.procs["flwr-run"] = proc
        self._see(proc.pid)
        run_id: int | None = None
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        with open(self.log_dir / "flwr-run.log", "wb") as log:
            os.set_blocking(proc.stdout.fileno(), False)
            buffer = b""
            while True:
                chunk = proc.stdout.read()
                if chunk:
                    log.write(chunk)
                    log.flush()
                    if self.echo is not None:
                        self.echo.write(chunk.decode(errors="replace"))
                        self.echo.flush()
                    buffer = (buffer + chunk)[-4096:]
                    if run_id is None and (m := re.search(rb"Successfully started run (\d+)", buffer)):
                        run_id = int(m.group(1))
                elif proc.poll() is not None:
                    break
                else:
                    time.sleep(0.1)
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise DeploymentError(f"flwr run did not finish within {timeout} s; see {self.log_dir}")
                self._see_marked()
                self._check_alive()
        if proc.returncode != 0 or run_id is None:
            raise DeploymentError(f"flwr run failed (exit {proc.returncode}); see {self.log_dir / 'flwr-run.log'}")
        details = self.run_status(run_id)
        return DeployResult(
            run_id=run_id,
            status=str(details.get("status")),
            run_dir=Path(str(run_config.get("run-dir", ""))),
            work_dir=self.work_dir,
            wall_s=round(time.time() - t0, 2),
            details=details,
        )

    def run_status(self, run_id: int) -> dict[str, Any]:
        """``flwr ls --run-id`` as a dict (``status`` is e.g. ``finished:completed``)."""
        res = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        data = json.loads(res.stdout[res.stdout.index("{") :])
        runs = data.get("runs") or []
        if not data.get("success") or not runs:
            raise DeploymentError(f"flwr ls found no run {run_id}: {res.stdout.strip()}")
        return dict(runs[0])

    # ----------------------------------------------------------------- its processes
    def _see(self, pid: int) -> None:
        """Remember ``pid`` as one of this deployment's processes: a child just started (it keeps its
        pid until it is waited for) or a process that carries the marker."""
        if pid not in self.seen_pids:
            self.seen_pids.add(pid)
            self._start_times[pid] = _start_time(pid)

    def _see_marked(self) -> list[int]:
        """The live processes carrying this deployment's marker, each remembered."""
        found = marked_pids(self.marker)
        for pid in found:
            self._see(pid)
        return found

    def _running(self, pid: int) -> bool:
        """True while the process seen as ``pid`` runs: not a later process that was given its pid."""
        return pid in self._start_times and _alive(pid) and _start_time(pid) == self._start_times[pid]

    def running(self) -> list[int]:
        """The pids of this deployment's processes that still run (none once :meth:`stop` returned)."""
        return sorted(pid for pid in self.seen_pids if self._running(pid))

    def stop(self, grace: float = 10.0) -> list[int]:
        """Stop every process this deployment started, by pid; returns the pids still alive (none)."""
        self._see_marked()
        order = ["flwr-run"] + [n for n in self.procs if n.startswith("supernode-")] + ["superlink"]
        for name in order:
            if (proc := self.procs.get(name)) is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in order:
            if (proc := self.procs.get(name)) is not None:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # Descendants (SuperExecs, serverapp/clientapp processes, a detached SuperLink): by pid too.
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            self._see_marked()
            left = self.running()
            if not left:
                break
            for pid in left:
                _signal(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(self._running(p) for p in left):
                time.sleep(0.1)
        for log in self._logs:
            log.close()
        self._logs.clear()
        self._see_marked()
        self.left_running = self.running()
        return self.left_running

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def deploy_local(
    config: Mapping[str, Any] | None = None,
    *,
    work_dir: str | Path | None = None,
    tls: TLSFiles | str | Path | None = None,
    node_keys: Iterable[str | Path] | None = None,
    timeout: float = 600.0,
    echo: IO[str] | None = None,
) -> DeployResult:
    """Run one federation in the deployment engine on loopback and stop everything afterwards.

    ``config`` uses the run config keys (``num-clients`` SuperNodes are started). The run folder
    must be new or empty. Raises :class:`DeploymentError` unless the run finished as completed."""
    cfg, run_dir = new_run_config(config)
    work = Path(work_dir) if work_dir else run_dir / "deployment"  # logs and the private FLWR_HOME
    with LocalDeployment(int(cfg["num-clients"]), work, tls=tls, node_keys=node_keys, echo=echo) as dep:
        result = dep.run(cfg, timeout=timeout)
    if dep.left_running:
        raise DeploymentError(f"processes still running after stop: {dep.left_running}")
    if not result.ok:
        raise DeploymentError(f"run {result.run_id} ended as {result.status!r}; logs in {dep.log_dir}")
    if not (run_dir / "results.json").is_file():
        raise DeploymentError(f"run {result.run_id} completed without {run_dir / 'results.json'}")
    return result
