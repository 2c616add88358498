"""Hugging Face datasets as the federation's data: a Hub dataset by name, a local image folder, or the
built-in offline samples turned into a ``datasets.Dataset``.

The run config's ``data-source`` says where the images come from:

- ``builtin`` (default): torchvision's files under data-root, or the real offline samples
  (fedsim/data/datasets.py);
- ``hf:NAME`` or ``hf:NAME:CONFIG``: a dataset on the Hugging Face Hub (``datasets.load_dataset``), e.g.
  ``hf:ylecun/mnist``. Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, ``download`` off, or the Hub
  not answering within a few seconds) only the local Hugging Face cache is read, and a dataset not in
  it fails at once with a message saying how to get it;
- ``imagefolder:PATH``: a local folder read with Hugging Face's ``imagefolder`` builder
  (``PATH/train/<class>/*.png`` and ``PATH/test/<class>/*.png``, or a metadata.csv with ``file_name``
  and ``label`` columns per split folder).

Whatever the source, the images are brought to the run's dataset spec (``dataset``: mnist, cifar10,
imagenet): grey or RGB, resized and centre-cropped to its size, normalized with its statistics; the
model and the attacker see the same tensors as with the built-in data.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fedsim.net import url_reachable

from .errors import DataUnavailableError
from .normalization import DatasetSpec, denormalize, normalize

if TYPE_CHECKING:
    import datasets

BUILTIN = "builtin"
HUB_URL = "https://huggingface.co"
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class Located:
    """Where a data source's images are, as ``datasets.load_dataset`` takes it, and what to tell a user."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    offline: bool  # read the local cache only
    where: str  # the source in words
    hint: str  # how to get it, when it is missing
    hint_for_splits: bool = False  # the hint also says how to lay out a missing split


def _hf_parse(rest: str) -> tuple[str, str | None] | None:
    if not rest.strip(":"):
        return None
    name, _, config = rest.partition(":")
    return name, config or None


def _hf_locate(name: str, config: str | None, download: bool, timeout_s: float) -> Located:
    offline = env_offline() or not download or not url_reachable(HUB_URL, timeout_s)
    hint = (
        f"the machine is offline and it is not in the Hugging Face cache; get it where the network allows "
        f"with: python -c \"import datasets; datasets.load_dataset('{name}'"
        + (f", '{config}'" if config else "")
        + ')" (it lands in the cache, HF_HOME or HF_DATASETS_CACHE, which offline runs read), or save its '
        "images as an image folder and use data-source imagefolder:PATH"
        if offline
        else "check the name on the Hub (and HF_TOKEN for a gated dataset)"
    )
    where = f"Hugging Face dataset {name}" + (f" ({config})" if config else "")
    return Located((name, config) if config else (name,), {}, offline, where, hint)


def _folder_parse(rest: str) -> tuple[str, str | None] | None:
    return (rest, None) if rest else None


def _folder_locate(name: str, config: str | None, download: bool, timeout_s: float) -> Located:
    folder = Path(name).expanduser()
    hint = (
        f"put the images as {folder}/train/<class>/*.png and {folder}/test/<class>/*.png (or a "
        f"metadata.csv with file_name,label in each split folder)"
    )
    if not folder.is_dir():
        raise DataUnavailableError(f"image folder {folder} does not exist; {hint}")
    # a local folder: nothing to fetch
    return Located(("imagefolder",), {"data_dir": str(folder)}, True, f"image folder {folder}", hint, True)


@dataclass(frozen=True)
class DataSource:
    """One kind of ``data-source`` (``KIND:...``): its form in messages, how the rest of the text
    parses (None: malformed) and where its images are."""

    form: str
    parse: Callable[[str], tuple[str, str | None] | None]
    locate: Callable[[str, str | None, bool, float], Located]


# A new data source is one entry here.
DATA_SOURCES: dict[str, DataSource] = {
    "hf": DataSource("hf:NAME[:CONFIG]", _hf_parse, _hf_locate),
    "imagefolder": DataSource("imagefolder:PATH", _folder_parse, _folder_locate),
}
SOURCE_KINDS = (BUILTIN, *(source.form for source in DATA_SOURCES.values()))


def parse_source(text: str) -> tuple[str, str, str | None]:
    """``data-source`` as (kind, name or path, config): ("builtin", "", None), ("hf", NAME, CONFIG|None) or
    ("imagefolder", PATH, None); ValueError naming the accepted forms."""
    text = str(text).strip()
    if text in ("", BUILTIN):
        return BUILTIN, "", None
    kind, sep, rest = text.partition(":")
    parsed = DATA_SOURCES[kind].parse(rest) if sep and kind in DATA_SOURCES else None
    if parsed is None:
        raise ValueError(f"data-source must be one of {', '.join(SOURCE_KINDS)}; got {text!r}")
    return kind, parsed[0], parsed[1]


def env_offline() -> bool:
    """Whether the environment says we are offline (Hugging Face's own switches)."""
    return any(os.environ.get(v, "").upper() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


@contextlib.contextmanager
def offline_mode(offline: bool) -> Iterator[None]:
    """Hugging Face's offline switch for the duration of a load, whether or not the libraries were
    imported before (they read HF_HUB_OFFLINE once, at import)."""
    import datasets.config
    import huggingface_hub.constants

    saved = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    if offline:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No progress bars from ``datasets`` while building tables and loading (one line per problem is the contract)."""
    import datasets

    disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not disabled:
            datasets.enable_progress_bars()


def _image_column(ds: datasets.Dataset) -> str:
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            return name
    raise ValueError(f"has no image column (columns: {', '.join(ds.column_names)})")


def _label_column(ds: datasets.Dataset) -> str:
    import datasets

    if "label" in ds.column_names:
        return "label"
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.ClassLabel):
            return name
    raise ValueError(f"has no label column ('label' or a ClassLabel; columns: {', '.join(ds.column_names)})")


class HFImageDataset(Dataset):
    """A Hugging Face image dataset as the federation's torch Dataset: ``(normalized CxHxW, int label)``
    per item, decoded when read. ``targets`` holds the labels; :attr:`table` the columns a partitioner
    reads (the label as ``label``, and every other non-image column, e.g. an id for natural-id)."""

    def __init__(self, hf: datasets.Dataset, spec: DatasetSpec, source: str) -> None:
        self.hf = hf
        self.spec = spec
        self.source = source
        self.image_column = _image_column(hf)
        self.label_column = _label_column(hf)
        self.targets = torch.as_tensor(np.asarray(hf[self.label_column], dtype=np.int64))
        if len(self.targets) and (int(self.targets.min()) < 0 or int(self.targets.max()) >= spec.num_classes):
            raise ValueError(
                f"has labels {int(self.targets.min())}..{int(self.targets.max())}, but {spec.name} has "
                f"{spec.num_classes} classes"
            )

    def __len__(self) -> int:
        return len(self.hf)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.hf[int(index)]
        return image_tensor(row[self.image_column], self.spec), int(row[self.label_column])

    @property
    def table(self) -> datasets.Dataset:
        table = self.hf.remove_columns([self.image_column])
        return table if self.label_column == "label" else table.rename_column(self.label_column, "label")

    def __repr__(self) -> str:
        return f"HFImageDataset(n={len(self)}, spec={self.spec.name}, source={self.source!r})"


def image_tensor(image: Any, spec: DatasetSpec) -> torch.Tensor:
    """A PIL image (or an array) as the spec's normalized CxHxW float32 tensor."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    image = image.convert("L" if spec.channels == 1 else "RGB")
    if image.size != (spec.image_size, spec.image_size):
        from torchvision.transforms import functional as TF

        image = TF.center_crop(TF.resize(image, spec.image_size), spec.image_size)
    array = np.array(image, dtype=np.uint8)  # a writable copy: torch.from_numpy shares it
    x = torch.from_numpy(array[None] if array.ndim == 2 else array.transpose(2, 0, 1).copy()).float().div_(255.0)
    return normalize(x, spec).contiguous()


def _pick_split(splits: list[str], train: bool) -> str | None:
    for name in ("train",) if train else ("test", "validation", "valid", "val"):
        if name in splits:
            return name
    return None


def load_hf(
    source: str,
    spec: DatasetSpec,
    train: bool,
    download: bool = True,
    timeout_s: float = 5,
    cache_dir: str | Path | None = None,
) -> HFImageDataset:
    """The train or test split of a ``hf:`` or ``imagefolder:`` data source as an :class:`HFImageDataset`.
    Raises DataUnavailableError with one line saying what is missing and how to get it."""
    kind, name, config = parse_source(source)
    split_word = "train" if train else "test"
    found = DATA_SOURCES[kind].locate(name, config, download, timeout_s)
    args, kwargs, offline, where, hint = found.args, found.kwargs, found.offline, found.where, found.hint
    import datasets

    try:
        with quiet(), offline_mode(offline):
            splits = datasets.load_dataset(*args, cache_dir=str(cache_dir) if cache_dir else None, **kwargs)
    except DataUnavailableError:
        raise
    except Exception as err:  # the Hub's and the builders' errors: missing, offline, gated, bad files
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise DataUnavailableError(f"{where} is not available ({type(err).__name__}: {reason}); {hint}") from None
    split = _pick_split(list(splits), train)
    if split is None:
        raise DataUnavailableError(
            f"{where} has no {split_word} split (splits: {', '.join(splits)}); "
            + (hint if found.hint_for_splits else "choose a dataset with train and test splits")
        )
    try:
        return HFImageDataset(splits[split], spec, f"{where}, split {split}")
    except ValueError as err:
        raise DataUnavailableError(f"{where} (split {split}) {err}") from None


# ----------------------------------------------------------------------------------------------
# the built-in samples as a Hugging Face dataset
# ----------------------------------------------------------------------------------------------


def pixels_u8(dataset: Dataset, spec: DatasetSpec) -> tuple[np.ndarray, np.ndarray]:
    """Every image of a built-in dataset back as uint8 NxHxW(xC) pixels, and its labels (the exact
    inverse of the normalization the loader applied, rounded)."""
    items = [dataset[i] for i in range(len(dataset))]
    x = torch.stack([torch.as_tensor(img) for img, _ in items])
    u8 = (denormalize(x, spec, clamp=True) * 255.0).round().to(torch.uint8).numpy()
    u8 = u8[:, 0] if u8.shape[1] == 1 else u8.transpose(0, 2, 3, 1)
    return u8, np.asarray([int(label) for _, label in items], dtype=np.int64)


def to_hf_dataset(dataset: Dataset, spec: DatasetSpec) -> datasets.Dataset:
    """A built-in dataset (e.g. the offline samples) as a ``datasets.Dataset`` with columns ``image``
    (PIL images) and ``label``, in the same order."""
    import datasets

    images, labels = pixels_u8(dataset, spec)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    with quiet():
        return datasets.Dataset.from_dict({"image": list(images), "label": labels}, features=features)


def write_image_folder(dataset: Dataset, spec: DatasetSpec, folder: str | Path, split: str = "train") -> Path:
    """Write a built-in dataset as an ``imagefolder`` split: ``folder/split/NNNNNN.png`` and a
    metadata.csv (file_name,label) in the dataset's order, which ``imagefolder:folder`` reads back."""
    from PIL import Image

    out = Path(folder) / split
    out.mkdir(parents=True, exist_ok=True)
    images, labels = pixels_u8(dataset, spec)
    lines = ["file_name,label"]
    for i, (image, label) in enumerate(zip(images, labels)):
        name = f"{i:06d}.png"
        Image.fromarray(image).save(out / name)
        lines.append(f"{name},{int(label)}")
    (out / "metadata.csv").write_text("\n".join(lines) + "\n")
    return out
