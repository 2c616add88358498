"""RESULTS' deployed-settings rows: one line per cell of ``attacker experiment configs/experiments/deployed.yaml``
(its output folder OUT), each attack's SSIM (paper space), how many images it recognises ([0,1] SSIM >= 0.6,
the audit's threshold; reconstructions matched to the victims by distance) and the cell's wall seconds per
victim job and attack. Reads finished cells only; prints one markdown table.

    python benchmarks/deployed_rows.py runs/deployed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean

from cocktail_party_rows import RECOGNISABLE, per_image  # beside this script: its directory is on sys.path

ATTACKS = ("wiig", "dia", "dia_span", "dia_cf", "dia_hold")


def row(folder: Path) -> str | None:
    if not (folder / "run.json").is_file():  # a cell that failed before it ran (its failed.txt says why)
        return None
    run = json.loads((folder / "run.json").read_text())
    if run.get("status") != "finished" or not (folder / "metrics.json").is_file():
        return None
    metrics = json.loads((folder / "metrics.json").read_text())
    jobs = sorted({m["job"] for m in metrics})
    attacks = sorted({m["attack"] for m in metrics})
    closed = [a for a in attacks if a not in ATTACKS and a != "ig_eval"]  # the closed forms that applied
    cells = [] if closed else ["–"]  # none applied (an update: no closed form takes one)
    for attack in (*closed[:1], *ATTACKS):
        rows = [m for m in metrics if m["attack"] == attack]
        if not rows:
            cells.append("–")
            continue
        ssim = per_image(folder, attack)
        hit = sum(v >= RECOGNISABLE for v in ssim)
        name = f"{attack}: " if attack in closed else ""
        cells.append(f"{name}{mean(m['ssim_paper'] for m in rows):.3f} ({hit} of {len(ssim)})")
    name = folder.name.removeprefix("deployed-")
    return f"| {name} | {len(jobs)} | " + " | ".join(cells) + f" | {run['seconds'] / (len(jobs) * len(attacks)):.1f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    cells = sorted((args.out / "cells").glob("deployed-*"))
    if not cells:
        print(f"error: no deployed cells under {args.out / 'cells'}", file=sys.stderr)
        return 2
    print(
        "| cell | jobs | closed form | WIIG (oracle) | DIA | DIA in the images' span (dia_span) "
        "| DIA from the closed form (dia_cf) | DIA holding the closed form's exact images (dia_hold) "
        "| s per job and attack |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in cells:
        line = row(folder)
        if line:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
