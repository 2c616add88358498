"""The attacker CLI as a user runs it: the main job, configs, and clear errors (exit 2, no traceback)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attacker.cli import main
from attacker.config import ConfigError, parse_config

from .conftest import paper_victims_or_skip


def _run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_demo_small_writes_a_full_run_folder(tmp_path, capsys):
    out = tmp_path / "demo"
    code, text = _run(
        [
            "demo",
            "--offline-victims",
            "--out",
            str(out),
            "--victims",
            "2",
            "--iterations",
            "30",
            "--quiet",
            "--no-lpips",
        ],
        capsys,
    )
    assert code == 0, text
    for name in (
        "config.yaml",
        "metrics.csv",
        "metrics.json",
        "summary.csv",
        "loss_curves.png",
        "grid.png",
        "report.md",
        "reconstructions.safetensors",
    ):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    rows = json.loads((out / "metrics.json").read_text())
    assert sorted({r["attack"] for r in rows}) == ["dia", "ig_eval", "wiig"]
    assert all(r["labels"] == "known" and r["iterations"] == 30 for r in rows)
    assert "ig_eval" in text and "SSIM" in text
    # A finished run is never overwritten.
    code, text = _run(
        ["demo", "--offline-victims", "--out", str(out), "--victims", "2", "--iterations", "30", "--quiet"], capsys
    )
    assert code == 2 and "already holds a finished run" in text and "Traceback" not in text


def test_run_from_config_with_recovered_labels(tmp_path, capsys):
    cfg = tmp_path / "attack.yaml"
    cfg.write_text(
        "victims: {model: mlp, dataset: mnist, p: 0.5, count: 2}\n"
        "attacks: [dia]\nattack_overrides: {max_iterations: 10}\nlabels: recovered\nlpips: false\n"
    )
    code, text = _run(["run", str(cfg), "--out", str(tmp_path / "r"), "--quiet"], capsys)
    assert code == 0, text
    rows = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert {r["labels"] for r in rows} == {"recovered"} and {r["p"] for r in rows} == {0.5}


def test_command_line_model_is_checked_with_the_files_model_options(tmp_path, capsys):
    # the file's options belong to the model the flags choose, not to the default model
    cfg = tmp_path / "attack.yaml"
    cfg.write_text("victims: {model_options: {norm: group}}\nlpips: false\n")
    args = ["run", str(cfg), "--model", "resnet18", "--dataset", "cifar10", "--p", "0.25", "--victims", "1"]
    code, text = _run(
        [*args, "--attacks", "ig_eval", "--iterations", "1", "--out", str(tmp_path / "r"), "--quiet"], capsys
    )
    assert code == 0, text
    assert "norm: group" in (tmp_path / "r" / "config.yaml").read_text()


def test_run_on_the_papers_victim_file(tmp_path, capsys):
    victims = paper_victims_or_skip("mnist")
    code, text = _run(
        [
            "run",
            "--victim-file",
            str(victims),
            "--model",
            "lenet",
            "--dataset",
            "mnist",
            "--victims",
            "1",
            "--attacks",
            "dia",
            "--iterations",
            "5",
            "--no-lpips",
            "--quiet",
            "--out",
            str(tmp_path / "f"),
        ],
        capsys,
    )
    assert code == 0, text
    assert json.loads((tmp_path / "f" / "metrics.json").read_text())[0]["optimized_values"] == 2940


@pytest.mark.parametrize(
    "args,message",
    [
        (["--p", "1.0"], "p must be in [0, 1)"),
        (["--p", "-0.2"], "p must be in [0, 1)"),
        (["--victim-batch-size", "0"], "victim_batch_size must be positive"),
        (["--model", "transformer"], "unknown model"),
        (["--attacks", "dlg"], "unknown attack"),
        (["--iterations", "0"], "max_iterations must be a positive integer"),
        (["--iterations", "-5"], "max_iterations must be a positive integer"),
        (["--model", "vit_b16"], "224x224"),
        (["--victims", "3", "--victim-batch-size", "2"], "multiple of victim_batch_size"),
        (["--victim-file", "/nonexistent/v.tdump"], "does not exist"),
    ],
)
def test_bad_arguments_give_one_clear_line(args, message, tmp_path, capsys):
    out = tmp_path / "bad"
    code, text = _run(["run", "--out", str(out), "--quiet", *args], capsys)
    assert code == 2
    assert message in text and "Traceback" not in text
    assert not out.exists()


@pytest.mark.parametrize(
    "content,message",
    [
        ("victims: {model: mlp, colour: red}\n", "unknown key(s) victims.colour"),
        ("attackz: [dia]\n", "unknown key(s) attackz"),
        ("victims: {p: high}\n", "victims.p must be"),
        ("victims: [1, 2]\n", "victims must be a mapping"),
        ("victims: {model: mlp\n", "not valid YAML"),
        ("labels: guessed\n", "labels must be"),
        ("- dia\n", "must be a mapping of settings, not a list"),
    ],
)
def test_bad_config_files(content, message, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(content)
    code, text = _run(["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"], capsys)
    assert code == 2 and message in text and "Traceback" not in text


def test_config_path_problems(tmp_path, capsys):
    code, text = _run(["run", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "does not exist" in text
    code, text = _run(["run", str(tmp_path)], capsys)
    assert code == 2 and "is a directory" in text


def test_victim_file_of_the_wrong_shape(tmp_path, capsys):
    bad = tmp_path / "cifar.tdump"
    torch.save({"inputs": torch.zeros(2, 3, 32, 32), "targets": torch.zeros(2, dtype=torch.long)}, bad)
    code, text = _run(
        [
            "run",
            "--victim-file",
            str(bad),
            "--model",
            "mlp",
            "--dataset",
            "mnist",
            "--victims",
            "2",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert code == 2 and "takes (1, 28, 28)" in text


def test_crafted_pickle_victim_file_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    payload = tmp_path / "evil.tdump"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"inputs": Evil(), "targets": torch.zeros(1)}, payload)
    code, text = _run(["run", "--victim-file", str(payload), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and not marker.exists()


def test_parse_config_defaults_are_the_papers():
    cfg = parse_config({})
    (ig, wiig, dia) = cfg.attack_configs()
    assert (dia.lr, dia.max_iterations, dia.patience, dia.plateau_patience, dia.lambda_mask) == (
        0.1,
        20000,
        4000,
        800,
        1e-4,
    )
    assert dia.tv_for("mlp") == 1e-5 and dia.tv_for("lenet") == 1e-2
    with pytest.raises(ConfigError):
        parse_config({"victims": {"client": 10, "num_clients": 10}})


def test_console_entry_point_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "attacker.cli", "run", "--p", "2", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("case,message", [("corrupt", "not valid mnist files"), ("file", "is a file, not a folder")])
def test_bad_data_roots(case, message, tmp_path, capsys):
    root = tmp_path / "data"
    if case == "corrupt":
        raw = root / "MNIST" / "raw"
        raw.mkdir(parents=True)
        for name in (
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        ):
            (raw / name).write_bytes(b"not an idx file")
    else:
        root.write_text("not a folder")
    out = tmp_path / "o"
    code, text = _run(
        ["run", "--data-root", str(root), "--victims", "1", "--iterations", "2", "--quiet", "--out", str(out)], capsys
    )
    assert code == 2 and message in text and "Traceback" not in text
    assert not out.exists()
