"""The privacy-utility frontier of cells that run their own defended federation (``federation:`` with a
``defense``): what each row says about its defense (family, strength, the epsilon its accountant
gives) and the figure a practitioner reads it from: accuracy against DIA's leakage, one panel per
dropout rate, one curve per defense family from its undefended cell to its strongest level."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from fedsim.atomic import atomic_write
from fedsim.defenses import DEFENSES, NO_DEFENSE, privacy_spent
from fedsim.run_config import DEFAULTS, resolve_config, to_run_config

from ..report import figure_png
from .spec import Cell


def defense_fields(out: Path, cell: Cell) -> dict[str, Any]:
    """The defense columns of a cell's rows (empty for a cell without its own federation). Under
    dp-sgd the strength is the target ε (∞ with clipping only) and the ε is the one the clients'
    Opacus accountant reported (results.json's ``privacy``); for the other defenses Flower's
    accountant composes the rounds here (fedsim.defenses.privacy_spent)."""
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
    dp_sgd = defense is not None and defense.in_local_round
    if dp_sgd:
        source = str(settings.get("dp-noise-from", DEFAULTS["dp-noise-from"]))
        if source == "none":
            fields["defense_level"] = math.inf  # clipping only: no noise, no guarantee
        elif source == "epsilon":
            fields["defense_level"] = float(settings.get("dp-epsilon", DEFAULTS["dp-epsilon"]))
        else:
            fields["defense_level"] = None  # a fixed noise multiplier: its epsilon is the reported one
    fed = out / "federations" / cell.key
    try:
        cfg = json.loads((fed / "config.json").read_text())
        res = json.loads((fed / "results.json").read_text())
    except (OSError, ValueError):
        return fields
    if dp_sgd:
        privacy = res.get("privacy") or {}
        if privacy.get("epsilon") is not None:
            fields.update(epsilon=float(privacy["epsilon"]), delta=float(privacy["delta"]))
            if fields["defense_level"] is None:
                fields["defense_level"] = fields["epsilon"]
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


def _num(value: float) -> str:
    return "∞" if value == math.inf else f"{value:g}"


def level_text(row: dict[str, Any]) -> str:
    if row.get("defense_level") is None:
        return "–"
    return f"{row['defense_knob']} {_num(row['defense_level'])}"


def epsilon_text(row: dict[str, Any]) -> str:
    eps = row.get("epsilon")
    if eps is None:
        return "–"
    if eps == math.inf:
        return "∞ (no noise)"
    return f"{eps:.3g} (δ {row['delta']:g})"


def family_points(rows: list[dict[str, Any]], defense_name: str) -> list[dict[str, Any]]:
    """One family's points of one panel (one model, dataset and p), in order of strength: the
    undefended cell of the same experiment first (the family's own reference: an experiment's cells
    share their audited round), then the defended cells from the weakest to the strongest."""
    defense = DEFENSES[defense_name]
    pts = sorted(
        (r for r in rows if r["defense"] == defense_name and r.get("defense_level") is not None),
        key=lambda r: r["defense_level"],
        reverse=defense.stronger_when_smaller,
    )  # weakest first
    experiments = {r.get("experiment", "") for r in pts}
    bases = [r for r in rows if r["defense"] == NO_DEFENSE and r.get("experiment", "") in experiments]
    return bases[:1] + pts


def frontier_figure(rows: list[dict[str, Any]], path: Path, attack: str = "dia") -> bool:
    """Write :func:`build_frontier`'s figure to ``path`` (a PNG); False (nothing written) when no row
    has both an accuracy and the attack's SSIM."""
    fig = build_frontier(rows, attack)
    if fig is None:
        return False
    atomic_write(path, figure_png(fig, trim=False))
    return True


def build_frontier(rows: list[dict[str, Any]], attack: str = "dia") -> Figure | None:
    """Accuracy (x) against the attack's SSIM (y): one panel per dropout rate p (a row of panels per
    model and dataset). In each panel every defense family is one colour, its points joined in order
    of strength, from the family's undefended cell (black) to its strongest level; the levels are
    written beside the points. Families never join points across p, so their lines do not cross
    from one dropout rate to another."""

    rows = [
        r
        for r in rows
        if r.get("defense")
        and r["attack"] == attack
        and r.get("ssim_paper_mean") is not None
        and r.get("accuracy_final") is not None
    ]
    models = sorted({(r["model"], r["dataset"]) for r in rows})
    ps = sorted({float(r["p"]) for r in rows})
    if not models:
        return None
    fig = Figure(figsize=(4.3 * len(ps), 3.9 * len(models) + 0.6))
    axes = fig.subplots(len(models), len(ps), squeeze=False, sharey=True)
    families = [d for d in DEFENSES.values() if d.level is not None]
    experiments = sorted({r.get("experiment", "") for r in rows if r["defense"] == NO_DEFENSE}) or [""]
    colors = {d.name: f"C{i}" for i, d in enumerate(families)}
    handles: dict[str, Any] = {}
    for axrow, (model, dataset) in zip(axes, models):
        for ax, p in zip(axrow, ps):
            prow = [r for r in rows if (r["model"], r["dataset"]) == (model, dataset) and float(r["p"]) == p]
            for base in (r for r in prow if r["defense"] == NO_DEFENSE):
                # Experiments differ in their audited round: each one's undefended cell is its own point.
                exp = base.get("experiment", "")
                fill = "black" if exp == experiments[0] else "white"
                (h,) = ax.plot(
                    [base["accuracy_final"]], [base["ssim_paper_mean"]], "o", color="black", mfc=fill, ms=7, zorder=3
                )
                label = "no defense (dropout alone)" + (f", {exp}" if len(experiments) > 1 else "")
                handles.setdefault(label, h)
            for defense in families:
                pts = family_points(prow, defense.name)
                if not any(r["defense"] == defense.name for r in pts):
                    continue
                color = colors[defense.name]
                (h,) = ax.plot(
                    [r["accuracy_final"] for r in pts],
                    [r["ssim_paper_mean"] for r in pts],
                    color=color,
                    marker="o",
                    ms=4,
                    alpha=0.85,
                )
                handles.setdefault(f"{defense.family} ({defense.level_name}; weak → strong)", h)
                for r in pts:
                    if r["defense"] == NO_DEFENSE:
                        continue
                    ax.annotate(
                        _num(r["defense_level"]),
                        (r["accuracy_final"], r["ssim_paper_mean"]),
                        fontsize=6,
                        xytext=(3, 2),
                        textcoords="offset points",
                        color=color,
                    )
            ax.set_xlabel("test accuracy after the training rounds (%)", fontsize=8)
            if ax is axrow[0]:
                ax.set_ylabel(f"{attack.upper()} SSIM (paper space), audited round", fontsize=8)
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
            ax.set_title(f"{model} / {dataset}, p = {p:g}", fontsize=9)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(3, len(handles)), fontsize=7)
    fig.suptitle("Privacy-utility frontier: lower right is better for the defender", fontsize=9)
    legend_rows = math.ceil(len(handles) / 3)
    fig.tight_layout(rect=(0, (0.1 + 0.2 * legend_rows) / fig.get_figheight(), 1, 0.96))
    return fig
