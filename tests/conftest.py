import logging
import os
import warnings
from pathlib import Path

import pytest
import torch

from fedsim import flower_env

ROOT = Path(__file__).resolve().parents[1]
# The tests never reach the network for the paper's victims (subprocesses inherit this); the fetch's
# own tests serve the file from a loopback server and turn it back on.
os.environ["DLA_OFFLINE"] = "1"


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


@pytest.fixture(autouse=True)
def _quiet_and_deterministic():
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", module="lightning")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
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
