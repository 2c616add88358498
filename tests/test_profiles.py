"""Attack settings per model family as data (attacker.profiles): the paper's profile, the measured one,
their fall-backs, the user's overrides over both, and bad entries refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attacker.attacks import AttackConfigError, make_attack
from attacker.cli import main as attacker_main
from attacker.config import parse_config
from attacker.profiles import PROFILES, ProfileError, profile_settings
from fedsim.models import ModelSpec


def test_paper_profile_is_the_papers_tv_per_family() -> None:
    assert profile_settings("paper", "mlp")["tv_weight"] == 1e-5
    assert profile_settings("paper", "vit_b16")["tv_weight"] == 1e-5  # the ViT family
    assert profile_settings("paper", "lenet", "cifar10")["tv_weight"] == 1e-2
    assert profile_settings("paper", "resnet18", "mnist")["tv_weight"] == 1e-2


def test_strong_falls_back_to_paper_and_a_dataset_entry_lies_over_its_family(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PROFILES, "strong", {"lenet": {"lr": 1.0, "tv_weight": 0.1}, "lenet:mnist": {"lr": 0.5}})
    assert profile_settings("strong", "mlp") == profile_settings("paper", "mlp")  # not measured: paper's
    assert profile_settings("strong", "lenet", "cifar10") == {"tv_weight": 0.1, "lr": 1.0}
    assert profile_settings("strong", "lenet", "mnist") == {"tv_weight": 0.1, "lr": 0.5}


def test_the_users_overrides_win_over_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PROFILES, "strong", {"mlp": {"lr": 1.0, "tv_weight": 0.1}})
    cfg = parse_config({"profile": "strong", "attack_overrides": {"lr": 0.3}})
    attack = cfg.for_model(make_attack("dia", lr=0.3), ModelSpec("mlp", "mnist", 0.25))
    assert attack.lr == 0.3 and attack.tv_weight == 0.1


def test_bad_profiles_and_entries_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ProfileError, match="unknown attack profile 'fast'; choose from paper, strong"):
        profile_settings("fast", "mlp")
    monkeypatch.setitem(PROFILES, "strong", {"mlp": {"learning_rate": 1.0}})
    with pytest.raises(ProfileError, match=r"entry mlp: unknown setting\(s\) \['learning_rate'\]"):
        profile_settings("strong", "mlp")
    monkeypatch.setitem(PROFILES, "strong", {"mlp": {"lr": -1.0}})
    cfg = parse_config({"profile": "strong"})
    with pytest.raises(AttackConfigError, match="lr must be positive"):
        cfg.for_model(make_attack("dia"), ModelSpec("mlp", "mnist", 0.25))
    monkeypatch.setitem(PROFILES, "strong", {"mlp": {"tv_weight": -0.1}})
    with pytest.raises(AttackConfigError, match="tv_weight must be >= 0"):
        cfg.for_model(make_attack("dia"), ModelSpec("mlp", "mnist", 0.25))


def test_every_result_says_which_profile_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("profile: fast\nvictims: {count: 1}\n")
    assert attacker_main(["run", str(config), "--out", str(tmp_path / "bad"), "--quiet"]) == 2
    out = capsys.readouterr().out
    assert "unknown attack profile 'fast'" in out and out.count("\n") == 1 and not (tmp_path / "bad").exists()
    args = ["run", "--victims", "1", "--attacks", "dia", "--iterations", "2", "--no-lpips", "--quiet"]
    assert attacker_main([*args, "--profile", "strong", "--out", str(tmp_path / "run")]) == 0
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [r["profile"] for r in rows] == ["strong"]
    assert "profile strong" in (tmp_path / "run" / "report.md").read_text()


def test_multistep_schedule_steps_at_three_eighths_five_eighths_seven_eighths() -> None:
    from attacker.engine.job_adam import SCHEDULES

    attack = make_attack("dia", schedule="multistep", lr=1.0, max_iterations=800, plateau_factor=0.1)
    lrs = [SCHEDULES["multistep"](1.0, 0.0, 0, 0.5, it, attack)[0] for it in (0, 298, 299, 499, 699, 799)]
    assert lrs == pytest.approx([1.0, 1.0, 0.1, 0.01, 0.001, 0.001])
    with pytest.raises(AttackConfigError, match="schedule must be one of"):
        make_attack("dia", schedule="cosine")
    with pytest.raises(AttackConfigError, match="restarts must be a positive integer"):
        make_attack("dia", restarts=0)


def test_restarts_run_together_and_the_lowest_loss_is_kept(tmp_path: Path) -> None:
    """Two starts per victim in one batched optimization; each victim's result is the start with the
    lower loss, under the victim's own job id (chosen by loss, never by the ground truth)."""
    from attacker.jobs import JobResult
    from attacker.pipeline import Pairs, run_attack

    pairs = Pairs(scoring_jobs=[type("J", (), {"job_id": "v0"})()], origin=[0, 0])
    picked = pairs.best_of_restarts(
        [
            JobResult("v0", "dia", None, None, 0.5, 1, 2, "max_iterations", 1),
            JobResult("v0+restart1", "dia", None, None, 0.2, 1, 2, "max_iterations", 1),
        ]
    )
    assert [(r.job_id, r.best_loss) for r in picked] == [("v0", 0.2)]
    cfg = parse_config(
        {
            "victims": {"count": 2},
            "attacks": ["dia"],
            "lpips": False,
            "attack_overrides": {"restarts": 2, "max_iterations": 3},
        }
    )
    result = run_attack(cfg, tmp_path / "run", progress=False, log=lambda m: None)
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(rows) == 2 and all(r["iterations"] == 3 for r in rows)  # one row per victim, not per start
    assert all("+restart" not in r["job"] for r in rows) and len({r["job"] for r in rows}) == 2
    assert len(result["rows"]) == 2


def test_the_multistart_preset_runs_four_starts_per_victim_and_reports_each_victim_once(tmp_path: Path) -> None:
    from attacker.attacks import make_attack
    from attacker.pipeline import run_attack

    assert make_attack("dia_multistart").restarts == 4 and make_attack("dia_multistart", restarts=2).restarts == 2
    cfg = parse_config(
        {
            "victims": {"count": 2},
            "attacks": ["dia_multistart"],
            "lpips": False,
            "attack_overrides": {"max_iterations": 3},
        }
    )
    said: list[str] = []
    run_attack(cfg, tmp_path / "run", progress=False, log=said.append)
    assert any(m.startswith("8 victim jobs") for m in said), said  # 2 victims x 4 starts, optimized together
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert sorted(r["job"] for r in rows) == ["victim000", "victim001"] and {r["attack"] for r in rows} == {
        "dia_multistart"
    }
