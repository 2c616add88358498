"""Data for the leakage audit: dataset specs and normalization, loading (with real offline
fallbacks, Hugging Face datasets), client partitions (Flower Datasets), victim sampling and the
paper's victim files (fetched by URL, hash-pinned)."""

from .datasets import (
    DataUnavailableError,
    ImageTensorDataset,
    VictimFileError,
    dataset_labels,
    load_dataset,
    load_victim_file,
    synthetic_dataset,
)
from .normalization import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    MNIST_MEAN,
    MNIST_STD,
    DatasetSpec,
    box_bounds,
    canonical_name,
    denormalize,
    denormalize_stats,
    get_spec,
    normalize,
)
from .partition import (
    PARTITIONERS,
    PartitionError,
    label_table,
    make_partitioner,
    partition_dataset,
    partition_iid,
    sample_victims,
)
from .victim_sets import PAPER_VICTIMS, paper_victims, paper_victims_path

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MNIST_MEAN",
    "MNIST_STD",
    "PAPER_VICTIMS",
    "DataUnavailableError",
    "DatasetSpec",
    "ImageTensorDataset",
    "VictimFileError",
    "box_bounds",
    "canonical_name",
    "dataset_labels",
    "denormalize",
    "denormalize_stats",
    "get_spec",
    "load_dataset",
    "load_victim_file",
    "normalize",
    "paper_victims",
    "paper_victims_path",
    "PARTITIONERS",
    "PartitionError",
    "label_table",
    "make_partitioner",
    "partition_dataset",
    "partition_iid",
    "sample_victims",
    "synthetic_dataset",
]
