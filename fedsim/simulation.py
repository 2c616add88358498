"""Run the federation in Flower's simulation engine (Ray backend) from Python."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsim import flower_env
from fedsim.run_config import resolve_config

# The CPUs the simulation's local Ray offers (and so how many clients run at once): the machine's,
# unless this environment variable names fewer, e.g. for a test runner that runs several
# simulations side by side on one machine (tests/conftest.py under pytest-xdist).
RAY_CPUS_ENV = "FEDSIM_RAY_CPUS"


def ray_num_cpus() -> int:
    """The CPUs of the simulation's local Ray: ``FEDSIM_RAY_CPUS`` where set, else the machine's."""
    value = os.environ.get(RAY_CPUS_ENV, "").strip()
    if not value:
        return os.cpu_count() or 1
    try:
        cpus = int(value)
    except ValueError:
        cpus = 0
    if cpus < 1:
        raise ValueError(f"{RAY_CPUS_ENV} must be a whole number of CPUs, at least 1; got {value!r}")
    return cpus


def new_run_config(config: Mapping[str, Any] | None) -> tuple[dict[str, Any], Path]:
    """The resolved run config of a new run and its run folder, which must be new or empty (results
    of different runs never mix). Run and data folders become absolute paths: the server and the
    clients may run in other processes (Ray workers, deployment processes) and other folders."""
    cfg = resolve_config(config)
    from fedsim.task import check_defense

    check_defense(cfg)  # a defense the model cannot take: refused before anything is written
    run_dir = Path(cfg["run-dir"]).expanduser().resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise FileExistsError(f"run folder {run_dir} is not empty; choose a new --run-dir")
    cfg["run-dir"] = str(run_dir)
    cfg["data-root"] = str(Path(cfg["data-root"]).expanduser().resolve())
    return cfg, run_dir


def run_simulation_job(
    config: Mapping[str, Any] | None = None,
    *,
    cpus_per_client: float = 1.0,
    verbose: bool = False,
    quiet: bool = False,
) -> Path:
    """Run one simulated federation and return its run folder (see ``fedsim.server_app``).

    ``config`` uses the run config keys (``fedsim.run_config.SCHEMA``); snake_case names and a
    ``model_options`` dict work too (``fedsim.run_config.to_run_config``).
    The run folder must be new or empty, so results of different runs never mix.

    Flower logs INFO and above (``verbose``: DEBUG too). ``quiet``, for a caller that reports the
    rounds itself (the main job), leaves Flower's warnings and errors only, unless ``verbose`` or the
    ``FLWR_LOG_LEVEL`` environment variable asks for Flower's log."""
    cfg, run_dir = new_run_config(config)

    from flwr.simulation import run_simulation

    from fedsim.client_app import app as client_app
    from fedsim.server_app import make_server_app

    backend_config = {
        # Flower's default is 2 CPUs per virtual client, which leaves one client at a time on 2 cores.
        "client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
        "init_args": {"num_cpus": ray_num_cpus(), "include_dashboard": False},
    }
    # flwr 1.42's run_simulation warns on every call that it is deprecated in favour of `flwr run`:
    # Flower's legacy Python API warning about itself, nothing a user of this project can act on.
    # The project keeps run_simulation: `flwr run` submits the app to a SuperLink (read from the
    # user's Flower config) that runs it in other processes, with the run config as string overrides,
    # which fedsim.deployment does for real deployments; this one in-process call is what `fedsim
    # simulate`, the main job and the tests build on. So that one notice is dropped, during the call
    # only; Flower's other warnings and errors go through.
    flwr_logger = logging.getLogger("flwr")
    dropped = [flower_env.RUN_SIMULATION_DEPRECATED]
    level = flwr_logger.level
    if quiet and not verbose and not os.environ.get("FLWR_LOG_LEVEL"):
        # The caller prints the accuracy per round; Flower's INFO lines (the strategy's config, each
        # round's sampling, aggregation and metrics, the final summary) repeat it at length.
        flwr_logger.setLevel(logging.WARNING)
        dropped.append(flower_env.NO_FEDERATED_EVALUATION)
    notice_filter = flower_env.FlowerNoticeFilter(*dropped)
    flwr_logger.addFilter(notice_filter)
    try:
        run_simulation(
            server_app=make_server_app(cfg),
            client_app=client_app,
            num_supernodes=int(cfg["num-clients"]),
            backend_config=backend_config,  # type: ignore[arg-type]
            verbose_logging=verbose,
        )
    finally:
        flwr_logger.removeFilter(notice_filter)
        flwr_logger.setLevel(level)
    if not (run_dir / "results.json").is_file():
        raise RuntimeError(f"the simulation ended without results; see the log above (run folder {run_dir})")
    return run_dir


def load_results(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "results.json").read_text())
