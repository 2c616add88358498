"""Capture and oracle records, and their safe on-disk store.

A *capture* is what the honest-but-curious server saw from one client in one round: the model spec
and the global weights it sent, the hyperparameters it sent, and the client's reply (its recovered
gradient for a one-step SGD round, else its update), plus labels when the audit assumes they are
known. An *oracle* record is the client's ground truth (true images, labels, dropout masks). The two
are different types, stored in different folders, and a loader of one refuses the other.

Under secure aggregation the server holds no client's reply: an *aggregate* capture (the aggregate kinds of
``fedsim.capture_kinds``) holds the weighted mean of a round's replies as the server saw it, with
``Aggregate``: which clients it holds, their weights, their images' counts, the quantization and its
step. Its oracle is still each client's own record.

On disk, every record is a folder holding two files:
  ``record.json``            metadata: format, schema version, kind, spec, round, client, ... and
                             the SHA-256 of the tensor file;
  ``tensors.safetensors``    every tensor (never pickle: loading a capture can never run code).
The folder is written under a hidden temporary name and renamed into place, so a reader sees both
files or no record at all; a failed write removes its temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedsim.atomic import atomic_folder
from fedsim.capture_kinds import CAPTURE_KINDS
from fedsim.defenses import NO_DEFENSE
from fedsim.models import ModelSpec, ModelSpecError, build_model
from fedsim.run_config import LABEL_POLICIES

SCHEMA_VERSION = 1
CAPTURE_FORMAT = "fedsim.capture"
ORACLE_FORMAT = "fedsim.oracle"
META_FILE = "record.json"
TENSOR_FILE = "tensors.safetensors"
# Stored values of earlier versions, read as today's: "unknown" labels are the ones to recover.
_OLD_LABEL_POLICIES = {"unknown": "recovered"}


class CaptureError(ValueError):
    """A capture or oracle record that is missing, foreign, corrupt or inconsistent."""


@dataclass(frozen=True)
class Aggregate:
    """What an aggregate capture (secure aggregation) holds beyond a client's capture: the clients in the
    mean, in the order of the capture's images and labels, with what each disclosed in clear."""

    clients: list[int]  # partition ids
    node_ids: list[int]
    num_examples: list[int]  # each client's weight in the mean (num_examples travel in clear)
    images: list[int]  # each client's images in the capture: its victim batch B, or its round's images
    quantization: dict[str, Any]  # SecAgg+'s max_weight, clipping_range, quantization_range, modulus_range
    step: float  # the mean's quantization step in the capture's units; its error is below len(clients) steps
    rms: float  # the size of what the server captured: the RMS of the mean's entries (the capture's units)

    @property
    def error_bound(self) -> float:
        """The largest error of an entry of the mean: one quantization step per client (stochastic rounding)."""
        return len(self.clients) * self.step

    def to_dict(self) -> dict[str, Any]:
        return {
            "clients": list(self.clients),
            "node_ids": list(self.node_ids),
            "num_examples": list(self.num_examples),
            "images": list(self.images),
            "quantization": dict(self.quantization),
            "step": float(self.step),
            "rms": float(self.rms),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Aggregate:
        agg = cls(
            clients=[int(v) for v in data["clients"]],
            node_ids=[int(v) for v in data["node_ids"]],
            num_examples=[int(v) for v in data["num_examples"]],
            images=[int(v) for v in data["images"]],
            quantization=dict(data["quantization"]),
            step=float(data["step"]),
            rms=float(data["rms"]),
        )
        if not (len(agg.clients) == len(agg.node_ids) == len(agg.num_examples) == len(agg.images) >= 1):
            raise ValueError("an aggregate needs one client id, node id, weight and image count per client")
        return agg


@dataclass
class Capture:
    """What the server saw from one client in one round (no ground truth in here).

    ``gradient``: list of tensors in ``model.parameters()`` order (kind "gradient");
    ``update``: state-dict-keyed ``global - local`` (kind "update"; for one SGD step it is lr * gradient).
    """

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    kind: str
    round: int
    client: int  # partition id (stable across rounds); node_id is Flower's id for the node
    node_id: int
    batch_size: int
    num_examples: int
    lr: float
    label_policy: str  # known: the labels are stored; recovered: the attacker must recover them
    param_names: list[str]
    gradient: list[torch.Tensor] | None = None
    update: dict[str, torch.Tensor] | None = None
    labels: torch.Tensor | None = None
    # An update with known labels: the labels in the order the client's steps used the images (flattened),
    # what an attacker needs when it does not know the batch order. Absent in records written before.
    step_labels: torch.Tensor | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    local_steps: int = 1  # K, the local steps behind an update (as the client reported it)
    # FedProx's mu: each local step's loss held (mu/2)·||w − w_global||² (0: none; records before had none).
    proximal_mu: float = 0.0
    # The defense active in the run (fedsim.defenses) and, in words, what the capture therefore holds
    # (e.g. under central DP: the clipped update without the noise, which is added after aggregation).
    defense: str = NO_DEFENSE
    defense_captured: str = ""
    # An aggregate kind (secure aggregation): the clients in the mean and its quantization; None otherwise.
    aggregate: Aggregate | None = None
    path: Path | None = None

    @property
    def label_count(self) -> int:
        """Labels a capture holds: one per image of the step (gradient) or of the local round (update)."""
        return int(getattr(self, CAPTURE_KINDS[self.kind].images_field))

    @property
    def p(self) -> float:
        return float(self.spec.p)

    def build_model(self) -> torch.nn.Module:
        """The captured model, with the global weights the server sent."""
        model = build_model(self.spec)
        model.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in self.weights.items()})
        return model


@dataclass
class OracleRecord:
    """Ground truth of one client's captured round: for scoring and WIIG only, never for IG/DIA."""

    images: torch.Tensor
    labels: torch.Tensor
    masks: list[torch.Tensor]  # every local step's masks, step-major, one per dropout call (call order) within
    round: int
    client: int
    node_id: int
    path: Path | None = None
    batches: list[list[int]] | None = None  # which images each local step used (None: one step on all)


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------


def record_name(round_: int, client: int, node_id: int) -> str:
    return f"r{round_:04d}_c{client:03d}_n{node_id}"


def aggregate_record_name(round_: int) -> str:
    """The one aggregate capture of a round (secure aggregation)."""
    return f"r{round_:04d}_secagg"


def _check_aggregate(kind: str, aggregate: Aggregate | None, where: str) -> None:
    is_aggregate = bool(CAPTURE_KINDS[kind].aggregate_of)
    if is_aggregate != (aggregate is not None):
        raise CaptureError(
            f"{where}: kind {kind!r} {'needs' if is_aggregate else 'takes no'} aggregate record (clients, weights)"
        )


def _write_record(directory: Path, name: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``name`` atomically under ``directory``: both files appear together or not at all."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    if final.exists():
        raise CaptureError(f"record {final} already exists; refusing to overwrite it")
    try:
        with atomic_folder(final) as tmp:  # files fsynced before the rename makes the record visible
            blob = st_save(
                {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                metadata={"format": meta["format"], "schema_version": str(SCHEMA_VERSION)},
            )
            (tmp / TENSOR_FILE).write_bytes(blob)
            meta = dict(meta, tensors_sha256=hashlib.sha256(blob).hexdigest())
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    except OSError as exc:  # a full disk or lost permission: say so (nothing is left behind)
        raise CaptureError(f"could not write record {final}: {exc.strerror or exc}") from None
    return final


def save_capture(directory: str | Path, capture: Capture) -> Path:
    """Store ``capture`` as a new record folder under ``directory``; returns its path."""
    if capture.kind not in CAPTURE_KINDS:
        raise CaptureError(f"capture kind must be one of {tuple(CAPTURE_KINDS)}, got {capture.kind!r}")
    if capture.label_policy not in LABEL_POLICIES:
        raise CaptureError(f"label policy must be one of {LABEL_POLICIES}, got {capture.label_policy!r}")
    _check_aggregate(capture.kind, capture.aggregate, "capture")
    tensors: dict[str, torch.Tensor] = {f"weights/{k}": v for k, v in capture.weights.items()}
    if CAPTURE_KINDS[capture.kind].one_step_gradient:
        if capture.gradient is None or len(capture.gradient) != len(capture.param_names):
            raise CaptureError("a gradient capture needs one gradient tensor per parameter name")
        tensors.update({f"gradient/{n}": g for n, g in zip(capture.param_names, capture.gradient)})
    else:
        if capture.update is None:
            raise CaptureError("an update capture needs its update")
        tensors.update({f"update/{k}": v for k, v in capture.update.items()})
    if capture.label_policy == "known":
        if capture.labels is None:
            raise CaptureError("label policy 'known' needs the labels")
        tensors["labels"] = capture.labels.to(torch.int64)
    if capture.step_labels is not None:
        tensors["step_labels"] = capture.step_labels.to(torch.int64)
    meta = {
        "format": CAPTURE_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "kind": capture.kind,
        "spec": capture.spec.to_dict(),
        "p": capture.p,
        "round": int(capture.round),
        "client": int(capture.client),
        "node_id": int(capture.node_id),
        "batch_size": int(capture.batch_size),
        "num_examples": int(capture.num_examples),
        "lr": float(capture.lr),
        "label_policy": capture.label_policy,
        "param_names": list(capture.param_names),
        "weight_names": list(capture.weights),
        "hyperparameters": _jsonable(capture.hyperparameters),
        "local_steps": int(capture.local_steps),
        "proximal_mu": float(capture.proximal_mu),
        "defense": capture.defense,
        "defense_captured": capture.defense_captured,
    }
    if capture.aggregate is not None:
        meta["aggregate"] = capture.aggregate.to_dict()
        name = aggregate_record_name(capture.round)
    else:
        name = record_name(capture.round, capture.client, capture.node_id)
    return _write_record(Path(directory), name, meta, tensors)


def save_oracle(directory: str | Path, oracle: OracleRecord) -> Path:
    """Store ``oracle`` as a new record folder under ``directory`` (keep it apart from captures)."""
    tensors = {"images": oracle.images, "labels": oracle.labels.to(torch.int64)}
    tensors.update({f"masks/{i}": m for i, m in enumerate(oracle.masks)})
    meta = {
        "format": ORACLE_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "round": int(oracle.round),
        "client": int(oracle.client),
        "node_id": int(oracle.node_id),
        "num_masks": len(oracle.masks),
        "batches": oracle.batches,
    }
    return _write_record(Path(directory), record_name(oracle.round, oracle.client, oracle.node_id), meta, tensors)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------


def _read_record(path: str | Path, expected_format: str) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    path = Path(path)
    if path.is_file() and path.name in (META_FILE, TENSOR_FILE):
        path = path.parent  # accept either file of a record as well as its folder
    what = "capture" if expected_format == CAPTURE_FORMAT else "oracle record"
    if not path.is_dir():
        raise CaptureError(f"{what} {path} does not exist or is not a record folder")
    meta_path, tensor_path = path / META_FILE, path / TENSOR_FILE
    for file in (meta_path, tensor_path):
        if not file.is_file():
            raise CaptureError(f"{what} {path} is incomplete: {file.name} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CaptureError(f"{what} {path}: {META_FILE} is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(meta, dict) or "format" not in meta:
        raise CaptureError(f"{what} {path}: {META_FILE} is not a fedsim record")
    if meta["format"] != expected_format:
        raise CaptureError(f"{path} is a {meta['format']!r} record, expected {expected_format!r}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise CaptureError(
            f"{what} {path} has schema version {meta.get('schema_version')!r}; this reader knows {SCHEMA_VERSION}"
        )
    blob = tensor_path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta.get("tensors_sha256"):
        raise CaptureError(f"{what} {path}: {TENSOR_FILE} is corrupt or truncated (checksum mismatch)")
    try:
        tensors = st_load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CaptureError(f"{what} {path}: {TENSOR_FILE} is not a valid safetensors file ({exc})") from None
    return path, meta, tensors


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def load_capture(path: str | Path, check_model: bool = True) -> Capture:
    """Read one capture (its folder, or either of its files). Raises :class:`CaptureError` with a
    one-line reason when the record is foreign, corrupt, or does not match its model spec.

    ``check_model`` builds the model from the spec and checks every tensor name and shape."""
    path, meta, tensors = _read_record(path, CAPTURE_FORMAT)
    try:
        spec = ModelSpec.from_dict(meta["spec"])
        kind = meta["kind"]
        param_names = list(meta["param_names"])
        weights = _prefixed(tensors, "weights/")
        # The one check of a kind's name: what the record says it holds (every other site asks the entry).
        if not isinstance(kind, str) or kind not in CAPTURE_KINDS:
            raise CaptureError(f"capture {path}: unknown kind {kind!r}")
        holds = CAPTURE_KINDS[kind]
        if set(weights) != set(meta["weight_names"]):
            raise CaptureError(f"capture {path}: weight tensors do not match the names in {META_FILE}")
        weights = {k: weights[k] for k in meta["weight_names"]}  # state-dict order
        gradient = update = None
        if holds.one_step_gradient:
            found = _prefixed(tensors, "gradient/")
            if set(found) != set(param_names):
                raise CaptureError(f"capture {path}: gradient tensors do not match the parameter names")
            gradient = [found[n] for n in param_names]
            if not all(torch.isfinite(g).all() for g in gradient):
                raise CaptureError(f"capture {path}: the gradient holds NaN or infinite values")
        else:
            update = _prefixed(tensors, "update/")
            if set(update) != set(weights):
                raise CaptureError(f"capture {path}: update tensors do not match the weight names")
        labels = tensors.get("labels")
        label_policy = _OLD_LABEL_POLICIES.get(meta["label_policy"], meta["label_policy"])
        if label_policy not in LABEL_POLICIES:
            raise CaptureError(f"capture {path}: unknown label policy {label_policy!r}")
        if label_policy == "known" and labels is None:
            raise CaptureError(f"capture {path}: label policy 'known' but no labels stored")
        aggregate = Aggregate.from_dict(meta["aggregate"]) if "aggregate" in meta else None
        _check_aggregate(kind, aggregate, f"capture {path}")
        expected = int(meta[holds.images_field])
        if labels is not None and labels.shape != (expected,):
            raise CaptureError(f"capture {path}: {labels.shape[0]} labels for {expected} images")
        capture = Capture(
            spec=spec,
            weights=weights,
            kind=kind,
            round=int(meta["round"]),
            client=int(meta["client"]),
            node_id=int(meta["node_id"]),
            batch_size=int(meta["batch_size"]),
            num_examples=int(meta["num_examples"]),
            lr=float(meta["lr"]),
            label_policy=label_policy,
            param_names=param_names,
            gradient=gradient,
            update=update,
            labels=labels,
            step_labels=tensors.get("step_labels"),  # optional: records written before had none
            hyperparameters=dict(meta.get("hyperparameters", {})),
            local_steps=int(meta.get("local_steps", 1)),
            proximal_mu=_proximal_mu(meta, path),
            defense=str(meta.get("defense", NO_DEFENSE)),  # records written before defenses existed had none
            defense_captured=str(meta.get("defense_captured", "")),
            aggregate=aggregate,
            path=path,
        )
    except KeyError as exc:
        raise CaptureError(f"capture {path}: {META_FILE} lacks the field {exc.args[0]!r}") from None
    except (ModelSpecError, TypeError) as exc:
        raise CaptureError(f"capture {path}: bad model spec ({exc})") from None
    except ValueError as exc:
        if isinstance(exc, CaptureError):
            raise
        raise CaptureError(f"capture {path}: bad aggregate record ({exc})") from None
    if check_model:
        _check_against_model(capture)
    return capture


def _proximal_mu(meta: dict[str, Any], path: Path) -> float:
    """The record's FedProx mu: 0 for records written before it was stored (no proximal term then)."""
    value = meta.get("proximal_mu", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
        raise CaptureError(f"capture {path}: proximal_mu must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_against_model(capture: Capture) -> None:
    try:
        model = build_model(capture.spec)
    except ModelSpecError as exc:
        raise CaptureError(f"capture {capture.path}: bad model spec ({exc})") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in capture.weights.items()}
    if expected != found:
        diff = sorted(set(expected.items()) ^ set(found.items()))[:3]
        raise CaptureError(f"capture {capture.path}: weights do not fit model {capture.spec.name!r} (e.g. {diff})")
    names = [n for n, _ in model.named_parameters()]
    if names != capture.param_names:
        raise CaptureError(f"capture {capture.path}: parameter names do not match model {capture.spec.name!r}")
    if capture.gradient is not None:
        for (name, param), grad in zip(model.named_parameters(), capture.gradient):
            if tuple(param.shape) != tuple(grad.shape):
                raise CaptureError(
                    f"capture {capture.path}: gradient of {name} has shape {tuple(grad.shape)}, "
                    f"model has {tuple(param.shape)}"
                )


def load_oracle(path: str | Path) -> OracleRecord:
    """Read one oracle record; :class:`CaptureError` when it is foreign, corrupt or incomplete."""
    path, meta, tensors = _read_record(path, ORACLE_FORMAT)
    try:
        masks = [tensors[f"masks/{i}"] for i in range(int(meta["num_masks"]))]
        return OracleRecord(
            images=tensors["images"],
            labels=tensors["labels"],
            masks=masks,
            round=int(meta["round"]),
            client=int(meta["client"]),
            node_id=int(meta["node_id"]),
            path=path,
            batches=meta.get("batches"),
        )
    except KeyError as exc:
        raise CaptureError(f"oracle record {path}: missing {exc.args[0]!r}") from None


def _list_records(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    # Hidden names are unfinished writes; only complete folders count.
    return sorted(
        p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / META_FILE).is_file()
    )


def list_captures(directory: str | Path) -> list[Path]:
    """Complete capture folders under ``directory`` (a run folder or its ``captures/``), sorted
    by round then client."""
    directory = Path(directory)
    if (directory / "captures").is_dir():
        directory = directory / "captures"
    return _list_records(directory)


def list_oracles(directory: str | Path) -> list[Path]:
    """Complete oracle folders under ``directory`` (a run folder or its ``oracle/``)."""
    directory = Path(directory)
    if (directory / "oracle").is_dir():
        directory = directory / "oracle"
    return _list_records(directory)


def find_oracle(run_dir: str | Path, capture: Capture) -> OracleRecord:
    """The oracle record of the same round and client as ``capture``, from a run folder."""
    path = Path(run_dir) / "oracle" / record_name(capture.round, capture.client, capture.node_id)
    return load_oracle(path)


def find_oracles(run_dir: str | Path, capture: Capture) -> list[OracleRecord]:
    """The oracle records behind ``capture``: its client's, or for an aggregate capture each of its
    clients' records, in the order of its images."""
    if capture.aggregate is None:
        return [find_oracle(run_dir, capture)]
    members = zip(capture.aggregate.clients, capture.aggregate.node_ids)
    return [load_oracle(Path(run_dir) / "oracle" / record_name(capture.round, c, n)) for c, n in members]
