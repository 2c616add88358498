"""A pinned cell of the results pages reproduces under the `paper` profile: the engine, the profile's
settings and the scoring have not drifted. docs/results/ssim_spaces.md ("Which SSIM the paper used"): Table 1's MLP on
MNIST, p = 0.25, IG (eval), 8 paper victims, cap 2,000 gave SSIM 0.396 / 0.380 / 0.379 (paper space /
[0,1] / min-max)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attacker.config import parse_config
from attacker.pipeline import run_attack

from .conftest import ROOT, paper_victims_or_skip


def test_table1_mlp_mnist_ig_cell_reproduces_to_two_decimals(tmp_path: Path) -> None:
    paper_victims_or_skip("mnist")
    cfg = parse_config(
        {
            "victims": {
                "source": "paper",
                "model": "mlp",
                "dataset": "mnist",
                "p": 0.25,
                "count": 8,
                "data_root": str(ROOT / "data"),
            },
            "attacks": ["ig_eval"],
            "attack_overrides": {"max_iterations": 2000},
            "profile": "paper",
            "lpips": False,
            "device": "cpu",
        }
    )
    result = run_attack(cfg, tmp_path / "run", progress=False, log=lambda m: None)
    (entry,) = result["summary"]
    assert (entry["victims"], entry["profile"]) == (8, "paper")
    measured = [round(entry[f"{space}_mean"], 2) for space in ("ssim_paper", "ssim_std", "ssim_minmax")]
    assert measured == pytest.approx([0.40, 0.38, 0.38], abs=1e-9)
