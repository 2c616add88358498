"""Hostile inputs and injected faults: captures, configs, full disks, killed attacks."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedsim.atomic as atomic_mod
import fedsim.capture as capture_mod
from attacker.config import ConfigError, parse_config
from fedsim.atomic import atomic_write
from fedsim.capture import CaptureError, list_captures, load_capture, save_capture

from .test_capture import make_capture

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good_record(tmp_path_factory) -> Path:
    return save_capture(tmp_path_factory.mktemp("good"), make_capture())


def _copy_record(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@FUZZ
@given(
    which=st.sampled_from(["record.json", "tensors.safetensors"]),
    offset=st.floats(0, 1),
    mode=st.sampled_from(["flip", "truncate", "insert", "zero"]),
    value=st.integers(1, 255),
)
def test_fuzzed_captures_fail_cleanly(tmp_path_factory, good_record, which, offset, mode, value):
    """A bounded fuzz of the reader: any damage gives a CaptureError (one line) or a faithful read."""
    rec = _copy_record(good_record, tmp_path_factory.mktemp("fuzz") / good_record.name)
    target = rec / which
    data = bytearray(target.read_bytes())
    i = min(int(offset * len(data)), len(data) - 1)
    if mode == "flip":
        data[i] ^= value
    elif mode == "truncate":
        data = data[:i]
    elif mode == "insert":
        data[i:i] = bytes([value])
    else:
        data = bytearray(len(data))
    target.write_bytes(bytes(data))
    try:
        cap = load_capture(rec)
    except CaptureError as err:
        assert "\n" not in str(err) and str(rec.name) in str(err)
        return
    # Some JSON edits are harmless (e.g. whitespace); then the content must still be intact.
    ref = load_capture(good_record)
    assert all(torch.equal(a, b) for a, b in zip(cap.gradient, ref.gradient))


@FUZZ
@given(
    round_=st.integers(1, 10_000),
    client=st.integers(0, 999),
    lr=st.floats(1e-6, 10, allow_nan=False),
    labels=st.lists(st.integers(0, 9), min_size=2, max_size=2),
    kind=st.sampled_from(["gradient", "update"]),
)
def test_capture_round_trip_property(tmp_path_factory, round_, client, lr, labels, kind):
    cap = make_capture(kind, round_, client)
    cap.lr = lr
    if kind == "gradient":
        cap.labels = torch.tensor(labels)
    path = save_capture(tmp_path_factory.mktemp("rt"), cap)
    back = load_capture(path)
    assert (back.round, back.client, back.kind, back.lr, back.spec) == (round_, client, kind, lr, cap.spec)
    assert all(torch.equal(back.weights[k], v) for k, v in cap.weights.items())
    if kind == "gradient":
        assert back.labels.tolist() == labels
        assert all(torch.equal(a, b) for a, b in zip(back.gradient, cap.gradient))


def test_nan_gradient_is_rejected(tmp_path):
    cap = make_capture()
    cap.gradient[0][0] = float("nan")
    path = save_capture(tmp_path, cap)
    with pytest.raises(CaptureError, match="NaN or infinite"):
        load_capture(path)


def test_pickle_in_place_of_tensors_runs_nothing(tmp_path, good_record):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    rec = _copy_record(good_record, tmp_path / good_record.name)
    (rec / "tensors.safetensors").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CaptureError):
        load_capture(rec)
    assert not marker.exists()


@pytest.mark.parametrize("case", ["empty-dir", "empty-files", "file-not-dir", "missing"])
def test_degenerate_capture_paths(tmp_path, case):
    path = tmp_path / "rec"
    if case == "empty-dir":
        path.mkdir()
    elif case == "empty-files":
        path.mkdir()
        (path / "record.json").write_bytes(b"")
        (path / "tensors.safetensors").write_bytes(b"")
    elif case == "file-not-dir":
        path.write_text("hello")
    with pytest.raises(CaptureError):
        load_capture(path)


def test_capture_write_on_a_full_disk(tmp_path, monkeypatch):
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(capture_mod.Path, "write_bytes", full)
    with pytest.raises(CaptureError, match="No space left on device"):
        save_capture(tmp_path, make_capture())
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [] and list_captures(tmp_path) == []


def test_result_write_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    atomic_write(target, "old")

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_mod.os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


CONFIG_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 50),
    st.floats(-2, 2),
    st.just(float("nan")),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(
    victims=st.dictionaries(
        st.sampled_from(
            ["model", "dataset", "p", "victim_batch_size", "count", "source", "client", "num_clients", "colour"]
        ),
        CONFIG_VALUES,
        max_size=5,
    ),
    top=st.dictionaries(
        st.sampled_from(["attacks", "labels", "device", "seed", "checkpoint_every", "attack_overrides", "bogus"]),
        CONFIG_VALUES,
        max_size=3,
    ),
)
def test_config_validation_property(victims, top):
    """Any mapping either validates into a usable config or fails with a ConfigError, never another error."""
    try:
        cfg = parse_config(dict(top, victims=victims))
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert (
        0 <= cfg.victims.p < 1
        and cfg.victims.victim_batch_size > 0
        and cfg.victims.count % cfg.victims.victim_batch_size == 0
    )
    cfg.attack_configs()
    cfg.model_spec()


def _attack_cmd(out: Path) -> list[str]:
    cfg = out.parent / "attack.yaml"
    cfg.write_text(
        "victims: {model: mlp, dataset: mnist, p: 0.25, count: 2}\n"
        "attacks: [dia]\nattack_overrides: {max_iterations: 100}\nlpips: false\ndevice: cpu\ncheckpoint_every: 20\n"
    )
    return [sys.executable, "-m", "attacker.cli", "run", str(cfg), "--quiet", "--out", str(out)]


def test_sigkilled_attack_resumes_to_the_uninterrupted_result(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    ref = tmp_path / "ref"
    subprocess.run(_attack_cmd(ref), check=True, env=env, capture_output=True, timeout=600)

    out = tmp_path / "killed"
    proc = subprocess.Popen(_attack_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = out / "checkpoints" / "group000" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ckpt.exists(), "the attack never wrote a checkpoint"
    assert json.loads((out / "run.json").read_text())["status"] == "running"
    assert not (out / "metrics.json").exists()
    done = subprocess.run(_attack_cmd(out), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "resuming" in done.stdout
    a = json.loads((ref / "metrics.json").read_text())
    b = json.loads((out / "metrics.json").read_text())
    for ra, rb in zip(a, b):
        assert ra["iterations"] == rb["iterations"] and ra["best_iteration"] == rb["best_iteration"]
        assert ra["best_loss"] == pytest.approx(rb["best_loss"], rel=1e-4)
        assert ra["ssim_paper"] == pytest.approx(rb["ssim_paper"], abs=1e-4)


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
def test_a_damaged_checkpoint_is_refused_clearly(tmp_path, capsys, damage):
    from attacker.cli import main

    out = tmp_path / "run"
    ckpt = out / "checkpoints" / "group000" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"status": "running"}))
    marker = tmp_path / "pwned"
    if damage == "truncated":
        ckpt.write_bytes(b"PK\x03\x04 truncated")
    else:

        class Evil:
            def __reduce__(self):
                return (Path.touch, (marker,))

        torch.save({"inversion": Evil()}, ckpt)
    code = main(["run", "--victims", "1", "--iterations", "2", "--quiet", "--no-lpips", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 2 and "cannot be read safely" in text and not marker.exists()


def test_a_checkpoint_of_an_older_engine_is_refused_clearly(tmp_path, capsys):
    """The engine's checkpoint layout changed (stacked dummies, Adam written out): an older one cannot
    resume, and says so instead of failing inside Lightning."""
    from attacker.cli import main

    out = tmp_path / "run"
    ckpt = out / "checkpoints" / "group000" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"status": "running"}))
    torch.save({"inversion": {"iteration": 3, "optimizers": []}, "state_dict": {}}, ckpt)
    code = main(["run", "--victims", "1", "--iterations", "2", "--quiet", "--no-lpips", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 2 and "older version of the engine" in text and "remove it" in text
