"""An experiment's cells as Ray tasks (``attacker experiment ... --ray [ADDRESS]``).

Each unfinished cell becomes one task with the resources the command line declares (CPUs and a GPU
fraction per task), on a local Ray started for the run or on an existing cluster. The task itself
writes the cell's run folder through :func:`attacker.pipeline.run_attack`, which writes atomically
and resumes from checkpoints, so a task that Ray retries after its worker died goes on where the
checkpoints left it, and a cell is "finished" only once its ``run.json`` says so. The driver only
collects outcomes and writes the report as cells finish.

Every path the tasks read or write (the output folder, data roots, victim files) must be visible at
the same place on every node: on one machine it is; on a cluster use a shared filesystem.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedsim.net import call_with_deadline

from ..config import RunConfig
from .spec import Cell, ExperimentError

HEALTH_CHECK_S = 5.0  # while waiting on tasks, how often the driver makes sure the cluster is still there


class ClusterError(ExperimentError):
    """The Ray cluster cannot take this run: not reachable, or no node offers what a task asks for."""


class ClusterLostError(RuntimeError):
    """The Ray cluster went away while cells were running (the finished ones are kept)."""


@dataclass
class RayOptions:
    """Where and how the cells run on Ray."""

    address: str | None = None  # None: a local Ray started for the run; else "ray://host:10001", "host:6379", "auto"
    cpus_per_task: float = 1.0
    gpus_per_task: float = 0.0  # fractions share a GPU: 0.25 runs four cells on one GPU
    max_retries: int = 2  # reruns of a cell whose worker died (each resumes from its checkpoints)
    local_cpus: int | None = None  # CPUs of the local Ray (default: all of this machine's)
    connect_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.address in ("", "local"):
            self.address = None

    def check(self) -> None:
        """Refuse values Ray would reject or that make no sense (ConfigError, exit 2)."""
        if not self.cpus_per_task > 0:
            raise ClusterError(f"--ray-cpus-per-task must be positive, got {self.cpus_per_task:g}")
        if self.gpus_per_task < 0 or (self.gpus_per_task > 1 and self.gpus_per_task != int(self.gpus_per_task)):
            raise ClusterError(
                f"--ray-gpus-per-task must be a fraction up to 1 or a whole number, got {self.gpus_per_task:g}"
            )
        if self.max_retries < 0:
            raise ClusterError(f"--ray-max-retries must be 0 or more, got {self.max_retries}")
        if not self.connect_timeout_s > 0:
            raise ClusterError(f"--ray-timeout must be positive, got {self.connect_timeout_s:g}")
        if self.local_cpus is not None:
            if self.address is not None:
                raise ClusterError(
                    "--ray-local-cpus sizes a local Ray (--ray without an address), not an existing cluster"
                )
            if self.local_cpus < 1:
                raise ClusterError(f"--ray-local-cpus must be at least 1, got {self.local_cpus}")

    @property
    def request(self) -> str:
        return (
            f"{self.cpus_per_task:g} CPU(s) and {self.gpus_per_task:g} GPU(s) per task, up to "
            f"{_retries(self.max_retries)} of a cell whose worker dies"
        )

    @property
    def where(self) -> str:
        return "a local Ray" if self.address is None else f"the Ray cluster at {self.address}"


# --- connecting -------------------------------------------------------------------------------


def _host_port(address: str) -> tuple[str, int] | None:
    """The (host, port) a "host:port" or "ray://host:port" address names; None for "auto"."""
    rest = address[len("ray://") :] if address.startswith("ray://") else address
    if rest in ("auto", "local") and not address.startswith("ray://"):
        return None
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ClusterError(
            f"--ray {address}: expected ray://HOST:PORT (Ray Client, port 10001), HOST:PORT "
            f"(the head's GCS port, 6379) or auto"
        )
    return host, int(port)


def probe_tcp(host: str, port: int, timeout_s: float) -> None:
    """Open a TCP connection to host:port within ``timeout_s`` seconds (name lookup included, in a
    daemon thread joined with a deadline), else raise ClusterError."""
    try:
        call_with_deadline(
            lambda: socket.create_connection((host, port), timeout=timeout_s).close(), timeout_s, "ray-address-probe"
        )
    except TimeoutError:
        raise ClusterError(f"the Ray cluster at {host}:{port} did not answer within {timeout_s:g} s") from None
    except OSError as exc:
        reason = exc.strerror or exc
        raise ClusterError(
            f"cannot reach the Ray cluster at {host}:{port}: {reason} (is `ray start --head` running "
            f"there, and is the port right: 6379 for HOST:PORT, 10001 for ray://?)"
        ) from None


def check_address(opts: RayOptions) -> None:
    """Fail fast on an address nothing listens at, before any work (federated captures) starts."""
    if opts.address is None:
        return
    hp = _host_port(opts.address)
    if hp is not None:
        probe_tcp(*hp, timeout_s=min(opts.connect_timeout_s, 10.0))


def _init_kwargs(opts: RayOptions) -> dict[str, Any]:
    import logging

    # Ray's own notes (which thread set which signal handler) are not the user's business: errors only.
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    if opts.address is None:
        # "local": a new Ray for this run, never one RAY_ADDRESS or `ray start` left on this machine
        kwargs.update(address="local", num_cpus=opts.local_cpus, include_dashboard=False)
    else:
        kwargs["address"] = opts.address
    return kwargs


def connect(opts: RayOptions) -> None:
    """ray.init for the run: a local Ray, or an existing cluster within ``connect_timeout_s``."""
    import ray

    check_address(opts)
    kwargs = _init_kwargs(opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Ray's note on CUDA_VISIBLE_DEVICES for num_gpus=0
        if opts.address is None:
            # In the main thread: Ray ties the processes it starts to the life of the thread that started them.
            try:
                ray.init(**kwargs)
            except Exception as err:  # noqa: BLE001
                raise ClusterError(f"could not start a local Ray: {_one_line(err)}") from None
            return
        # An existing cluster: ray.init can wait for minutes on a port that is not Ray's; bound it.
        try:
            call_with_deadline(lambda: ray.init(**kwargs), opts.connect_timeout_s, "ray-connect")
        except TimeoutError:
            raise ClusterError(
                f"could not connect to {opts.where} within {opts.connect_timeout_s:g} s (is it a Ray "
                f"head? HOST:PORT is the GCS port, 6379 by default, ray://HOST:10001 the Ray Client "
                f"port; a busy head may need a longer --ray-timeout)"
            ) from None
        except BaseException as err:  # noqa: BLE001 - whatever ray.init raised, in one line
            raise ClusterError(f"could not connect to {opts.where}: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0].strip() if text else ''}".rstrip(": ")


def _retries(n: int) -> str:
    return f"{n} {'retry' if n == 1 else 'retries'}"


def _fmt(value: float) -> str:
    return f"{value:g}"


def check_resources(opts: RayOptions) -> str:
    """Refuse a request no alive node can ever meet (Ray would wait for it forever). Returns a
    one-line description of the cluster."""
    import ray

    nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    cpus, gpus = float(total.get("CPU", 0)), float(total.get("GPU", 0))
    described = f"{len(nodes)} node(s), {_fmt(cpus)} CPU(s), {_fmt(gpus)} GPU(s)"
    fits = [
        n
        for n in nodes
        if float(n.get("CPU", 0)) >= opts.cpus_per_task and float(n.get("GPU", 0)) >= opts.gpus_per_task
    ]
    if not fits:
        best_cpu = max((float(n.get("CPU", 0)) for n in nodes), default=0.0)
        best_gpu = max((float(n.get("GPU", 0)) for n in nodes), default=0.0)
        if opts.gpus_per_task > best_gpu:
            need = (
                f"--ray-gpus-per-task {_fmt(opts.gpus_per_task)}, but no node has that many GPUs "
                f"(largest: {_fmt(best_gpu)})"
            )
        elif opts.cpus_per_task > best_cpu:
            need = (
                f"--ray-cpus-per-task {_fmt(opts.cpus_per_task)}, but no node has that many CPUs "
                f"(largest: {_fmt(best_cpu)})"
            )
        else:
            need = (
                f"{_fmt(opts.cpus_per_task)} CPU(s) and {_fmt(opts.gpus_per_task)} GPU(s) per task, "
                f"but no single node has both"
            )
        raise ClusterError(f"{opts.where} ({described}) cannot run a cell: {need}")
    return described


# --- the task ---------------------------------------------------------------------------------


def run_cell(cfg: RunConfig, run_dir: str, cwd: str, threads: int) -> dict[str, Any]:
    """One cell in a Ray worker: the same ``run_attack`` as the sequential runner, in the driver's
    folder (relative paths in the config mean the same), with the CPUs and GPU Ray granted it."""
    import ray
    import torch

    from ..pipeline import run_attack

    try:
        os.chdir(cwd)
    except OSError:
        raise ExperimentError(
            f"the driver's folder {cwd} is not on this node ({ray.util.get_node_ip_address()}): "
            f"the nodes need the repository and the output folder at the same paths"
        ) from None
    torch.set_num_threads(threads)
    if cfg.device == "auto" and not ray.get_gpu_ids():
        cfg = replace(cfg, device="cpu")  # no GPU granted: never use one behind Ray's back
    started = time.time()
    run_attack(cfg, run_dir, progress=False, log=lambda m: None)
    return {"seconds": time.time() - started, "node": ray.util.get_node_ip_address()}


# The function the tasks run; tests put a stand-in here (it must be importable by the workers).
CELL_TASK: Callable[..., dict[str, Any]] = run_cell


def _retry_on() -> list[type[BaseException]]:
    """Exceptions worth a rerun: a GPU shared by fractions can run out of memory because of a neighbour.
    Everything else a cell raises (bad config, unreadable checkpoint) would fail again."""
    import torch

    return [torch.cuda.OutOfMemoryError]


def _check_alive(timeout_s: float) -> None:
    """Raise ClusterLostError when the cluster does not answer a node listing within ``timeout_s``."""
    import ray

    try:
        alive = call_with_deadline(lambda: sum(1 for n in ray.nodes() if n.get("Alive")), timeout_s, "ray-health")
    except TimeoutError:
        raise ClusterLostError(f"the Ray cluster stopped answering (no reply within {timeout_s:g} s)") from None
    except BaseException as exc:  # noqa: BLE001 - any failure of the listing means the cluster is gone
        raise ClusterLostError(f"the Ray cluster stopped answering: {_one_line(exc)}") from None
    if alive == 0:
        raise ClusterLostError("the Ray cluster has no alive node left")


def run_cells(
    todo: list[tuple[Cell, RunConfig, Path]],
    opts: RayOptions,
    log: Callable[[str], Any],
    on_finished: Callable[[], Any],
) -> dict[str, int]:
    """Run the cells as Ray tasks (after :func:`connect`); returns counts of ran and failed cells.
    A cell whose task raised or whose worker died past ``max_retries`` gets ``failed.txt``; the
    others go on. Raises ClusterLostError when the cluster goes away (finished cells stay)."""
    import ray
    from ray.exceptions import RayError, RayTaskError

    from fedsim.atomic import atomic_write

    threads = max(1, math.floor(opts.cpus_per_task))
    task = ray.remote(
        num_cpus=opts.cpus_per_task,
        num_gpus=opts.gpus_per_task,
        max_retries=opts.max_retries,
        retry_exceptions=_retry_on(),
    )(CELL_TASK)
    cwd = os.getcwd()
    pending: dict[Any, tuple[Cell, Path, str]] = {}
    for cell, cfg, run_dir in todo:
        (run_dir / "failed.txt").unlink(missing_ok=True)
        ref = task.options(name=f"cell {cell.key}").remote(cfg, str(run_dir.resolve()), cwd, threads)
        pending[ref] = (cell, run_dir, cell.label(cfg.attack_overrides.get("max_iterations")))
    counts = {"ran": 0, "failed": 0}
    total = len(pending)
    while pending:
        try:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=HEALTH_CHECK_S)
        except (RayError, ConnectionError) as err:
            raise ClusterLostError(f"lost {opts.where}: {_one_line(err)}") from None
        if not done:
            _check_alive(HEALTH_CHECK_S)
            continue
        for ref in done:
            cell, run_dir, label = pending.pop(ref)
            n = counts["ran"] + counts["failed"] + 1
            head = f"[{n}/{total}] {cell.key}"
            try:
                result = ray.get(ref)
            except RayTaskError as err:  # the cell raised: it would again, so it is failed
                cause = err.cause if isinstance(err.cause, BaseException) else err
                message = f"{type(cause).__name__}: {cause}".splitlines()[0]
            except (RayError, ConnectionError) as err:  # the worker (or its node) died, past the retries
                if isinstance(err, ConnectionError):
                    raise ClusterLostError(f"lost {opts.where}: {_one_line(err)}") from None
                message = f"{_one_line(err)} (after {_retries(opts.max_retries)})"
            else:
                counts["ran"] += 1
                log(f"[bold cyan]{head}[/bold cyan]: {label} finished in {result['seconds']:.0f} s on {result['node']}")
                on_finished()
                continue
            counts["failed"] += 1
            atomic_write(run_dir / "failed.txt", message + "\n")
            log(f"[red]{head} failed:[/red] {message}")
    return counts


def disconnect() -> None:
    """ray.shutdown, bounded: a cluster that went away must not keep the driver waiting."""
    import ray

    thread = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    thread.start()
    thread.join(HEALTH_CHECK_S)
