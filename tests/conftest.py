import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedsim import flower_env

ROOT = Path(__file__).resolve().parents[1]
# The tests never reach the network for the paper's victims (subprocesses inherit this); the fetch's
# own tests serve the file from a loopback server and turn it back on.
os.environ["DLA_OFFLINE"] = "1"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


TORCH_THREADS = torch.get_num_threads()  # in the processes that run tests, set by _share_the_cores


def _share_the_cores(workers: int) -> None:
    """pytest-xdist (pyproject's addopts) runs the tests in several worker processes at once. Each
    worker gets its share of the cores: its own torch threads, the subprocesses it starts (they
    inherit the environment: the CLIs, the notebook kernels, Flower's processes) and the local Ray
    of each simulation it runs (FEDSIM_RAY_CPUS: how many clients run at once). Otherwise two
    workers run 2 x 2 intra-op threads and 2 x 2 Ray actors on 2 cores, and a thread that waits for
    its descheduled sibling burns CPU: measured on the 2-core machine while others used it, 200
    iterations of IG on 8 MNIST victims took 20 s of CPU with 2 threads and 1.9 s with 1.
    A value the user set is kept."""
    global TORCH_THREADS
    share = str(max(1, _cores() // workers))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "FEDSIM_RAY_CPUS"):
        os.environ.setdefault(name, share)
    try:
        TORCH_THREADS = max(1, int(os.environ["OMP_NUM_THREADS"]))
    except ValueError:  # e.g. OpenMP's nested form "2,1": torch has read it itself
        TORCH_THREADS = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)


def paper_victims_or_skip(dataset: str) -> Path:
    """The paper's victims of ``dataset`` from the project's data folder (where `make victims` puts
    them, or CI copies them), verified; the test is skipped with the reason when they are absent."""
    from fedsim.data import paper_victims, paper_victims_path
    from fedsim.data.datasets import VictimFileError

    try:
        return paper_victims(dataset, ROOT / "data", allow_download=False)
    except VictimFileError:
        pytest.skip(
            f"the paper's {dataset} victims are not in {paper_victims_path(dataset, ROOT / 'data')} "
            f"(run `make victims`)"
        )


def pytest_configure(config: pytest.Config) -> None:
    flower_env.apply()  # Flower's environment before any test module imports flwr (importing fedsim does it too)
    # Before the test modules are imported (some copy os.environ for their subprocesses). Not in
    # pytest-xdist's controller, which runs no test: its workers, which inherit its environment, do it.
    if hasattr(config, "workerinput"):
        _share_the_cores(int(config.workerinput["workercount"]))
    elif not getattr(config.option, "numprocesses", None):
        _share_the_cores(1)


# ``-n auto``'s workers per core (pytest_xdist_auto_num_workers below): 3 workers on 2 cores. Many tests
# mostly wait (on Flower's SuperLink, SuperNodes and app processes, Ray, the CLIs' subprocesses, polls),
# so a third worker fills the cores while two wait. Measured back to back on the same tree, 2 cores
# shared with others' jobs: -n 2 962 s (load average 5.0 at the start, 9.1 at the end), -n 3 864 s
# (9.1, then 8.2), both with 1 torch thread per worker. A fourth worker did not help: the cores are
# busy to the end at -n 4 (vmstat), and a fresh clone's pytest took 755 s at -n 4 against 702 s at
# -n 3 earlier that day (quiet machine both times; not back to back). Later, on the same fresh clone
# back to back: -n 3 ran the suite in 872 s; -n 4 had finished 27 % of it after 15 min (one failure), stopped.
WORKERS_PER_CORE = 1.5


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: WORKERS_PER_CORE workers per core, at least 2 (much of the suite waits on processes
    starting: Ray, Flower's SuperLink and SuperNodes, the CLIs, so two overlap even on one core) and at
    most 4 (each worker imports torch, Flower and Ray for itself, and runs its own Ray per simulation)."""
    return min(4, max(2, round(_cores() * WORKERS_PER_CORE)))


# Scheduling on pytest-xdist's workers (pytest_xdist_make_scheduler below): each group runs on one
# worker. A test is in its module's group, so that a module-scoped fixture (a federation, a run
# folder) is made once, as with --dist loadfile, except the slow tests below: each is a group of its
# own, so that they spread over the workers (a test listed alone must not share a module fixture with
# the rest of its module: that fixture would be made on both workers). Groups start in this order,
# slowest first, then the modules in collection order, so that what starts last is short. Seconds in
# the comments: measured with 2 workers on the 2-core machine while others used it (load average
# about 6, which inflates the federations most); *: in a fresh clone's `make test` at d12988c (3 workers,
# quiet machine). A test missing here only starts later than it could.
SLOW_FIRST = [
    "tests/test_deployment.py",  # about 135: one module fixture, three runs on one deployment, feeds them all
    "tests/test_notebook.py::test_privacy_utility_notebook_executes_on_a_tiny_frontier",  # 184: 4 federations
    "tests/test_commands.py::test_fedsim_deploy_local",  # about 230: make-certs, deploy-local with TLS
    "tests/test_faults.py",  # 152*: one 100-client simulation for both of its tests
    "tests/test_experiments.py::test_cells_on_ray_equal_the_sequential_run",  # 106
    "tests/test_commands.py",  # about 260: one `fedsim simulate` feeds four of them
    "tests/test_experiments.py",  # about 120 more
    "tests/test_fedprox.py",  # 75
    "tests/test_commands.py::test_fedsim_sweep",  # 74
    "tests/test_notebook.py::test_walkthrough_notebook_executes",  # 64
    "tests/test_simulation.py",  # about 45: one simulation feeds two tests
    "tests/test_paper_victims.py",  # 66
    "tests/test_defenses.py",  # about 25
    "tests/test_live.py",  # 55
    "tests/test_reliability.py",  # about 60
    "tests/test_dp_sgd.py",  # about 55
    "tests/test_own_models.py",  # about 45
    "tests/test_stochastic_depth.py",
    "tests/test_cli.py",
    "tests/test_closed_form.py",
    "tests/test_hybrid_terms.py",
    "tests/test_engine.py",
    "tests/test_compose.py",
    "tests/test_replay_batched.py",
]


def _group(nodeid: str) -> tuple[int, str]:
    """(rank, group) of a test: its own entry of SLOW_FIRST, else its module's entry, else its module."""
    test, module = nodeid.split("[", 1)[0], nodeid.split("::", 1)[0]
    for key in (test, module):
        if key in SLOW_FIRST:
            return SLOW_FIRST.index(key), key
    return len(SLOW_FIRST), module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests in the order their groups start (pyproject: --no-loadscope-reorder keeps it)."""
    order = sorted(range(len(items)), key=lambda i: (_group(items[i].nodeid)[0], i))
    items[:] = [items[i] for i in order]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduling with the groups of :func:`_group` as the scopes (its own
    --dist loadgroup reads marks that pytest 9.2's node ids no longer carry to the scheduler)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)[1]

    return GroupScheduling(config, log)


@pytest.fixture(autouse=True)
def _quiet_and_deterministic():
    torch.manual_seed(0)
    if torch.get_num_threads() != TORCH_THREADS:  # a test before this one changed it
        torch.set_num_threads(TORCH_THREADS)
    warnings.filterwarnings("ignore", module="lightning")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # the closed forms' recent solves (attacker.closed_form.run): tests monkeypatch the solvers' settings,
    # so no test reuses another's answer
    from attacker.closed_form import run as closed_form_run

    closed_form_run._RECENT.clear()
    yield


@pytest.fixture
def mnist_like():
    """A few real-looking MNIST-shaped victims without touching disk: strokes on black, normalized."""
    g = torch.Generator().manual_seed(1)
    imgs = torch.zeros(4, 1, 28, 28)
    for i in range(4):
        r = torch.randint(6, 20, (2,), generator=g)
        imgs[i, 0, r[0] : r[0] + 8, 8:20] = 1.0
        imgs[i, 0, 4:24, r[1] : r[1] + 3] = 1.0
    mean, std = 0.13066373765468597, 0.30810782313346863
    return (imgs - mean) / std, torch.tensor([1, 7, 3, 9])
