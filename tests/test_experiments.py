"""The paper's experiment files and the experiment runner (`attacker experiment`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attacker import experiments as ex
from attacker.cli import main
from attacker.config import RunConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "experiments").glob("*.yaml"))
EXPECTED = {
    *("table1", "fig5a", "fig5b", "fig5c", "table2", "table3", "table4"),  # the paper's
    *("fedavg", "defenses", "strategies", "dp_sgd", "closed_form", "deployed"),  # beyond the paper
}


def test_every_experiment_file_is_there() -> None:
    assert {p.stem for p in CONFIGS} == EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
@pytest.mark.parametrize("source", ["paper", "builtin"])
def test_every_cell_builds_a_valid_run_config(
    path: Path, source: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The paper victims need not be present: point the lookup at a stand-in file.
    stand_in = tmp_path / "victims.tdump"
    stand_in.write_bytes(b"")
    monkeypatch.setattr(ex.spec, "_resolve_victim_file", lambda dataset, data_root: stand_in)
    exp = ex.load_experiment(path)
    assert exp.name == path.stem
    settings = ex.Settings(victim_source=source, include_optional=True)
    selected = ex.select_cells([exp], settings)
    assert len(selected) == len(exp.cells)
    for _, cell in selected:
        cfg = ex.build_cell_config(exp, cell, settings)
        assert isinstance(cfg, RunConfig)
        assert (cfg.victims.model, cfg.victims.dataset, cfg.victims.p, cfg.victims.victim_batch_size) == (
            cell.model,
            cell.dataset,
            cell.p,
            cell.B,
        )
        assert cfg.victims.count % cell.B == 0
        # every attack a cell runs has the paper's value (null where the paper has none)
        for attack in cell.attacks:
            assert attack in cell.paper, f"{cell.key}: no paper entry for {attack}"
            assert set(cell.paper[attack]) == set(exp.metrics) or set(cell.paper[attack]) <= set(exp.metrics)
        if cell.federation:  # its victims are its own federation's captures, whatever the source
            assert cfg.victims.source == "captures" and cfg.victims.captures.endswith(cell.key)
        elif source == "paper" and cell.dataset in ex.PAPER_VICTIMS:
            assert cfg.victims.source == "file"


def test_paper_values_spot_checks() -> None:
    exps = {p.stem: ex.load_experiment(p) for p in CONFIGS}
    cells = {c.key: c for e in exps.values() for c in e.cells}
    assert cells["table1-mlp-mnist-p0.25"].paper == {
        "accuracy": 98.28,
        "ig_eval": {"ssim": 0.79},
        "wiig": {"ssim": 1.0},
    }
    assert cells["fig5b-vit-cifar10-p0.75-B16"].paper["dia"] == {"ssim": 0.05, "mmd": 0.43}
    assert cells["fig5c-vit-mnist-lm0.0001-B16"].paper["dia"]["ssim"] == 0.82
    assert cells["table2-resnet18-cifar10-p0.5"].paper["dia"]["ssim"] == 0.70
    assert cells["table2-vit_b16-imagenet-p0.1"].optional
    assert cells["table3-vit-cifar10-p0.25-normal_keep"].overrides == {"mask_init": "normal_keep"}
    assert cells["table4-vit-cifar10-p0.1"].attacks == ["ig_eval", "april", "dia", "dia_april"]
    assert exps["fig5a"].attack_overrides == {"lambda_mask": 0.0}  # sec. 5.1 precedes the regularizer


def test_victims_round_up_to_batches_and_missing_paper_victims(tmp_path: Path) -> None:
    exp = ex.load_experiment(next(p for p in CONFIGS if p.stem == "fig5a"))
    cell = next(c for c in exp.cells if c.B == 16)
    cfg = ex.build_cell_config(exp, cell, ex.Settings(victims=3, victim_source="builtin"))
    assert cfg.victims.count == 16
    # the paper's victims absent and downloads off: one line naming the file, how to get it, and the way out
    with pytest.raises(
        ex.ExperimentError, match=r"dia-victims/MNIST_128\.tdump.*make victims.*--victim-source builtin"
    ):
        ex.build_cell_config(exp, cell, ex.Settings(data_root=str(tmp_path)))


def test_a_grid_cell_skips_an_attack_its_model_cannot_take() -> None:
    """deployed.yaml crosses dia_span with LeNet: the cell's config skips what does not apply (the reason
    goes to closed_form.json: tests/test_span.py) rather than failing the cell."""
    exp = ex.load_experiment(next(p for p in CONFIGS if p.stem == "deployed"))
    cell = next(c for c in exp.cells if c.model == "lenet" and "dia_span" in c.attacks)
    cfg = ex.build_cell_config(exp, cell, ex.Settings(victims=8, victim_source="builtin"))
    assert cfg.skip_inapplicable and "dia_span" in cfg.attacks


def test_an_attack_a_cell_cannot_take_is_reported_skipped(tmp_path: Path) -> None:
    """The cell runs what applies (WIIG on LeNet); dia_span and the closed form named on its own
    (dark_background), which LeNet cannot take, are 'skipped' in results.md, their reasons in the cell's
    closed_form.json."""
    config = tmp_path / "lenet.yaml"
    config.write_text(
        "name: lenet\ntitle: LeNet\ncells:\n"
        "- {id: a, model: lenet, dataset: mnist, p: 0.25, attacks: [dark_background, wiig, dia_span]}\n"
    )
    out = tmp_path / "out"
    args = ["experiment", str(config), "--victims", "1", "--iterations", "1", "--no-accuracy", "--no-lpips"]
    assert main([*args, "--victim-source", "builtin", "--quiet", "--out", str(out)]) == 0
    report = (out / "results.md").read_text()
    assert [line.split("|")[-2].strip() for line in report.splitlines() if "| dia_span |" in line] == ["skipped"]
    assert [line.split("|")[-2].strip() for line in report.splitlines() if "| wiig |" in line] == ["finished"]
    closed = json.loads((out / "cells" / "lenet-a" / "closed_form.json").read_text())
    assert "no Linear" in closed["skipped"]["dia_span"]
    assert "job victim000 has B = 1" in closed["skipped"]["dark_background"]
    assert [line.split("|")[-2].strip() for line in report.splitlines() if "| dark_background |" in line] == ["skipped"]


def test_cell_filter() -> None:
    exp = ex.load_experiment(next(p for p in CONFIGS if p.stem == "table1"))
    pick = lambda *pats: [c.id for _, c in ex.select_cells([exp], ex.Settings(cells=list(pats)))]  # noqa: E731
    assert pick("mlp-mnist-p0") == ["mlp-mnist-p0"]  # an exact id is exact
    assert pick("table1-vit-cifar10*") == [
        "vit-cifar10-p0",
        "vit-cifar10-p0.25",
        "vit-cifar10-p0.5",
        "vit-cifar10-p0.75",
    ]
    assert len(pick("cifar10")) == 8  # a plain word that is no id: substring


def test_bad_experiment_file_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ncells:\n- {model: mlp, dataset: mnist, p: 0.25, attacks: [nope]}\n")
    assert main(["experiment", str(bad), "--out", str(tmp_path / "out"), "--victim-source", "builtin"]) == 2
    assert "unknown attack" in capsys.readouterr().out


TINY = """
name: tiny
title: Tiny
source: made up
victims: {count: 8}
metrics: [ssim, mmd]
accuracy: {paper_rounds: 300, run_config: {num-clients: 2}}
figures:
- {name: ssim, metric: ssim_paper, x: p, series: attack}
cells:
- {id: a, model: mlp, dataset: mnist, p: 0.25, victim_batch_size: 1, attacks: [ig_eval, dia],
   model_options: {width: 32}, paper: {accuracy: 98.28, ig_eval: {ssim: 0.79}, dia: {ssim: 1.0, mmd: 0.01}}}
- {id: b, model: mlp, dataset: mnist, p: 0.5, victim_batch_size: 1, attacks: [dia], model_options: {width: 32},
   paper: {accuracy: null, dia: {ssim: 0.99, mmd: null}}}
"""


def test_tiny_experiment_runs_reports_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    federations: list[dict] = []

    def fake_federation(cfg: dict) -> Path:  # the Ray simulation is tested in test_simulation.py
        federations.append(cfg)
        run_dir = Path(cfg["run-dir"])
        run_dir.mkdir(parents=True)
        (run_dir / "results.json").write_text(
            json.dumps({"final_accuracy": 0.5, "best_accuracy": 0.6, "rounds_run": cfg["num-server-rounds"]})
        )
        return run_dir

    monkeypatch.setattr(ex.run, "_run_federation", fake_federation)
    out = tmp_path / "out"
    args = [
        "experiment",
        str(config),
        "--victims",
        "1",
        "--iterations",
        "5",
        "--victim-source",
        "builtin",
        "--no-lpips",
        "--quiet",
        "--out",
        str(out),
        "--fl-rounds",
        "2",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "2 run, 0 already finished" in first
    assert len(federations) == 2 and {f["p"] for f in federations} == {0.25, 0.5}
    assert federations[0]["num-server-rounds"] == 2 and federations[0]["num-clients"] == 2
    markers = {c: (out / "cells" / f"tiny-{c}" / "run.json") for c in "ab"}
    for marker in markers.values():
        assert json.loads(marker.read_text())["status"] == "finished"
        assert (marker.parent / "grid.png").is_file() and (marker.parent / "loss_curves.png").is_file()
    stamps = {c: (m.stat().st_mtime_ns, m.read_text()) for c, m in markers.items()}

    report = (out / "results.md").read_text()
    assert "SSIM paper-space (ours)" in report and "SSIM paper" in report and "SSIM [0,1] (ours)" in report
    assert "| a | mlp | mnist | 0.25 | 1 | ig_eval | 1 |" in report
    row = next(line for line in report.splitlines() if line.startswith("| a |") and "| dia |" in line)
    assert "| 1.00 |" in row and "| 0.01 |" in row and "50.00 / 60.00 (2 rounds)" in row and "98.28" in row
    assert "figures/tiny_ssim.png" in report and (out / "figures" / "tiny_ssim.png").is_file()
    assert "cells/tiny-a/grid.png" in report
    csv_text = (out / "results.csv").read_text()
    assert csv_text.splitlines()[0].startswith("experiment,cell,model") and csv_text.count("\n") == 4

    # second invocation: everything finished, nothing reruns
    assert main(args) == 0
    second = capsys.readouterr().out
    assert "0 run, 2 already finished" in second
    assert len(federations) == 2
    for c, marker in markers.items():
        assert (marker.stat().st_mtime_ns, marker.read_text()) == stamps[c]

    # other settings into the same folder: refused, nothing overwritten
    assert main([a if a != "5" else "6" for a in args]) == 2  # --iterations 6
    assert "other settings" in capsys.readouterr().out
    for c, marker in markers.items():
        assert (marker.stat().st_mtime_ns, marker.read_text()) == stamps[c]


def test_report_only_and_no_accuracy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    monkeypatch.setattr(ex.run, "_run_federation", lambda cfg: pytest.fail("--no-accuracy must not train"))
    out = tmp_path / "out"
    assert main(["experiment", str(config), "--report-only", "--out", str(out), "--victim-source", "builtin"]) == 0
    report = (out / "results.md").read_text()
    assert "| b | mlp | mnist | 0.5 | 1 | dia | – | – | 0.99 |" in report and "not run" in report
    assert (
        main(
            [
                "experiment",
                str(config),
                "--cells",
                "b",
                "--victims",
                "1",
                "--iterations",
                "3",
                "--no-accuracy",
                "--victim-source",
                "builtin",
                "--no-lpips",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "cells" / "tiny-b" / "run.json").is_file() and not (out / "cells" / "tiny-a").exists()


def test_federated_victims_come_from_the_curious_servers_captures(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--victim-source federated: a one-round federation per cell (the ServerApp and ClientApp on the
    in-process grid: flower_harness.run_in_process, in place of Ray's engine), its round-1 captures
    attacked (one victim batch per client, one training step at the random init)."""
    from flower_harness import run_in_process  # here: Ray's workers import this module without tests/ on their path

    monkeypatch.setattr(ex.run, "_run_federation", run_in_process)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "out"
    args = [
        "experiment",
        str(config),
        "--cells",
        "a",
        "--victims",
        "2",
        "--iterations",
        "5",
        "--victim-source",
        "federated",
        "--no-accuracy",
        "--no-lpips",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(args) == 0, capsys.readouterr().out
    fed = out / "federations" / "tiny-a"
    assert json.loads((fed / "results.json").read_text())["num_captures"] == 2
    rows = json.loads((out / "cells" / "tiny-a" / "metrics.json").read_text())
    assert {r["job"] for r in rows} == {"r0001_c000", "r0001_c001"} and all(r["ssim_paper"] is not None for r in rows)


FOUR = """
name: four
title: Four tiny cells
cells:
- {id: a, model: mlp, dataset: mnist, p: 0.25, attacks: [dia], model_options: {width: 32}, paper: {dia: {ssim: 1.0}}}
- {id: b, model: mlp, dataset: mnist, p: 0.5, attacks: [dia], model_options: {width: 32}, paper: {dia: {ssim: 0.99}}}
- {id: c, model: mlp, dataset: mnist, p: 0.75, attacks: [ig_eval], model_options: {width: 32},
   paper: {ig_eval: {ssim: 0.5}}}
- {id: d, model: mlp, dataset: mnist, p: 0.25, victim_batch_size: 2, attacks: [dia], model_options: {width: 32},
   paper: {dia: {ssim: 0.9}}}
"""
FOUR_ARGS = [
    "--victims",
    "2",
    "--iterations",
    "20",
    "--victim-source",
    "builtin",
    "--no-lpips",
    "--quiet",
    "--no-accuracy",
]


def _dies_once(cfg, run_dir: str, cwd: str, threads: int) -> dict:
    """Ray's cell task, except that cell c's first worker dies before doing anything (Ray retries it)."""
    import os

    marker = Path(run_dir).parents[1] / "worker-died"
    if Path(run_dir).name == "four-c" and not marker.exists():
        marker.write_text("cell c's first worker died here\n")
        os._exit(1)
    return ex.cluster.run_cell(cfg, run_dir, cwd, threads)


def _result_rows(path: Path) -> list[dict]:
    """results.csv without anything run-specific (timings, paths), floats as floats."""
    import csv

    def value(text: str):
        try:
            return float(text)
        except ValueError:
            return text

    with path.open() as fh:
        return [
            {k: value(v) for k, v in row.items() if not any(w in k for w in ("seconds", "time", "path", "dir"))}
            for row in csv.DictReader(fh)
        ]


def _only_cells(text: str, *ids: str) -> str:
    """The experiment config ``text`` with only the cells ``ids`` (a cell is one ``- {id: ...}`` item,
    continued on indented lines)."""
    keep: list[str] = []
    cell = None
    for line in text.splitlines():
        if line.startswith("- {id: "):
            cell = line.split("- {id: ", 1)[1].split(",", 1)[0]
        elif not line.startswith(" "):
            cell = None
        if cell is None or cell in ids:
            keep.append(line)
    return "\n".join(keep) + "\n"


@pytest.mark.timeout(300)  # a hang fails here, not after the suite's 15 minutes
def test_cells_on_ray_equal_the_sequential_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Two tiny cells (DIA and IG) once in this process and once as Ray tasks on a local Ray with two
    workers (2 CPUs, one per task), where one worker dies and Ray's retry reruns its cell: the same
    results.csv."""
    config = tmp_path / "four.yaml"
    config.write_text(_only_cells(FOUR, "a", "c"))
    seq, on_ray = tmp_path / "seq", tmp_path / "ray"
    assert main(["experiment", str(config), *FOUR_ARGS, "--out", str(seq)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(ex.cluster, "CELL_TASK", _dies_once)
    ray_args = [
        "experiment",
        str(config),
        *FOUR_ARGS,
        "--out",
        str(on_ray),
        "--ray",
        "--ray-local-cpus",
        "2",
        "--ray-cpus-per-task",
        "1",
    ]
    assert main(ray_args) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "2 cell(s) on a local Ray (1 node(s), 2 CPU(s)" in out and "2 run, 0 already finished" in out
    assert (on_ray / "worker-died").is_file()  # cell c ran on its retry
    rows = _result_rows(on_ray / "results.csv")
    assert len(rows) == 2 and {r["status"] for r in rows} == {"finished"}
    assert rows == _result_rows(seq / "results.csv")
    # finished cells are skipped on Ray as in the sequential run (no Ray is started for nothing)
    assert main(ray_args) == 0
    assert "0 run, 2 already finished" in capsys.readouterr().out


def test_ray_flags_that_cannot_work_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "four.yaml"
    config.write_text(FOUR)
    out = tmp_path / "out"
    base = ["experiment", str(config), *FOUR_ARGS, "--out", str(out)]
    for extra, says in (
        (["--ray-gpus-per-task", "1"], "--ray-gpus-per-task needs --ray"),
        (["--ray", "--ray-gpus-per-task", "1.5"], "a fraction up to 1 or a whole number"),
        (["--ray", "--ray-cpus-per-task", "0"], "--ray-cpus-per-task must be positive"),
        (["--ray", "host:6379", "--ray-local-cpus", "2"], "sizes a local Ray"),
        (["--ray", "--device", "gpu"], "needs a GPU per task"),
        (["--ray", "no-port"], "expected ray://HOST:PORT"),
    ):
        assert main(base + extra) == 2, extra
        printed = capsys.readouterr().out
        assert printed.startswith("error: ") and says in printed and "Traceback" not in printed, printed
    assert not out.exists()


def test_unreachable_ray_address_is_a_quick_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import socket
    import time

    config = tmp_path / "four.yaml"
    config.write_text(FOUR)
    out = tmp_path / "out"
    # Bound but not listening: a connection is refused, and no other process (another test worker's
    # Ray or SuperLink) can take the port while the test runs.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            started = time.monotonic()
            assert main(["experiment", str(config), *FOUR_ARGS, "--out", str(out), "--ray", address]) == 2
            printed = capsys.readouterr().out
            assert time.monotonic() - started < 10  # the probe's own deadline is 10 s: refused at once
            assert (
                printed.startswith(f"error: cannot reach the Ray cluster at 127.0.0.1:{port}")
                and printed.count("\n") == 1
            )
            assert not out.exists()  # refused before any work


def test_a_ray_address_that_never_answers_times_out(tmp_path: Path) -> None:
    """Something listens but is no Ray head: ray.init would wait for minutes; --ray-timeout bounds it.
    In a subprocess, because the abandoned ray.init goes on in the background until the process exits."""
    import socket
    import subprocess
    import sys
    import time

    config = tmp_path / "four.yaml"
    config.write_text(FOUR)
    repo = Path(__file__).resolve().parents[1]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "attacker.cli",
                "experiment",
                str(config),
                *FOUR_ARGS,
                "--out",
                str(tmp_path / "out"),
                "--ray",
                address,
                "--ray-timeout",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**__import__("os").environ, "PYTHONPATH": str(repo), "RAY_ADDRESS": ""},
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"error: could not connect to the Ray cluster at {address} within 2 s"), proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    # The process's start (Python, torch, Ray imports: a minute at worst on a busy 2-core machine with
    # other test workers) and the 2 s deadline; ray.init's own wait on a silent port is minutes.
    assert time.monotonic() - started < 100


@pytest.mark.parametrize("ask", ["gpus", "cpus"])
def test_resources_no_node_offers_are_refused_right_after_connecting(
    ask: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import time

    import torch

    config = tmp_path / "four.yaml"
    config.write_text(FOUR)
    out = tmp_path / "out"
    flags = {
        "gpus": ["--ray-gpus-per-task", "64" if torch.cuda.is_available() else "0.25"],
        "cpus": ["--ray-cpus-per-task", "2"],
    }[ask]
    started = time.monotonic()
    assert (
        main(["experiment", str(config), *FOUR_ARGS, "--out", str(out), "--ray", "--ray-local-cpus", "1", *flags]) == 2
    )
    printed = capsys.readouterr().out
    # A local Ray's start and stop, nothing more (up to a minute on a busy 2-core machine with other
    # test workers); Ray itself would wait for resources no node has for ever.
    assert time.monotonic() - started < 120
    assert printed.startswith("error: a local Ray (1 node(s), 1 CPU(s)") and printed.count("\n") == 1, printed
    assert f"no node has that many {ask[:3].upper()}s" in printed
    assert not (out / "cells").exists()


DEFENDED = """
name: defended
title: One cell with its own defended federation
accuracy: {run_config: {}}
cells:
- {id: a, model: mlp, dataset: mnist, p: 0.25, attacks: [ig_eval], model_options: {width: 32},
   federation: {defense: prune, prune_fraction: 0.5, local_steps: 1, onestep_lr: 0.01},
   paper: {accuracy: null, ig_eval: {ssim: null}}}
"""


def test_a_cell_with_its_own_federation_attacks_its_captured_round(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A federation under the cell's defense (the ServerApp and ClientApp, mods included, on the in-process
    grid: flower_harness.run_in_process): 2 training rounds, then round 3, audited: it is captured and
    attacked, and the report's accuracy is the federation's after its 2 training rounds (no separate
    accuracy federation). Cells' federations on Ray: the privacy-utility notebook's (tests/test_notebook.py)."""
    from flower_harness import run_in_process  # here: Ray's workers import this module without tests/ on their path

    monkeypatch.setattr(ex.run, "_run_federation", run_in_process)
    config = tmp_path / "defended.yaml"
    config.write_text(DEFENDED)
    out = tmp_path / "out"
    args = [
        "experiment",
        str(config),
        "--victims",
        "2",
        "--iterations",
        "3",
        "--fl-rounds",
        "2",
        "--no-lpips",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(args) == 0, capsys.readouterr().out
    fed = out / "federations" / "defended-a"
    results = json.loads((fed / "results.json").read_text())
    assert results["rounds_run"] == 3 and results["num_captures"] == 2
    config_used = json.loads((fed / "config.json").read_text())
    assert config_used["defense"] == "prune" and config_used["capture-rounds"] == "3"
    rows = json.loads((out / "cells" / "defended-a" / "metrics.json").read_text())
    assert {r["job"] for r in rows} == {"r0003_c000", "r0003_c001"} and {r["defense"] for r in rows} == {"prune"}
    assert all(r["rdlv"] is not None for r in rows)  # two victims: each one's prior is the other
    assert not (out / "accuracy").exists()
    report = (out / "results.md").read_text()
    acc = 100 * results["rounds"][2]["accuracy"]  # after training round 2, not the audited round 3
    assert f"{acc:.2f} / " in report and "(2 rounds)" in report and "| prune | keep 0.5 | – |" in report


@pytest.mark.parametrize(
    ("federation", "words"),
    [
        ("{model: lenet}", "federation must not set model"),
        ("{defense: local-dp, dp_delta: 2}", "dp-delta must be in (0, 1)"),
    ],
)
def test_bad_cell_federation_is_a_user_error(tmp_path: Path, federation: str, words: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        DEFENDED.replace("{defense: prune, prune_fraction: 0.5, local_steps: 1, onestep_lr: 0.01}", federation)
    )
    with pytest.raises(ex.ExperimentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ex.load_experiment(config)
