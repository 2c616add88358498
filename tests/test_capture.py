"""Capture store: round trip, atomic writes, and a reader that refuses anything it cannot trust."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fedsim.atomic as atomic_mod
from fedsim.capture import (
    Capture,
    CaptureError,
    OracleRecord,
    list_captures,
    list_oracles,
    load_capture,
    load_oracle,
    save_capture,
    save_oracle,
)
from fedsim.models import ModelSpec, build_model

SPEC = ModelSpec("mlp", "mnist", 0.25, 0, {"width": 16, "depth": 2})


def make_capture(kind: str = "gradient", round_: int = 3, client: int = 1) -> Capture:
    model = build_model(SPEC)
    names = [n for n, _ in model.named_parameters()]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(round_ * 100 + client)
    grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    return Capture(
        spec=SPEC,
        weights=weights,
        kind=kind,
        round=round_,
        client=client,
        node_id=12345678901234567890,
        batch_size=2,
        num_examples=2,
        lr=0.01,
        label_policy="known" if kind == "gradient" else "recovered",
        param_names=names,
        gradient=grads if kind == "gradient" else None,
        update={k: 0.01 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        if kind == "update"
        else None,
        labels=torch.tensor([3, 7]) if kind == "gradient" else None,
        hyperparameters={"lr": 0.01, "optimizer": "sgd"},
    )


def test_gradient_capture_round_trip(tmp_path: Path) -> None:
    original = make_capture()
    path = save_capture(tmp_path, original)
    assert list_captures(tmp_path) == [path]
    assert sorted(f.name for f in path.iterdir()) == ["record.json", "tensors.safetensors"]
    loaded = load_capture(path)
    assert loaded.spec == SPEC and loaded.p == 0.25
    assert (loaded.kind, loaded.round, loaded.client, loaded.node_id) == ("gradient", 3, 1, 12345678901234567890)
    assert (loaded.batch_size, loaded.lr, loaded.label_policy) == (2, 0.01, "known")
    assert list(loaded.weights) == list(original.weights)
    assert all(torch.equal(loaded.weights[k], v) for k, v in original.weights.items())
    assert len(loaded.gradient) == len(original.gradient)
    assert all(torch.equal(a, b) for a, b in zip(loaded.gradient, original.gradient))
    # gradient order is model.parameters() order, so it zips with a rebuilt model
    model = loaded.build_model()
    assert [tuple(p.shape) for p in model.parameters()] == [tuple(g.shape) for g in loaded.gradient]
    assert torch.equal(loaded.labels, torch.tensor([3, 7]))
    assert loaded.update is None and loaded.hyperparameters["optimizer"] == "sgd"
    # either file of the record also names it
    assert load_capture(path / "record.json").round == 3


def test_update_capture_and_oracle_round_trip(tmp_path: Path) -> None:
    original = make_capture("update")
    path = save_capture(tmp_path / "captures", original)
    loaded = load_capture(path)
    assert loaded.kind == "update" and loaded.gradient is None and loaded.labels is None
    assert loaded.label_policy == "recovered"
    assert json.loads((path / "record.json").read_text())["label_policy"] == "recovered"
    assert all(torch.equal(loaded.update[k], v) for k, v in original.update.items())

    oracle = OracleRecord(
        torch.randn(2, 1, 28, 28),
        torch.tensor([3, 7]),
        [torch.ones(2, 16), torch.zeros(2, 16)],
        round=3,
        client=1,
        node_id=5,
    )
    opath = save_oracle(tmp_path / "oracle", oracle)
    assert list_oracles(tmp_path) == [opath]
    back = load_oracle(opath)
    assert torch.equal(back.images, oracle.images) and torch.equal(back.labels, oracle.labels)
    assert len(back.masks) == 2 and torch.equal(back.masks[1], oracle.masks[1])
    # the two record types refuse each other
    with pytest.raises(CaptureError, match="expected 'fedsim.capture'"):
        load_capture(opath)
    with pytest.raises(CaptureError, match="expected 'fedsim.oracle'"):
        load_oracle(path)
    assert list_captures(tmp_path) == [path]


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = make_capture()
    bad.hyperparameters = {"unserializable": object()}  # JSON fails after the tensor file is written
    with pytest.raises(TypeError):
        save_capture(tmp_path, bad)
    assert list(tmp_path.iterdir()) == []

    def boom(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(atomic_mod.os, "replace", boom)  # fails at the very last step (the rename)
    with pytest.raises(CaptureError, match="could not write record .*disk full"):
        save_capture(tmp_path, make_capture())
    assert list(tmp_path.iterdir()) == []
    assert list_captures(tmp_path) == []


def test_unfinished_write_is_invisible_and_overwrite_refused(tmp_path: Path) -> None:
    path = save_capture(tmp_path, make_capture())
    (tmp_path / ".r0009_c000_n1.abc.tmp").mkdir()  # what a crashed writer leaves behind
    (tmp_path / ".r0009_c000_n1.abc.tmp" / "record.json").write_text("{}")
    assert list_captures(tmp_path) == [path]
    with pytest.raises(CaptureError, match="already exists"):
        save_capture(tmp_path, make_capture())


def _one_line(exc: pytest.ExceptionInfo[CaptureError]) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


def test_reader_rejects_truncated_garbage_and_foreign(tmp_path: Path) -> None:
    path = save_capture(tmp_path, make_capture())
    tensors = path / "tensors.safetensors"
    meta_file = path / "record.json"
    blob, meta_text = tensors.read_bytes(), meta_file.read_text()

    tensors.write_bytes(blob[: len(blob) // 2])  # truncated
    with pytest.raises(CaptureError) as exc:
        load_capture(path)
    assert "corrupt or truncated" in _one_line(exc)

    # garbage whose checksum matches still fails at the safetensors parser, not with a crash
    import hashlib

    garbage = b"\x00\x01not safetensors at all" * 10
    tensors.write_bytes(garbage)
    meta = json.loads(meta_text)
    meta["tensors_sha256"] = hashlib.sha256(garbage).hexdigest()
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CaptureError) as exc:
        load_capture(path)
    assert "not a valid safetensors" in _one_line(exc)
    tensors.write_bytes(blob)

    meta_file.write_bytes(b"\x89PNG garbage")
    with pytest.raises(CaptureError) as exc:
        load_capture(path)
    assert "not valid JSON" in _one_line(exc)

    meta_file.write_text(json.dumps({"format": "something.else", "schema_version": 1}))
    with pytest.raises(CaptureError) as exc:
        load_capture(path)
    assert "something.else" in _one_line(exc)

    meta_file.write_text(json.dumps(["a", "list"]))
    with pytest.raises(CaptureError):
        load_capture(path)

    meta = json.loads(meta_text)
    meta["schema_version"] = 99
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CaptureError, match="schema version 99"):
        load_capture(path)

    meta = json.loads(meta_text)
    del meta["round"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CaptureError, match="lacks the field 'round'"):
        load_capture(path)

    meta_file.unlink()
    with pytest.raises(CaptureError, match="incomplete"):
        load_capture(path)
    with pytest.raises(CaptureError, match="does not exist"):
        load_capture(tmp_path / "nope")
    random_file = tmp_path / "random.bin"
    random_file.write_bytes(b"\x00" * 64)
    with pytest.raises(CaptureError):
        load_capture(random_file)


def test_reader_rejects_mismatched_model(tmp_path: Path) -> None:
    path = save_capture(tmp_path, make_capture())
    meta = json.loads((path / "record.json").read_text())
    meta["spec"]["options"]["width"] = 32  # the tensors no longer fit the model the spec builds
    (path / "record.json").write_text(json.dumps(meta))
    with pytest.raises(CaptureError) as exc:
        load_capture(path)
    assert "do not fit model 'mlp'" in _one_line(exc)
    meta["spec"] = {"name": "nosuchmodel", "dataset": "mnist", "p": 0.1}
    (path / "record.json").write_text(json.dumps(meta))
    with pytest.raises(CaptureError, match="bad model spec"):
        load_capture(path)


def test_captures_stored_with_the_old_label_word_still_load(tmp_path: Path) -> None:
    """Before the run config said ``labels: known|recovered``, records stored "unknown"."""
    path = save_capture(tmp_path, make_capture("update"))
    meta_path = path / "record.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, label_policy="unknown")))
    assert load_capture(path).label_policy == "recovered"
    meta_path.write_text(json.dumps(dict(meta, label_policy="guessed")))
    with pytest.raises(CaptureError, match="unknown label policy 'guessed'"):
        load_capture(path)
    bad = make_capture()
    bad.label_policy = "unknown"  # the old word is read, never written
    with pytest.raises(CaptureError, match="label policy must be one of"):
        save_capture(tmp_path / "new", bad)


def test_a_capture_kind_is_one_entry_that_every_site_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind added to CAPTURE_KINDS is stored, loaded, counted, sent to the clients, scheduled and
    described as its entry says; the loader refuses a kind the table does not hold."""
    import dataclasses

    from attacker.audit import describe_setting
    from fedsim import dp_sgd
    from fedsim.capture_kinds import CAPTURE_KINDS
    from fedsim.run_config import DEFAULTS

    gradient, update = CAPTURE_KINDS["gradient"], CAPTURE_KINDS["update"]
    assert gradient.round_config(True) == {"one-step": True, "capture-update": False}
    assert update.round_config(True) == {"one-step": False, "capture-update": True}
    assert gradient.round_config(False) == update.round_config(False) == {"one-step": False, "capture-update": False}
    with pytest.raises(ValueError, match="client flag"):
        dataclasses.replace(gradient, client_flag="two-step")

    monkeypatch.setitem(CAPTURE_KINDS, "step", dataclasses.replace(gradient, name="step"))
    monkeypatch.setitem(CAPTURE_KINDS, "round", dataclasses.replace(update, name="round"))
    # Two labels: the batch of the one step (5 examples in the round) or the round's two images.
    step = dataclasses.replace(make_capture(), kind="step", num_examples=5)
    local = dataclasses.replace(make_capture("update"), kind="round", batch_size=1, labels=torch.tensor([1, 2]))
    local = dataclasses.replace(local, label_policy="known", local_steps=2)
    loaded_step = load_capture(save_capture(tmp_path / "a", step))
    loaded_local = load_capture(save_capture(tmp_path / "b", local))
    assert (
        loaded_step.kind == "step" and loaded_step.update is None and len(loaded_step.gradient) == len(step.param_names)
    )
    assert (
        loaded_local.kind == "round"
        and loaded_local.gradient is None
        and set(loaded_local.update) == set(local.weights)
    )
    assert loaded_step.label_count == loaded_local.label_count == 2
    assert describe_setting(loaded_step)["capture"] == "one-step gradients of 2 images each"
    assert describe_setting(loaded_step)["optimizer"] is None
    assert describe_setting(loaded_local)["capture"] == "FedAvg K = 2 SGD"
    assert describe_setting(loaded_local)["optimizer"] == "sgd"
    cfg = dict(DEFAULTS, **{"capture-images": 4, "local-steps": 3})
    assert dp_sgd.capture_steps(dict(cfg, **{"capture-kind": "step"}), 10) == 1
    assert dp_sgd.capture_steps(dict(cfg, **{"capture-kind": "round"}), 10) == 3

    monkeypatch.delitem(CAPTURE_KINDS, "step")
    with pytest.raises(
        CaptureError,
        match="capture kind must be one of \\('gradient', 'update', 'secagg-gradient', 'secagg-update', 'round'\\)",
    ):
        save_capture(tmp_path / "c", step)
    with pytest.raises(CaptureError, match="unknown kind 'step'"):
        load_capture(loaded_step.path)
    record = loaded_step.path / "record.json"
    record.write_text(json.dumps(dict(json.loads(record.read_text()), kind=["gradient"])))
    with pytest.raises(CaptureError, match="unknown kind \\['gradient'\\]"):
        load_capture(loaded_step.path)
