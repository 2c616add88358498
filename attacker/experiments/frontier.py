"""The privacy-utility frontier of cells that run their own defended federation (``federation:`` with a
``defense``): what each row says about its defense (family, strength, the epsilon Flower's accountant
gives) and the figure a practitioner reads it from: accuracy against DIA's leakage, one curve per
defense family, dropout alone as its own curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from fedsim.atomic import atomic_write
from fedsim.defenses import DEFENSES, NO_DEFENSE, privacy_spent
from fedsim.run_config import resolve_config, to_run_config

from ..report import figure_png
from .spec import Cell


def defense_fields(out: Path, cell: Cell) -> dict[str, Any]:
    """The defense columns of a cell's rows (empty for a cell without its own federation)."""
    if not cell.federation:
        return {}
    settings = to_run_config(cell.federation)
    name = str(settings.get("defense", NO_DEFENSE))
    defense = DEFENSES.get(name)
    level = defense.level if defense is not None else None
    fields: dict[str, Any] = {
        "defense": name,
        "defense_level": settings.get(level) if level else None,
        "defense_knob": defense.level_name if defense is not None else "",
        "epsilon": None,
        "delta": None,
    }
    fed = out / "federations" / cell.key
    try:
        cfg = json.loads((fed / "config.json").read_text())
        res = json.loads((fed / "results.json").read_text())
    except (OSError, ValueError):
        return fields
    rounds = int(res.get("rounds_run") or 0)
    try:
        n = int(cfg["num-clients"])
        spent = privacy_spent(
            resolve_config(cfg, strict=False), rounds, max(1, int(n * float(cfg["fraction-train"]))), n
        )
    except (KeyError, ValueError):  # a federation folder from another version: no epsilon rather than no report
        return fields
    if spent:
        fields.update(epsilon=spent.get("epsilon"), delta=spent["delta"])
    return fields


def level_text(row: dict[str, Any]) -> str:
    if row.get("defense_level") is None:
        return "–"
    return f"{row['defense_knob']} {row['defense_level']:g}"


def epsilon_text(row: dict[str, Any]) -> str:
    eps = row.get("epsilon")
    if eps is None:
        return "–"
    return f"{eps:.3g} (δ {row['delta']:g})"


def frontier_figure(rows: list[dict[str, Any]], path: Path, attack: str = "dia") -> bool:
    """Accuracy (x) against the attack's SSIM (y), a panel per model and dataset. Each defense family
    is one colour; its curve at one dropout rate joins the undefended point to its three strengths.
    Dropout alone (no defense, p rising) is the black curve."""

    rows = [
        r
        for r in rows
        if r.get("defense")
        and r["attack"] == attack
        and r.get("ssim_paper_mean") is not None
        and r.get("accuracy_final") is not None
    ]
    panels = sorted({(r["model"], r["dataset"]) for r in rows})
    if not panels:
        return False
    markers = {0.0: "o", 0.25: "s", 0.5: "^", 0.75: "D"}
    fig = Figure(figsize=(5.6 * len(panels), 4.4))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (model, dataset) in zip(axes[0], panels):
        prow = [r for r in rows if (r["model"], r["dataset"]) == (model, dataset)]
        base = {r["p"]: r for r in prow if r["defense"] == NO_DEFENSE}
        alone = sorted(base.values(), key=lambda r: r["p"])
        if alone:
            ax.plot(
                [r["accuracy_final"] for r in alone],
                [r["ssim_paper_mean"] for r in alone],
                color="black",
                lw=2,
                label="dropout alone (p ↑)",
            )
        for i, defense in enumerate(d for d in DEFENSES.values() if d.level is not None):
            color = f"C{i}"
            for p in sorted({r["p"] for r in prow if r["defense"] == defense.name}):
                pts = sorted(
                    (r for r in prow if r["defense"] == defense.name and r["p"] == p),
                    key=lambda r: r["defense_level"],
                    reverse=defense.stronger_when_smaller,
                )  # weakest first
                pts = ([base[p]] if p in base else []) + pts
                ax.plot(
                    [r["accuracy_final"] for r in pts],
                    [r["ssim_paper_mean"] for r in pts],
                    color=color,
                    marker=markers.get(p, "x"),
                    ms=5,
                    alpha=0.85,
                    label=defense.family if p == min(r["p"] for r in prow if r["defense"] == defense.name) else None,
                )
                for r in pts[1:]:
                    ax.annotate(
                        f"{r['defense_level']:g}",
                        (r["accuracy_final"], r["ssim_paper_mean"]),
                        fontsize=6,
                        xytext=(3, 2),
                        textcoords="offset points",
                        color=color,
                    )
        for p, m in markers.items():
            if p in {r["p"] for r in prow}:
                ax.plot([], [], color="gray", marker=m, ls="", label=f"p = {p:g}")
        ax.set_xlabel("test accuracy after the training rounds (%)")
        ax.set_ylabel(f"{attack.upper()} SSIM (paper space) on the audited round")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.set_title(f"{model} / {dataset}", fontsize=9)
        ax.legend(fontsize=6, loc="best")
    fig.suptitle("Privacy-utility frontier: lower right is better for the defender", fontsize=9)
    fig.tight_layout()
    atomic_write(path, figure_png(fig, trim=False))
    return True
