"""The privacy-utility measures: epsilon from Flower's accountant (fedsim.defenses.privacy_spent),
the Relative Data Leakage Value (attacker.scoring), and the frontier's table columns and figure
(attacker.experiments.frontier)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from attacker.experiments.frontier import (
    build_frontier,
    defense_fields,
    epsilon_text,
    family_points,
    frontier_figure,
    level_text,
)
from attacker.experiments.spec import Cell
from attacker.jobs import Oracle
from attacker.metrics import score_batch
from attacker.scoring import _key, prior_images, prior_score, rdlv
from fedsim.data import get_spec
from fedsim.defenses import privacy_spent
from fedsim.run_config import resolve_config


def _eps(defense: str, rounds: int, **settings: float) -> float | None:
    spent = privacy_spent(resolve_config({"defense": defense, **settings}), rounds, 8, 8)
    return None if spent is None else spent["epsilon"]


def test_more_noise_spends_less_and_more_rounds_spend_more() -> None:
    central = [_eps("central-dp-server-clipping", 3, noise_multiplier=z) for z in (0.5, 1.0, 2.0)]
    assert all(e is not None and e > 0 for e in central)
    assert central[0] > central[1] > central[2]
    assert _eps("central-dp-client-clipping", 1, noise_multiplier=1.0) < _eps(
        "central-dp-client-clipping", 5, noise_multiplier=1.0
    )
    local = [_eps("local-dp", 3, dp_epsilon=e) for e in (1.0, 10.0)]
    assert local[0] < local[1]  # a smaller per-round epsilon: more noise, less spent in all
    assert _eps("none", 3) is None and _eps("prune", 3) is None  # no noise, no guarantee


def test_local_dp_states_its_per_round_budget() -> None:
    spent = privacy_spent(resolve_config({"defense": "local-dp", "dp_epsilon": 2.0, "dp_delta": 1e-6}), 4, 8, 8)
    assert spent["per_round"] == {"epsilon": 2.0, "delta": 1e-6}
    assert spent["guarantee"] == "client" and spent["rounds"] == 4


def test_prior_is_the_mean_of_the_other_victims_and_rdlv_measures_the_gain() -> None:
    torch.manual_seed(0)
    spec = get_spec("mnist")
    images = [torch.randn(1, 1, 28, 28) for _ in range(3)]
    oracles = [Oracle(images=im, masks=()) for im in images] + [None, Oracle(images=images[0].clone(), masks=())]
    prior = prior_images(oracles)
    assert len(prior) == 3  # one per distinct victim batch: an attack repeated on a batch counts once
    assert torch.allclose(prior[_key(images[0])], (images[1] + images[2]) / 2)  # leave-one-out mean
    assert torch.allclose(prior[_key(images[2])], (images[0] + images[1]) / 2)
    key0 = _key(images[0])
    base = score_batch(images[0], prior[key0].expand_as(images[0]), spec.mean, spec.std, match=False)["metrics"][
        "ssim_paper"
    ]["mean"]
    assert prior_score(images[0], prior[key0], spec.mean, spec.std) == pytest.approx(base)
    assert rdlv(1.0, base) == pytest.approx((1.0 - base) / base)
    assert rdlv(base, base) == pytest.approx(0.0, abs=1e-9)
    assert rdlv(0.5, None) is None and rdlv(0.5, 0.0) is None
    assert prior_images(oracles[:1]) == {}  # one victim batch: no prior without using the victim itself


def _cell(defense: dict) -> Cell:
    return Cell(
        experiment="defenses",
        id="c",
        model="mlp",
        dataset="mnist",
        p=0.25,
        victim_batch_size=1,
        attacks=["dia"],
        federation=defense,
    )


def test_defense_columns_read_the_federations_config(tmp_path: Path) -> None:
    cell = _cell({"defense": "central-dp-server-clipping", "noise_multiplier": 1.0, "clip_norm": 0.5})
    fed = tmp_path / "federations" / cell.key
    fed.mkdir(parents=True)
    cfg = resolve_config({"defense": "central-dp-server-clipping", "noise-multiplier": 1.0, "num-clients": 8})
    (fed / "config.json").write_text(json.dumps(cfg))
    (fed / "results.json").write_text(json.dumps({"rounds_run": 4, "rounds": []}))
    fields = defense_fields(tmp_path, cell)
    assert fields["defense"] == "central-dp-server-clipping" and fields["defense_level"] == 1.0
    assert fields["epsilon"] == pytest.approx(privacy_spent(cfg, 4, 8, 8)["epsilon"])
    assert defense_fields(tmp_path, _cell({})) == {}  # a cell without its own federation has no defense columns
    missing = defense_fields(tmp_path / "nowhere", cell)
    assert missing["epsilon"] is None  # not run yet: the columns, without figures


def _row(defense: str, level: float | None, p: float, ssim: float, acc: float, experiment: str = "defenses") -> dict:
    return {
        "experiment": experiment,
        "defense": defense,
        "defense_level": level,
        "attack": "dia",
        "model": "mlp",
        "dataset": "mnist",
        "p": p,
        "ssim_paper_mean": ssim,
        "accuracy_final": acc,
    }


def _frontier_rows() -> list[dict]:
    rows = []
    for p in (0.0, 0.25, 0.5):
        rows.append(_row("none", None, p, 0.99 - p, 90.0 - 10 * p))
        rows.append(_row("none", None, p, 0.7 - p, 90.0 - 10 * p, experiment="dp_sgd"))  # its own audited round
        for family, levels in (("local-dp", (10.0, 100.0, 1000.0)), ("prune", (0.5, 0.1, 0.01))):
            for i, level in enumerate(levels):
                rows.append(_row(family, level, p, 0.2 + 0.2 * i + p / 10, 60.0 + 10 * i - p))
        for i, eps in enumerate((1.0, 8.0, math.inf, 3.0)):  # any order in: sorted by strength
            rows.append(_row("dp-sgd", eps, p, 0.1 * i, 70.0 - p, experiment="dp_sgd"))
    return rows


def test_family_points_run_from_the_own_undefended_cell_weakest_to_strongest() -> None:
    panel = [r for r in _frontier_rows() if r["p"] == 0.25]
    dp = family_points(panel, "dp-sgd")
    assert [r["defense_level"] for r in dp] == [None, math.inf, 8.0, 3.0, 1.0]
    assert dp[0]["defense"] == "none" and dp[0]["experiment"] == "dp_sgd"  # not the one-step frontier's
    assert [r["defense_level"] for r in family_points(panel, "prune")] == [None, 0.5, 0.1, 0.01]
    assert [r["defense_level"] for r in family_points(panel, "local-dp")] == [None, 1000.0, 100.0, 10.0]
    assert family_points(panel, "prune")[0]["experiment"] == "defenses"


def test_frontier_figure_has_one_panel_per_p_and_never_joins_across_p(tmp_path: Path) -> None:
    rows = _frontier_rows()
    fig = build_frontier(rows)
    assert fig is not None
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [f"mlp / mnist, p = {p:g}" for p in (0, 0.25, 0.5)]
    for ax, p in zip(panels, (0.0, 0.25, 0.5)):
        own = {(r["accuracy_final"], r["ssim_paper_mean"]) for r in rows if r["p"] == p}
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]
        assert len(curves) == 3  # local DP, pruning, DP-SGD: one curve each
        for line in ax.get_lines():
            assert set(zip(line.get_xdata(), line.get_ydata())) <= own  # only this p's points
    path = tmp_path / "f.png"
    assert frontier_figure(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not frontier_figure([dict(r, accuracy_final=None) for r in rows], tmp_path / "g.png")  # nothing measured
    assert not (tmp_path / "g.png").exists()


def test_dp_sgd_columns_read_the_clients_accountant(tmp_path: Path) -> None:
    target = _cell({"defense": "dp-sgd", "dp_noise_from": "epsilon", "dp_epsilon": 8.0, "clip_norm": 2.2})
    clip_only = _cell({"defense": "dp-sgd", "dp_noise_from": "none", "clip_norm": 2.2})
    clip_only.id = "d"
    before = defense_fields(tmp_path, target)  # not run yet: the level, no epsilon
    assert before["defense_level"] == 8.0 and before["epsilon"] is None
    assert defense_fields(tmp_path, clip_only)["defense_level"] == math.inf
    for cell, eps in ((target, 7.995), (clip_only, math.inf)):
        fed = tmp_path / "federations" / cell.key
        fed.mkdir(parents=True)
        (fed / "config.json").write_text(json.dumps(resolve_config({"defense": "dp-sgd"})))
        privacy = {"defense": "dp-sgd", "delta": 1e-5, "epsilon": eps}
        (fed / "results.json").write_text(json.dumps({"rounds_run": 4, "privacy": privacy}))
    fields = defense_fields(tmp_path, target)
    assert fields["epsilon"] == 7.995 and fields["delta"] == 1e-5 and fields["defense_knob"] == "ε total"
    assert epsilon_text(fields) == "8 (δ 1e-05)" and level_text(fields) == "ε total 8"
    fields = defense_fields(tmp_path, clip_only)
    assert fields["epsilon"] == math.inf and epsilon_text(fields) == "∞ (no noise)"
    assert level_text(fields) == "ε total ∞"
