"""The audit in words: the verdict paragraph and the markdown report (from the audit's JSON form)."""

from __future__ import annotations

from typing import Any

from fedsim.defenses import NO_DEFENSE

from ..closed_form.solvers import SOLVERS
from ..report import fmt_mean_std

GRID_FILE = "audit_grid.png"
LABELS = {
    "ig_eval": "IG",
    "ig_train": "IG (train)",
    "wiig": "WIIG",
    "dia": "DIA",
    "april": "APRIL",
    "dia_april": "DIA+APRIL",
    "dia_onestep": "DIA on Δ/(lr·K)",
    "dia_span": "DIA in the images' span",
    "dia_cf": "DIA from the closed form",
    "dia_hold": "DIA holding the closed form's exact images",
    "dia_multistart": "DIA from four starts",
    "vit_patches": "the closed-form patch solve",
    "first_linear": "the closed-form first-Linear solve",
    "dark_background": "the separation by dark background",
    "adam_eps": "the closed-form read of Adam's signs",
}


def label(attack: str) -> str:
    return LABELS.get(attack, attack)


def _listing(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def verdict(setting: dict[str, Any], summary: dict[str, Any], threshold: float) -> str:
    """The audit's outcome in plain words: who reconstructed how many images, in which setting."""
    n, k = summary["images"], summary["recognisable"]
    server = _listing([label(a) for a in summary["server_attacks"]])
    where = (
        f"With p = {setting['p']:g} and {setting['capture']} on {setting['model']} / {setting['dataset']} "
        f"({setting['defense_short']})"
    )
    rule = f"[0,1] SSIM ≥ {threshold:g}"
    protection = f"Dropout at p = {setting['p']:g}" if setting["p"] else "Training without dropout (p = 0)"
    if setting["defense"] != NO_DEFENSE:
        protection += f" with {setting['defense_short']}"
    if k:
        winners = summary["recognisable_by_attack"]
        who = (
            label(next(iter(winners)))
            if len(winners) == 1
            else f"{_listing([label(a) for a in winners])} together "
            f"({', '.join(f'{label(a)} {c}' for a, c in winners.items())})"
        )
        text = (
            f"{where}, {who} reconstructed {k} of {n} audited images recognisably ({rule}; "
            f"{100 * k / n:.0f} %), from the captures alone, as the curious server can. "
            f"{protection} does not protect these clients' images."
        )
        for name in winners:  # a closed form names its mechanism: what in the gradient gives the image away
            if name in SOLVERS:
                named = label(name)
                text += f" {named[:1].upper()}{named[1:]}: {SOLVERS[name].mechanism}."  # keeps "Adam's" as written
    else:
        best = summary["best_ssim_std"]
        reached = f"; the best image reached [0,1] SSIM {best:.2f}" if best is not None else ""
        text = (
            f"{where}, {server} reconstructed none of the {n} audited images recognisably ({rule}{reached}). "
            f"That is what these attacks achieved with up to "
            f"{summary['iterations_cap']:,} iterations per job, not a guarantee: longer or stronger attacks, "
            "or a lower threshold, may find more."
        )
        solvers = [a for a in summary.get("closed_forms_skipped", []) if a in SOLVERS]
        if solvers and not any(a in SOLVERS for a in summary["server_attacks"]):
            text += f" No closed-form attack applies ({', '.join(solvers)}: see the report)."
    bound = summary.get("oracle_bound")
    if bound:
        text += (
            f" {label(bound['attack'])}, which replays the clients' true dropout masks from the audit's oracle, "
            f"reconstructed {bound['recognisable']} of {bound['images']} recognisably: the optimization's bound, "
            "reported apart because a real server has no oracle."
        )
    return text


def _cell(value: float | None, digits: int = 3) -> str:
    return fmt_mean_std(value, None, digits)


def markdown(audit: dict[str, Any]) -> str:
    s, summary, thr = audit["setting"], audit["summary"], audit["threshold"]["value"]
    bound = summary.get("oracle_bound")
    head = (
        "| round | client | images | best attack | SSIM (paper space) | SSIM ([0,1]) | SSIM (min-max) | RDLV | LPIPS "
        f"| recognisable (≥ {thr:g}) |"
    )
    if bound:
        head += f" {label(bound['attack'])} SSIM [0,1] (oracle) | recognisable |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in audit["clients"]:
        best = ", ".join(f"{label(a)} ({n})" if c["images"] > 1 else label(a) for a, n in c["best_attacks"].items())
        row = (
            f"| {c['round']} | {c['client']} | {c['images']} | {best} | {_cell(c['ssim_paper'])} | "
            f"{_cell(c['ssim_std'])} | {_cell(c['ssim_minmax'])} | {_cell(c['rdlv'], 2)} | {_cell(c['lpips'])} | "
            f"{c['recognisable']} of {c['images']} |"
        )
        if bound:
            o = c["oracle"] or {}
            row += f" {_cell(o.get('ssim_std'))} | {o.get('recognisable', 0)} of {c['images']} |"
        lines.append(row)
    unscored = (
        f"\n{len(audit['unscored'])} client-round(s) without an oracle record were not scored: "
        f"{', '.join(audit['unscored'])}.\n"
        if audit["unscored"]
        else ""
    )
    server = _listing([label(a) for a in summary["server_attacks"]])
    alone = ""
    if len(summary["server_attacks"]) > 1:
        alone = " (each alone: " + ", ".join(f"{label(a)} {n}" for a, n in summary["recognisable_alone"].items()) + ")"
    oracle_line = (
        f"{label(bound['attack'])} (the optimization's bound with the oracle: it replays the clients' true "
        "dropout masks, which only this simulation's audit mode recorded; a real server has no oracle, so it "
        "never counts as the best attack and is reported apart)"
        if bound
        else "no oracle attack"
    )
    skipped_lines = "".join(f"\n- Skipped: {reason}." for reason in audit.get("closed_forms_skipped", {}).values())
    return f"""# Gradient-leakage audit of `{audit["run_dir"]}`

{audit["verdict"]}

## Setting (from the captures' records)

- Model: {s["model"]} on {s["dataset"]}, dropout p = {s["p"]:g}.
- What the curious server captured: {s["capture_text"]}; {summary["clients_rounds"]} client-round(s), \
{summary["images"]} image(s) audited.
- Defense: {s["defense_text"]}.
- Attacks: {server}, which need only the captures (the best of them per image counts), and {oracle_line}. \
Up to {summary["iterations_cap"]:,} iterations per job, attack profile {audit["profile"]}; every attack's own \
table, grid and curves: [report.md](report.md).
- Recognisable: [0,1] SSIM ≥ {thr:g} (`--threshold`): {summary["recognisable"]} of {summary["images"]} \
({100 * summary["fraction"]:.0f} %) by the best attack per image{alone}.
- LPIPS: {audit["lpips"]}.{skipped_lines}

## Per client and round (the best attack per image)

{chr(10).join(lines)}
{unscored}
SSIM in *paper space* is computed on normalized tensors (data range 1/std, the space of the paper's
tables), *[0,1]* on images mapped back to [0,1], *min-max* on each image scaled by its own range.
RDLV: the gain in paper-space SSIM over a prior (the mean image of the run's other clients), relative
to the prior's; "–" with a single client-round. Per image and per attack: `audit.json`.

## Originals against reconstructions

![originals (top row), the best reconstruction per image, the oracle's bound]({GRID_FILE})
"""
