"""`attacker audit RUN_DIR` (attacker/audit.py): one report on an audited federated run. A two-client
round of the MLP on the offline MNIST sample is run by the real server loop in this process (no Ray),
then audited with a few iterations: the report's files, its per-image count against the metrics, the
verdict's words, the reuse of a finished attack run, and bad input as one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from flower_harness import FakeGrid, context_for, offline_config, set_task_identity
from flwr.app import Message

from attacker.audit import describe_setting, verdict, with_privacy_spent
from attacker.cli import main
from fedsim.capture import Capture
from fedsim.client_app import handle_evaluate, handle_train
from fedsim.models import ModelSpec

ITERATIONS = "30"


class InProcessGrid(FakeGrid):
    """The server loop's Grid, running the ClientApp's handlers in this process (no Ray start-up)."""

    def send_and_receive(self, messages: Any, timeout: float | None = None) -> list[Message]:
        handlers = {"train": handle_train, "evaluate": handle_evaluate}
        return [handlers[m.metadata.message_type](m, context_for(m)) for m in messages]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def fed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An audited federated run: 2 clients, round 1 captured as one-step gradients of 2 images each."""
    from fedsim.server_app import run_server

    set_task_identity()
    run_dir = tmp_path_factory.mktemp("fed")
    cfg = offline_config(
        {
            "audit": True,
            "capture-rounds": "1",
            "num-server-rounds": 1,
            "local-steps": 1,
            "victim-batch-size": 2,
            "model-options": '{"width": 64}',
            "run-dir": str(run_dir),
        }
    )
    run_server(InProcessGrid(), cfg)
    return run_dir


@pytest.fixture(scope="module")
def audited(fed_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audits") / "audit"
    code = main(["audit", str(fed_run), "--out", str(out), "--iterations", ITERATIONS, "--no-lpips", "--quiet"])
    assert code == 0
    return out


def test_audit_writes_the_report_with_counts_from_the_metrics(audited: Path) -> None:
    for name in ("audit.md", "audit.json", "audit_grid.png", "report.md", "metrics.json"):
        assert (audited / name).stat().st_size > 0, name
    audit = json.loads((audited / "audit.json").read_text())
    # the default: the closed forms that apply first (2 images per gradient: the separations by dropout's zeros
    # and by the background),
    # then IG and DIA; WIIG because the run kept the oracle
    assert audit["attacks"] == ["cocktail_party", "dark_background", "ig_eval", "dia", "dia_hold", "wiig"]
    assert audit["threshold"] == {"metric": "ssim_std", "space": "[0,1]", "value": 0.6}
    images = audit["images"]
    assert len(images) == 4 and {(r["client"], r["index"]) for r in images} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # Per image the best of the attacks a real server runs; WIIG (the oracle's) never counts as best.
    for row in images:
        server = {a: m["ssim_std"] for a, m in row["attacks"].items() if a != "wiig"}
        assert row["best_attack"] == max(server, key=server.__getitem__) and row["oracle_attack"] == "wiig"
    count = sum(max(m["ssim_std"] for a, m in r["attacks"].items() if a != "wiig") >= 0.6 for r in images)
    summary = audit["summary"]
    assert summary["recognisable"] == count and summary["fraction"] == count / 4
    # The per-image scores are the attack run's: their mean per job and attack is metrics.json's value.
    for row in json.loads((audited / "metrics.json").read_text()):
        per_image = [r["attacks"][row["attack"]]["ssim_std"] for r in images if r["job"] == row["job"]]
        assert sum(per_image) / len(per_image) == pytest.approx(row["ssim_std"], abs=1e-6)
    assert audit["lpips"] == "not computed (--no-lpips)"
    assert audit["verdict"].startswith("With p = 0.25 and one-step gradients of 2 images each on mlp / mnist")
    assert f"{count} of 4" in audit["verdict"] or (count == 0 and "none of the 4" in audit["verdict"])
    report = (audited / "audit.md").read_text()
    assert audit["verdict"] in report and "a real server has no oracle" in report and "audit_grid.png" in report


def test_a_finished_attack_run_is_reused_with_a_new_threshold(
    audited: Path, fed_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = (audited / "run.json").read_text()
    audit = json.loads((audited / "audit.json").read_text())
    best = [r["best"]["ssim_std"] for r in audit["images"]]
    threshold = round(max(best), 4)  # at least the best image counts
    assert 0 < threshold <= 1
    args = ["audit", str(fed_run), "--out", str(audited), "--threshold", str(threshold), "--quiet", "--no-lpips"]
    code, text = _run(args, capsys)
    assert code == 0, text
    assert "reusing the finished attack run" in text and (audited / "run.json").read_text() == before
    again = json.loads((audited / "audit.json").read_text())
    count = sum(b >= threshold for b in best)
    assert again["summary"]["recognisable"] == count >= 1 and again["threshold"]["value"] == threshold
    assert f"reconstructed {count} of 4 audited images recognisably ([0,1] SSIM ≥ {threshold:g}" in again["verdict"]
    # A contradicting option is refused rather than silently ignored.
    code, text = _run(["audit", str(fed_run), "--out", str(audited), "--attacks", "dia", "--no-lpips"], capsys)
    assert code == 2 and text.strip().startswith("error:") and "--attacks" in text


def test_the_verdict_names_a_fedavg_round() -> None:
    capture = Capture(
        spec=ModelSpec("mlp", "mnist", 0.25, 0, {}),
        weights={},
        kind="update",
        round=1,
        client=0,
        node_id=1,
        batch_size=1,
        num_examples=16,
        lr=0.01,
        label_policy="known",
        param_names=[],
        hyperparameters={"optimizer": "sgd", "lr": 0.01, "local-epochs": 1, "batch-size": 4},
        local_steps=4,
    )
    setting = describe_setting(capture)
    summary = {
        "images": 16,
        "recognisable": 15,
        "recognisable_by_attack": {"dia": 15},
        "server_attacks": ["ig_eval", "dia"],
        "best_ssim_std": 0.9,
        "iterations_cap": 20000,
        "oracle_bound": None,
    }
    text = verdict(setting, summary, 0.6)
    assert text.startswith("With p = 0.25 and FedAvg K = 4 SGD on mlp / mnist (no defense), DIA reconstructed 15 of 16")
    # A closed form that wins names its mechanism, its label's words kept as written (Adam, not adam).
    closed = verdict(setting, {**summary, "recognisable_by_attack": {"adam_eps": 15}}, 0.6)
    assert " The closed-form read of Adam's signs: Adam divides each entry" in closed


def test_the_setting_states_the_epsilon_the_run_spent(tmp_path: Path) -> None:
    """Under DP-SGD the report says the epsilon the clients' accountant reported (results.json)."""
    base = {"defense": "dp-sgd", "defense_short": "defense dp-sgd", "defense_text": "defense dp-sgd: the update"}
    assert with_privacy_spent(base, tmp_path) == base  # no results.json yet: the run is still going
    privacy = {
        "epsilon": 7.9915,
        "delta": 1e-5,
        "accountant": "opacus RDPAccountant (Poisson sampling)",
        "accountant_name": "opacus RDPAccountant",  # as fedsim.dp_sgd writes it: the name apart, for a sentence
    }
    (tmp_path / "results.json").write_text(json.dumps({"privacy": privacy}))
    setting = with_privacy_spent(base, tmp_path)
    assert setting["privacy"]["epsilon"] == pytest.approx(7.9915)
    assert setting["defense_short"] == "defense dp-sgd, spent ε = 7.99 at δ = 1e-05 over the run (opacus RDPAccountant)"
    (tmp_path / "results.json").write_text(json.dumps({"privacy": {**privacy, "epsilon": None}}))
    assert "no privacy guarantee" in with_privacy_spent(base, tmp_path)["defense_text"]
    none = {"defense": "none", "defense_short": "no defense", "defense_text": "no defense"}
    assert with_privacy_spent(none, tmp_path) == none


def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    fed_run: Path, audited: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    no_captures = tmp_path / "no_captures"
    no_captures.mkdir()
    shutil.copy(fed_run / "config.json", no_captures / "config.json")
    not_audited = tmp_path / "not_audited"
    shutil.copytree(fed_run, not_audited, ignore=shutil.ignore_patterns("oracle"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    fresh = tmp_path / "out"
    cases = [
        ([str(tmp_path / "missing")], "is not a folder"),
        ([str(empty)], "is not a federated run folder"),
        ([str(no_captures)], "holds no captures"),
        ([str(not_audited)], "was not audited"),
        ([str(fed_run), "--threshold", "0"], "must be in (0, 1]"),
        ([str(fed_run), "--threshold", "1.5"], "must be in (0, 1]"),
        ([str(fed_run), "--attacks", "wiig"], "a real server can run"),
        ([str(fed_run), "--attacks", "nonsense"], "unknown attack"),
    ]
    for args, message in cases:
        code, text = _run(["audit", *args, "--out", str(fresh), "--quiet", "--no-lpips"], capsys)
        assert code == 2 and message in text, (args, text)
        assert len(text.strip().splitlines()) == 1 and text.startswith("error:"), text
        assert not fresh.exists(), args
    for out, message in (
        (foreign, "is not a run folder of this tool"),
        (fed_run / "audit", "inside the federated run folder"),
    ):
        code, text = _run(["audit", str(fed_run), "--out", str(out), "--quiet"], capsys)
        assert code == 2 and message in text and len(text.strip().splitlines()) == 1, text
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"] and not (fed_run / "audit").exists()
    # An audit folder of other captures is not this audit's either.
    other = shutil.copytree(fed_run, tmp_path / "other_run")
    code, text = _run(["audit", str(other), "--out", str(audited), "--quiet"], capsys)
    assert code == 2 and "holds an attack run of other victims" in text
