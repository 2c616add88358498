"""`fedsim` command line: flags built from the run config schema, and the error contract that
`attacker` keeps: a user error is one line `error: ...`, exit 2, no traceback, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedsim.cli import build_parser, main, run_config_from_args
from fedsim.flower_env import FLWR_ENV
from fedsim.run_config import DEFAULTS, SCHEMA


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every folder (None) and file (its bytes) under ``root``: to show a folder is unchanged."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _one_error_line(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, out + err
    assert lines[0].startswith("error: ") and "Traceback" not in out + err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def used(tmp_path: Path) -> Path:
    """A folder that already holds something."""
    folder = tmp_path / "used"
    (folder / "captures").mkdir(parents=True)
    (folder / "results.json").write_text('{"final_accuracy": 0.9}')
    return folder


# ---------------------------------------------------------------------------------------------
# flags from the schema
# ---------------------------------------------------------------------------------------------


def _flags(subcommand: str) -> set[str]:
    sub = build_parser()._subparsers._group_actions[0].choices[subcommand]  # type: ignore[union-attr]
    return {flag for action in sub._actions for flag in action.option_strings}


def test_every_setting_is_a_flag_named_after_its_key() -> None:
    keys = {"--" + s.key for s in SCHEMA}
    negations = {"--no-" + s.key for s in SCHEMA if s.type is bool}
    for subcommand in ("simulate", "deploy-local"):
        assert keys | negations <= _flags(subcommand)
        assert {"--rounds", "--clients", "--set"} <= _flags(subcommand)
    assert (keys | negations) - {"--p", "--run-dir"} <= _flags("sweep")
    assert {"--p", "--out"} <= _flags("sweep") and "--run-dir" not in _flags("sweep")


def test_defaults_come_from_the_schema_and_deploy_local_overrides_two() -> None:
    parser = build_parser()
    assert run_config_from_args(parser.parse_args(["simulate"])) == DEFAULTS
    deploy = run_config_from_args(parser.parse_args(["deploy-local"]))
    assert {k: v for k, v in deploy.items() if v != DEFAULTS[k]} == {"num-clients": 2, "num-server-rounds": 2}
    args = parser.parse_args(
        [
            "simulate",
            "--rounds",
            "4",
            "--num-clients",
            "3",
            "--no-download",
            "--labels",
            "recovered",
            "--model-options",
            '{"width": 32}',
            "--set",
            "lr=0.01",
            "--set",
            "num_server_rounds=5",
        ]
    )
    cfg = run_config_from_args(args)
    assert (cfg["num-clients"], cfg["download"], cfg["labels"], cfg["lr"]) == (3, False, "recovered", 0.01)
    assert cfg["num-server-rounds"] == 5 and cfg["model-options"] == '{"width": 32}'  # --set comes last


# ---------------------------------------------------------------------------------------------
# the error contract, per subcommand
# ---------------------------------------------------------------------------------------------


def test_simulate_never_writes_into_a_used_run_folder(used: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(used)
    assert main(["simulate", "--no-download", "--rounds", "1", "--clients", "2", "--run-dir", str(used)]) == 2
    _one_error_line(capsys, str(used), "not empty")
    assert _snapshot(used) == before
    file = used / "results.json"
    assert main(["simulate", "--no-download", "--run-dir", str(file)]) == 2
    _one_error_line(capsys, "is a file")
    assert _snapshot(used) == before


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--optimizer", "rmsprop"], ["optimizer must be one of adam, sgd"]),
        (["--labels", "unknown"], ["labels must be one of known, recovered"]),
        (["--p", "1.5"], ["p must be in [0, 1)"]),
        (["--rounds", "-1"], ["num-server-rounds must be >= 1"]),
        (["--clients", "two"], ["num-clients: expected an int"]),
        (["--capture-rounds", "first"], ["capture-rounds"]),
        (["--model", "transformer"], ["unknown model 'transformer'"]),
        (["--set", "lr"], ["--set expects KEY=VALUE"]),
        (["--set", "colour=red"], ["unknown run config key 'colour'"]),
        (["--set", "label-policy=unknown"], ["'label-policy' is now labels"]),
        (["--defense", "noise"], ["defense must be one of none, local-dp"]),
        (["--defense", "local-dp", "--clip-norm", "0"], ["clip-norm must be > 0"]),
        (["--defense", "central-dp-server-clipping", "--noise-multiplier", "-1"], ["noise-multiplier must be > 0"]),
        (["--defense", "local-dp", "--dp-epsilon", "0"], ["dp-epsilon must be > 0"]),
        (["--defense", "local-dp", "--dp-delta", "1"], ["dp-delta must be in (0, 1)"]),
        (["--defense", "prune", "--prune-fraction", "0"], ["prune-fraction must be in (0, 1]"]),
        (["--defense", "prune", "--prune-fraction", "1.5"], ["prune-fraction must be in (0, 1]"]),
        (
            ["--defense", "central-dp-client-clipping", "--inject-client-failure", "1:0"],
            ["central-dp-client-clipping cannot run with inject-client-failure"],
        ),
        # the data and its partitions (Flower Datasets, docs/data.md)
        (
            ["--partitioning", "round-robin"],
            ["partitioning must be one of iid, dirichlet, pathological", "round-robin"],
        ),
        (["--partitioning", "dirichlet", "--dirichlet-alpha", "0"], ["dirichlet-alpha must be > 0"]),
        (["--partitioner-options", '{"colour": 1}'], ["partitioner iid takes no parameter 'colour'"]),
        (["--partitioner-options", "shard"], ["partitioner-options must be a JSON object"]),
        (
            ["--partitioning", "pathological", "--partitioner-options", '{"num_classes_per_partition": 0}'],
            ["num_classes_per_partition must be >= 1"],
        ),
        (["--partitioning", "natural-id"], ["natural-id needs partition_by"]),
        (
            ["--partitioning", "natural-id", "--partitioner-options", '{"partition_by": "writer_id"}'],
            ["no column 'writer_id'"],
        ),
        (["--clients", "100000"], ["cannot split", "examples among 100000 clients"]),
        (["--data-source", "s3://bucket/mnist"], ["data-source must be one of builtin, hf:NAME"]),
        (
            ["--data-source", "hf:fedsim-tests/no-such-dataset"],
            ["offline", "datasets.load_dataset('fedsim-tests/no-such-dataset')"],
        ),
        (["--data-source", "imagefolder:/no/such/folder"], ["image folder /no/such/folder does not exist"]),
    ],
)
def test_simulate_bad_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: list[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(["simulate", "--no-download", "--run-dir", str(run_dir), *args]) == 2
    _one_error_line(capsys, *words)
    assert list(tmp_path.iterdir()) == []


def test_train_mode_batchnorm_with_a_victim_batch_of_one_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """timm's resnet18 reaches a 1x1 map at 32x32: train-mode BatchNorm cannot take one image. The
    federation would fail in its first capture round; it is one line before anything is written."""
    from fedsim.cli import _check_coupled_batches
    from fedsim.task import make_model

    args = ["--model", "timm:resnet18", "--dataset", "cifar10", "--model-options", '{"batchnorm_mode": "train"}']
    args += ["--capture-rounds", "1", "--victim-batch-size", "1", "--run-dir", str(tmp_path / "run")]
    assert main(["simulate", "--no-download", *args]) == 2
    _one_error_line(capsys, "timm:resnet18", "BatchNorm in train mode", "victim-batch-size = 1", ">= 2")
    assert list(tmp_path.iterdir()) == []
    cfg = run_config_from_args(build_parser().parse_args(["simulate", *args[:-6], "--capture-rounds", "1"]))
    cfg["victim-batch-size"] = 2
    _check_coupled_batches(cfg, make_model(cfg))  # B = 2: accepted
    cfg["capture-rounds"], cfg["victim-batch-size"] = "", 1
    _check_coupled_batches(cfg, make_model(cfg))  # no one-step capture round: no victim batch to run


def test_simulate_missing_or_corrupt_data_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_folder = tmp_path / "data.txt"
    not_a_folder.write_text("not a dataset")
    assert main(["simulate", "--no-download", "--data-root", str(not_a_folder), "--run-dir", str(tmp_path / "a")]) == 2
    _one_error_line(capsys, "is a file, not a folder")
    corrupt = tmp_path / "corrupt"
    (corrupt / "MNIST" / "raw").mkdir(parents=True)
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (corrupt / "MNIST" / "raw" / name).write_bytes(b"\x00garbage" * 10)
    before = _snapshot(tmp_path)
    assert main(["simulate", "--no-download", "--data-root", str(corrupt), "--run-dir", str(tmp_path / "b")]) == 2
    _one_error_line(capsys, "not valid mnist files")
    assert (
        main(
            [
                "simulate",
                "--no-download",
                "--dataset",
                "imagenet",
                "--model",
                "vit_b16",
                "--data-root",
                str(tmp_path / "nothing"),
                "--run-dir",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    _one_error_line(capsys, "ImageNet not found")
    assert _snapshot(tmp_path) == before


def test_sweep_never_writes_into_a_used_folder(used: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(used)
    assert main(["sweep", "--no-download", "--p", "0", "0.5", "--rounds", "1", "--out", str(used)]) == 2
    _one_error_line(capsys, str(used), "not empty")
    assert _snapshot(used) == before
    out = tmp_path / "sweep"
    for args, words in (
        (["--p", "0", "1.5"], ["p must be in [0, 1)"]),
        (["--p", "0.5", "0.50"], ["--p repeats"]),
        (["--rounds", "0"], ["num-server-rounds must be >= 1"]),
        (["--partitioning", "random"], ["partitioning must be one of iid, dirichlet"]),
    ):
        assert main(["sweep", "--no-download", "--out", str(out), *args]) == 2
        _one_error_line(capsys, *words)
    assert not out.exists() and _snapshot(used) == before


def test_deploy_local_errors_before_any_process(used: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(used)
    assert main(["deploy-local", "--no-download", "--run-dir", str(used)]) == 2
    _one_error_line(capsys, "not empty")
    assert _snapshot(used) == before
    run_dir = tmp_path / "run"
    for args, words in (
        (["--node-auth"], ["--node-auth needs --tls-dir"]),
        (["--tls-dir", str(tmp_path / "no-certs")], ["missing TLS files"]),
        (["--timeout", "0"], ["--timeout must be positive"]),
        (["--victim-batch-size", "0"], ["victim-batch-size must be >= 1"]),
    ):
        assert main(["deploy-local", "--no-download", "--run-dir", str(run_dir), *args]) == 2
        _one_error_line(capsys, *words)
    assert not run_dir.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["used"]


def test_captures_of_a_folder_without_captures(used: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(used)
    for target, words in (
        (used, ["holds no captures"]),
        (used / "results.json", ["is a file"]),
        (tmp_path / "missing", ["does not exist"]),
    ):
        assert main(["captures", str(target)]) == 2
        _one_error_line(capsys, *words)
    assert _snapshot(used) == before


def test_console_script_keeps_the_contract(used: Path) -> None:
    """The same through a real process: exit 2, one line on the terminal, no traceback."""
    env = dict(os.environ, **FLWR_ENV)
    proc = subprocess.run(
        [sys.executable, "-m", "fedsim.cli", "sweep", "--no-download", "--out", str(used)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stdout + proc.stderr
