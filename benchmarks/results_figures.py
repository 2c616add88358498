"""Draw RESULTS.md's summary figures from the tables of the committed results pages.

Every number comes from a markdown table of docs/results/*.md (or docs/performance.md for the speed
figure), each printed there beside the command that measured it; nothing is re-run. A table is found
by the names of its columns (and the heading above it), so prose edits around it do not matter; a
table that is missing or lost a column is an error naming the page and the columns looked for.

usage: python benchmarks/results_figures.py [--pages docs/results] [--out docs/results] [NAME ...]
  NAME: one of the figures (default: all); each is written as OUT/summary_NAME.png.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

DPI = 100
PAPER_STYLE = {"linestyle": "--", "alpha": 0.7}
NUMBER = re.compile(r"[−-]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[−-]?\d+)?")


@dataclass
class Table:
    """One markdown table: its header, rows (cells stripped) and the heading it sits under."""

    page: str
    section: str
    header: list[str]
    rows: list[list[str]]

    def col(self, name: str) -> int:
        for i, h in enumerate(self.header):
            if h.lower().startswith(name.lower()):
                return i
        raise LookupError(f"{self.page}: table under {self.section!r} has no column {name!r} ({self.header})")

    def get(self, row: list[str], name: str) -> str:
        return row[self.col(name)]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_tables(path: Path) -> list[Table]:
    """The tables of a markdown page; a table without a header row (rows only) is kept with header []."""
    out: list[Table] = []
    section = ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if not line.startswith("|"):
            i += 1
            continue
        block = []
        while i < len(lines) and lines[i].strip().startswith("|"):
            block.append(cells(lines[i]))
            i += 1
        if len(block) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in block[1]):
            out.append(Table(path.name, section, block[0], block[2:]))
        else:
            out.append(Table(path.name, section, [], block))
    return out


class Pages:
    def __init__(self, root: Path, performance: Path) -> None:
        self.root = root
        self.performance = performance
        self._cache: dict[str, list[Table]] = {}

    def tables(self, page: str) -> list[Table]:
        if page not in self._cache:
            path = self.performance if page == "performance.md" else self.root / page
            if not path.is_file():
                raise LookupError(f"{path}: no such results page")
            self._cache[page] = parse_tables(path)
        return self._cache[page]

    def find(self, page: str, *columns: str, section: str = "", nth: int = 0) -> Table:
        """The nth table of a page whose header starts cells with all ``columns`` (and, if given, whose
        heading contains ``section``)."""
        found = []
        for t in self.tables(page):
            if section and section.lower() not in t.section.lower():
                continue
            try:
                for c in columns:
                    t.col(c)
            except LookupError:
                continue
            found.append(t)
        if len(found) <= nth:
            raise LookupError(f"{page}: no table (#{nth + 1}) with columns {list(columns)} under {section!r}")
        return found[nth]


def has(t: Table, *columns: str) -> bool:
    return all(c in t.header for c in columns)


def num(cell: str) -> float:
    """The first number of a cell ("0.933 / 0.834", "**0.082**", "−0.64", "1,049"), NaN if none."""
    m = NUMBER.search(cell.replace("*", ""))
    if not m:
        return math.nan
    return float(m.group(0).replace("−", "-").replace(",", ""))


def pairs(cell: str) -> tuple[int, int]:
    """ "5 of 8 (7 of 8)" -> (5, 8): the first "k of n"."""
    m = re.search(r"(\d+) of (\d+)", cell)
    if not m:
        raise ValueError(f"no 'k of n' in {cell!r}")
    return int(m.group(1)), int(m.group(2))


def log_ticks(ax, ticks: list[int]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def finish(fig: Figure, axes, title: str) -> Figure:
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# ---- the paper-table cells, shared by the headline and the differences figures ----------------------


def paper_cells(pg: Pages) -> list[dict]:
    """Every cell measured against a paper value: model, data, attack, the varied knob, ours, paper.
    The first occurrence of a cell is kept (the capped runs come before the longer single cells)."""
    out: list[dict] = []
    seen: set[tuple] = set()

    def add(model: str, data: str, attack: str, knob: str, ours: float, paper: float, source: str) -> None:
        key = (model, data, attack, knob)
        if key in seen or math.isnan(ours) or math.isnan(paper):
            return
        seen.add(key)
        out.append(dict(model=model, data=data, attack=attack, knob=knob, ours=ours, paper=paper, source=source))

    def attack_name(a: str) -> str:
        return {"ig_eval": "IG (eval)", "wiig": "WIIG", "dia": "DIA"}.get(a, a)

    for page in ("table1_mlp.md", "fig5a.md", "table1_vit.md", "table2_resnet18.md", "table3.md", "fig5b.md"):
        for t in pg.tables(page):
            if not t.header or "attack" not in [h.lower() for h in t.header] or "paper" not in t.header:
                continue
            if "model / data" not in t.header:
                continue
            for r in t.rows:
                model, data = (x.strip() for x in t.get(r, "model / data").split("/"))
                knob = f"p {t.get(r, 'p')}, B {t.get(r, 'B')}"
                if "mask_init" in t.header:
                    knob += f", {t.get(r, 'mask_init')}"
                ours = num(t.get(r, "SSIM paper space (ours)"))
                add(model, data, attack_name(t.get(r, "attack")), knob, ours, num(t.get(r, "paper")), page)
    # Table 1's MLP block has no model / data column
    t = pg.find("table1_mlp.md", "p", "attack", "SSIM paper space (ours)", "paper")
    for r in t.rows:
        add(
            "mlp",
            "mnist",
            attack_name(t.get(r, "attack")),
            f"p {t.get(r, 'p')}, B 1",
            num(t.get(r, "SSIM paper space (ours)")),
            num(t.get(r, "paper")),
            "table1_mlp.md",
        )
    t = pg.find("fig5b.md", "data", "B", "cell (run)", "paper")
    for r in t.rows:
        add(
            "vit",
            t.get(r, "data"),
            "DIA",
            f"p 0.25, B {t.get(r, 'B')}",
            num(t.get(r, "SSIM paper space (ours)")),
            num(t.get(r, "paper")),
            "fig5b.md",
        )
    for nth, data in enumerate(("mnist", "cifar10")):
        t = pg.find("fig5c.md", "λ_mask", "B = 1", "B = 4", nth=nth)
        for r in t.rows:
            for b in ("1", "4"):
                cell = t.get(r, f"B = {b}")
                paper = re.search(r"\(([\d.]+),", cell)
                add(
                    "vit",
                    data,
                    "DIA",
                    f"p 0.25, B {b}, λ_mask {t.get(r, 'λ_mask')}",
                    num(cell),
                    float(paper.group(1)) if paper else math.nan,
                    "fig5c.md",
                )
    t = pg.find("profiles.md", "cell", "attack", "paper", "strong", "time to the paper's SSIM")
    for r in t.rows:
        data, p = t.get(r, "cell").split(" p = ")
        add(
            "lenet",
            data.lower().replace("-", ""),
            attack_name(t.get(r, "attack").lower().replace("ig", "ig_eval")),
            f"p {p}, B 1",
            num(t.get(r, "strong")),
            num(t.get(r, "paper")),
            "profiles.md",
        )
    t = pg.find("vit_b16.md", "attack", "paper", "SSIM paper-space (ours)")
    for r in t.rows:
        add(
            "vit_b16",
            "imagenet",
            t.get(r, "attack"),
            "p 0.1, B 1",
            num(t.get(r, "SSIM paper-space (ours)")),
            num(t.get(r, "paper")),
            "vit_b16.md",
        )
    return out


MODEL_COLOR = {
    "mlp": "tab:blue",
    "lenet": "tab:orange",
    "resnet18": "tab:red",
    "vit": "tab:green",
    "vit_b16": "tab:purple",
}
ATTACK_MARKER = {"IG (eval)": "v", "WIIG": "s", "DIA": "o"}


def fig_headline(pg: Pages) -> Figure:
    rows = paper_cells(pg)
    fig = Figure(figsize=(6.4, 5.4))
    ax = fig.subplots()
    ax.plot([-0.05, 1.02], [-0.05, 1.02], color="grey", lw=0.8)
    for model, color in MODEL_COLOR.items():
        for attack, marker in ATTACK_MARKER.items():
            sel = [r for r in rows if r["model"] == model and r["attack"] == attack]
            if sel:
                ax.scatter(
                    [r["paper"] for r in sel],
                    [r["ours"] for r in sel],
                    c=color,
                    marker=marker,
                    s=26,
                    alpha=0.75,
                    label=f"{model} {attack}",
                )
    ax.set(xlabel="paper's SSIM", ylabel="ours (SSIM, paper space)", xlim=(-0.05, 1.05), ylim=(-0.05, 1.05))
    ax.legend(fontsize=6.5, ncol=2, loc="upper left")
    return finish(fig, [ax], f"{len(rows)} paper-table cells: ours against the paper (on the line: equal)")


def fig_differences(pg: Pages) -> Figure:
    rows = paper_cells(pg)
    models = [m for m in MODEL_COLOR if any(r["model"] == m for r in rows)]
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    ax.axhline(0, color="grey", lw=0.8)
    for attack, marker in ATTACK_MARKER.items():
        for i, model in enumerate(models):
            sel = [r for r in rows if r["model"] == model and r["attack"] == attack]
            offset = list(ATTACK_MARKER).index(attack) * 0.22 - 0.22
            ax.scatter(
                [i + offset] * len(sel),
                [r["ours"] - r["paper"] for r in sel],
                marker=marker,
                c=MODEL_COLOR[model],
                alpha=0.6,
                s=22,
                label=attack if i == 0 else None,
            )
    ax.set_xticks(range(len(models)), models)
    ax.set(ylabel="ours − paper (SSIM, paper space)")
    ax.legend(fontsize=8)
    return finish(fig, [ax], "Gap to the paper per cell and model (most ViT and ResNet cells stopped at the cap)")


# ---- one figure per section ----------------------------------------------------------------------


def fig_closed_forms(pg: Pages) -> Figure:
    cf = pg.find("closed_forms.md", "cell", "closed form", "SSIM paper space (min)")
    closed = {t: num(cf.get(r, "SSIM paper space (min)")) for r in cf.rows for t in [cf.get(r, "cell")]}
    dia: dict[str, float] = {}
    t1 = pg.find("table1_mlp.md", "p", "attack", "SSIM paper space (ours)")
    for r in t1.rows:
        if t1.get(r, "attack") == "dia":
            dia[f"MLP MNIST p = {t1.get(r, 'p')}"] = num(t1.get(r, "SSIM paper space (ours)"))
    f5 = pg.find("fig5a.md", "model / data", "B", "SSIM paper space (ours)")
    for r in f5.rows:
        if f5.get(r, "model / data") == "mlp / cifar10" and f5.get(r, "B") == "1":
            dia[f"MLP CIFAR-10 p = {f5.get(r, 'p')}"] = num(f5.get(r, "SSIM paper space (ours)"))
    for t in pg.tables("table1_vit.md"):
        if not has(t, "model / data", "attack") or "iterations to SSIM 0.9" in t.header:
            continue
        for r in t.rows:
            if t.get(r, "attack") == "dia":
                data = "MNIST" if "mnist" in t.get(r, "model / data") else "CIFAR-10"
                dia.setdefault(f"ViT {data} p = {t.get(r, 'p')}", num(t.get(r, "SSIM paper space (ours)")))
    labels = [k for k in dia if k in closed]
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [closed[k] for k in labels], 0.4, label="closed form (one solve)")
    ax.bar([x + 0.2 for x in xs], [dia[k] for k in labels], 0.4, label="DIA (optimization, its cap)")
    ax.set_xticks(list(xs), [k.replace(" p = ", "\np = ") for k in labels], fontsize=7)
    ax.set(ylabel="SSIM (paper space)", ylim=(0, 1.1))
    ax.legend(fontsize=8, loc="lower left")
    return finish(fig, [ax], "B = 1: the closed forms return every image exactly, at every p")


def fig_cocktail_party(pg: Pages) -> Figure:
    # the page's first table is the latest sweep; a cell it did not re-run (p = 0: ICA alone) from the earlier one
    latest, earlier = (pg.find("cocktail_party.md", "data", "p", "B", "images recognisable", nth=k) for k in (0, 1))
    key = ("data", "p", "B")
    seen = {tuple(latest.get(r, c) for c in key) for r in latest.rows}
    t = Table(
        latest.page,
        latest.section,
        latest.header,
        latest.rows + [r for r in earlier.rows if tuple(earlier.get(r, c) for c in key) not in seen],
    )
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, data in zip(axes, ("mnist", "cifar10")):
        for p, color in (("0", "black"), ("0.25", "tab:blue"), ("0.5", "tab:orange")):
            sel = sorted(
                (r for r in t.rows if t.get(r, "data") == data and t.get(r, "p") == p), key=lambda r: int(t.get(r, "B"))
            )
            bs = [int(t.get(r, "B")) for r in sel]
            ax.plot(
                bs,
                [pairs(t.get(r, "images recognisable"))[0] / 64 for r in sel],
                "o-",
                color=color,
                label=f"p = {p} recognisable",
            )
            if p != "0":
                ax.plot(
                    bs,
                    [pairs(t.get(r, "images exact"))[0] / 64 for r in sel],
                    "x:",
                    color=color,
                    label=f"p = {p} exact",
                )
        log_ticks(ax, [4, 8, 16, 32, 64])
        ax.set(xlabel="batch size B", title=data)
    axes[0].set_ylabel("share of the 64 images")
    axes[0].legend(fontsize=7)
    return finish(fig, axes, "Cocktail Party + dropout's zeros on the MLP: images recovered against B")


def fig_deployed(pg: Pages) -> Figure:
    t = pg.find("deployed.md", "cell", "WIIG (oracle)", "DIA")
    series = (("WIIG (oracle)", "tab:gray"), ("DIA", "tab:blue"), ("closed form", "tab:green"))
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    width = 0.8 / len(series)
    for k, (col, color) in enumerate(series):
        shares = []
        for r in t.rows:
            cell = t.get(r, col)
            shares.append(pairs(cell)[0] / pairs(cell)[1] if " of " in cell else 0.0)
        ax.bar([i + (k - 1) * width for i in range(len(t.rows))], shares, width, color=color, label=col)
    ax.set_xticks(range(len(t.rows)), [t.get(r, "cell").removeprefix("mlp-mnist-") for r in t.rows], rotation=30)
    ax.set(ylabel="images recognisable (share)", ylim=(0, 1.05))
    ax.legend(fontsize=7)
    return finish(fig, [ax], "Deployed settings, MLP / MNIST p = 0.25: images recognisable per cell")


def fig_ssim_spaces(pg: Pages) -> Figure:
    t = pg.find("ssim_spaces.md", "cell", "paper", "paper space", "[0,1]", "min-max")
    labels = [t.get(r, "cell") for r in t.rows]
    fig = Figure(figsize=(8, 3.4))
    ax = fig.subplots()
    cols = ("paper", "paper space", "[0,1]", "min-max")
    for j, c in enumerate(cols):
        ax.bar(
            [i + (j - 1.5) * 0.2 for i in range(len(labels))],
            [num(t.get(r, c)) for r in t.rows],
            0.2,
            label="the paper" if c == "paper" else f"ours, {c}",
            color="black" if c == "paper" else None,
        )
    ax.set_xticks(range(len(labels)), [x.replace(" p = ", "\np = ") for x in labels], fontsize=8)
    ax.set(ylabel="SSIM, IG (eval), MLP")
    ax.legend(fontsize=7)
    return finish(fig, [ax], "One attack, three SSIM conventions (Table 1's MLP, cap 2,000)")


def fig_profiles(pg: Pages) -> Figure:
    t = pg.find("profiles.md", "cell", "paper", "paper's settings (plateau)", "multistep schedule")
    rows = [r for r in t.rows if t.get(r, "cell").startswith("LeNet")]
    options = t.header[2:]
    fig = Figure(figsize=(8.4, 3.6))
    ax = fig.subplots()
    width = 0.8 / len(options)
    for j, opt in enumerate(options):
        xs = [i - 0.4 + (j + 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [num(r[j + 2]) for r in rows], width, label=opt.replace("*", ""))
    ax.scatter(
        range(len(rows)),
        [num(t.get(r, "paper")) for r in rows],
        marker="_",
        s=600,
        c="black",
        zorder=3,
        label="the paper",
    )
    ax.set_xticks(
        range(len(rows)), [t.get(r, "cell").replace("LeNet ", "").replace(" p", "\np") for r in rows], fontsize=8
    )
    ax.set(ylabel="SSIM (paper space)", ylim=(0, 1.4))
    ax.legend(fontsize=6.5, ncol=3, loc="upper center")
    return finish(fig, [ax], "LeNet, cap 2,000, 4 victims: the options tried (L-BFGS + analytical masks won)")


def lines_vs(ax, xs, ours, paper, label, color) -> None:
    ax.plot(xs, ours, "o-", color=color, label=f"{label} (ours)")
    if paper is not None:
        ax.plot(xs, paper, "x", color=color, **PAPER_STYLE, label=f"{label} (paper)")


ATTACK_COLOR = {"ig_eval": "tab:red", "wiig": "tab:green", "dia": "tab:blue"}


def fig_table1_mlp(pg: Pages) -> Figure:
    t = pg.find("table1_mlp.md", "p", "attack", "SSIM paper space (ours)", "paper")
    fig = Figure(figsize=(5.6, 3.6))
    ax = fig.subplots()
    for attack, color in ATTACK_COLOR.items():
        sel = [r for r in t.rows if t.get(r, "attack") == attack]
        lines_vs(
            ax,
            [num(t.get(r, "p")) for r in sel],
            [num(t.get(r, "SSIM paper space (ours)")) for r in sel],
            [num(t.get(r, "paper")) for r in sel],
            attack,
            color,
        )
    ax.set(xlabel="dropout p", ylabel="SSIM (paper space)")
    ax.legend(fontsize=7)
    return finish(fig, [ax], "Table 1, MLP on MNIST, 128 victims, the paper's stopping rule")


def fig_fig5a(pg: Pages) -> Figure:
    t = pg.find("fig5a.md", "model / data", "B", "SSIM paper space (ours)", "paper")
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, data in zip(axes, ("mnist", "cifar10")):
        for b, color in (("1", "tab:blue"), ("4", "tab:orange")):
            sel = [r for r in t.rows if t.get(r, "model / data") == f"mlp / {data}" and t.get(r, "B") == b]
            lines_vs(
                ax,
                [num(t.get(r, "p")) for r in sel],
                [num(t.get(r, "SSIM paper space (ours)")) for r in sel],
                [num(t.get(r, "paper")) for r in sel],
                f"B = {b}",
                color,
            )
        ax.set(xlabel="dropout p", title=data)
    axes[0].set_ylabel("DIA SSIM (paper space)")
    axes[0].legend(fontsize=7)
    return finish(fig, axes, "Fig. 5a: DIA on the MLP, 16 victim images, cap 2,000")


def fig_table2(pg: Pages) -> Figure:
    fig = Figure(figsize=(9, 6))
    axes = fig.subplots(2, 2, sharey=True).ravel()
    strong = pg.find("profiles.md", "cell", "attack", "paper", "strong", "time to the paper's SSIM")
    resnet = pg.find("table2_resnet18.md", "model / data", "attack", "SSIM paper space (ours)", "paper")
    panels = [("LeNet", "MNIST"), ("LeNet", "CIFAR-10"), ("ResNet-18", "MNIST"), ("ResNet-18", "CIFAR-10")]
    for ax, (model, data) in zip(axes, panels):
        for attack, color in (("ig_eval", "tab:red"), ("dia", "tab:blue")):
            if model == "LeNet":
                sel = [
                    r
                    for r in strong.rows
                    if strong.get(r, "cell").startswith(data + " ")
                    and strong.get(r, "attack").lower() == attack.replace("_eval", "")
                ]
                ps = [num(strong.get(r, "cell").split("=")[1]) for r in sel]
                ours = [num(strong.get(r, "strong")) for r in sel]
                paper = [num(strong.get(r, "paper")) for r in sel]
            else:
                key = f"resnet18 / {data.lower().replace('-', '')}"
                sel = [
                    r for r in resnet.rows if resnet.get(r, "model / data") == key and resnet.get(r, "attack") == attack
                ]
                ps = [num(resnet.get(r, "p")) for r in sel]
                ours = [num(resnet.get(r, "SSIM paper space (ours)")) for r in sel]
                paper = [num(resnet.get(r, "paper")) for r in sel]
            lines_vs(ax, ps, ours, paper, attack, color)
        cap = "strong profile, 8 victims" if model == "LeNet" else "4 victims, cap 2,000"
        ax.set(title=f"{model} {data} ({cap})", xlabel="dropout p")
    axes[0].set_ylabel("SSIM (paper space)")
    axes[2].set_ylabel("SSIM (paper space)")
    axes[0].legend(fontsize=7)
    return finish(fig, axes, "Table 2: IG (eval) and DIA against p on the CNNs, ours and the paper")


def fig_table1_vit(pg: Pages) -> Figure:
    fig = Figure(figsize=(8.4, 3.6))
    axes = fig.subplots(1, 2, sharey=True)
    tables = [
        t
        for t in pg.tables("table1_vit.md")
        if has(t, "model / data", "attack", "paper") and "iterations to SSIM 0.9" not in t.header
    ]
    for ax, data in zip(axes, ("mnist", "cifar10")):
        rows = [(t, r) for t in tables for r in t.rows if t.get(r, "model / data") == f"vit / {data}"]
        for attack, color in ATTACK_COLOR.items():
            sel = sorted(
                (
                    (num(t.get(r, "p")), num(t.get(r, "SSIM paper space (ours)")), num(t.get(r, "paper")))
                    for t, r in rows
                    if t.get(r, "attack") == attack
                )
            )
            lines_vs(ax, [s[0] for s in sel], [s[1] for s in sel], [s[2] for s in sel], attack, color)
        ax.axhline(1.0, color="grey", lw=3, alpha=0.4, label="closed form vit_patches")
        ax.set(xlabel="dropout p", title=f"ViT {data}")
    axes[0].set_ylabel("SSIM (paper space)")
    axes[0].legend(fontsize=6.5)
    return finish(fig, axes, "Table 1/7, the ViT, 4 victims, cap 2,000")


def fig_fig5b(pg: Pages) -> Figure:
    mlp = pg.find("fig5b.md", "model / data", "B", "SSIM paper space (ours)", "paper")
    vit = pg.find("fig5b.md", "data", "B", "cell (run)", "paper")
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2, sharey=True)
    for data, color in (("mnist", "tab:blue"), ("cifar10", "tab:orange")):
        sel = [r for r in mlp.rows if mlp.get(r, "model / data") == f"mlp / {data}"]
        lines_vs(
            axes[0],
            [num(mlp.get(r, "B")) for r in sel],
            [num(mlp.get(r, "SSIM paper space (ours)")) for r in sel],
            [num(mlp.get(r, "paper")) for r in sel],
            data,
            color,
        )
        sel = [r for r in vit.rows if vit.get(r, "data") == data]
        lines_vs(
            axes[1],
            [num(vit.get(r, "B")) for r in sel],
            [num(vit.get(r, "SSIM paper space (ours)")) for r in sel],
            [num(vit.get(r, "paper")) for r in sel],
            data,
            color,
        )
    for ax, model in zip(axes, ("MLP", "ViT")):
        log_ticks(ax, [1, 4, 8, 16])
        ax.set(xlabel="batch size B", title=model)
    axes[0].set_ylabel("DIA SSIM (paper space)")
    axes[0].legend(fontsize=7)
    return finish(fig, axes, "Fig. 5b: DIA against B at p = 0.25, cap 2,000")


def fig_fig5c(pg: Pages) -> Figure:
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2, sharey=True)
    for nth, (ax, data) in enumerate(zip(axes, ("MNIST", "CIFAR-10"))):
        t = pg.find("fig5c.md", "λ_mask", "B = 1", "B = 4", nth=nth)
        lams = [t.get(r, "λ_mask") for r in t.rows]
        for b, color in (("1", "tab:blue"), ("4", "tab:orange")):
            ours = [num(t.get(r, f"B = {b}")) for r in t.rows]
            paper = [float(re.search(r"\(([\d.]+),", t.get(r, f"B = {b}")).group(1)) for r in t.rows]
            lines_vs(ax, range(len(lams)), ours, paper, f"B = {b}", color)
        ax.set_xticks(range(len(lams)), lams)
        ax.set(xlabel="λ_mask", title=f"ViT {data}")
    axes[0].set_ylabel("DIA SSIM (paper space)")
    axes[0].legend(fontsize=7)
    return finish(fig, axes, "Fig. 5c: the mask regularizer on the ViT, p = 0.25, cap 2,000")


def fig_table3(pg: Pages) -> Figure:
    t = pg.find("table3.md", "model / data", "mask_init", "SSIM paper space (ours)", "paper")
    fig = Figure(figsize=(5.6, 3.6))
    ax = fig.subplots()
    inits = list(dict.fromkeys(t.get(r, "mask_init") for r in t.rows))
    for init, color in zip(inits, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        sel = [r for r in t.rows if t.get(r, "mask_init") == init]
        lines_vs(
            ax,
            [num(t.get(r, "p")) for r in sel],
            [num(t.get(r, "SSIM paper space (ours)")) for r in sel],
            [num(t.get(r, "paper")) for r in sel],
            init,
            color,
        )
    ax.set(xlabel="dropout p", ylabel="DIA SSIM (paper space)")
    ax.legend(fontsize=6.5, ncol=2)
    return finish(fig, [ax], "Table 3: DIA's mask initializations, MLP CIFAR-10, cap 2,000")


def fig_own_models(pg: Pages) -> Figure:
    t = pg.find("own_models.md", "model", "closed form", "IG (eval)", "DIA", "WIIG (oracle)")
    names = [re.sub(r"\s*\(.*", "", t.get(r, "model")).replace("`", "") for r in t.rows]
    cols = ("closed form", "IG (eval)", "DIA", "WIIG (oracle)")
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for j, c in enumerate(cols):
        vals = [0.0 if "none" in t.get(r, c) else num(t.get(r, c).split("`")[-1]) for r in t.rows]
        ax.barh([i + (j - 1.5) * 0.2 for i in range(len(names))], vals, 0.2, label=c)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0.6, color="grey", ls=":", lw=1)
    ax.set(xlabel="SSIM [0,1] (mean of 2 images; dotted: recognisable)", xlim=(0, 1.05))
    ax.legend(fontsize=7, loc="upper right")
    return finish(fig, [ax], "attacker audit on your own model: one Flower round, cap 500")


def fig_fedavg(pg: Pages) -> Figure:
    k = pg.find("fedavg.md", "K", "SGD: IG / WIIG / DIA / one-gradient")
    smooth = pg.find("fedavg.md", "K", "victims, cap", "DIA")
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2, sharey=True)
    names = ("IG (eval)", "WIIG", "DIA", "one-gradient")
    ks = [num(k.get(r, "K")) for r in k.rows]
    for j, (name, color) in enumerate(zip(names, ("tab:red", "tab:green", "tab:blue", "grey"))):
        sgd = [num(k.get(r, "SGD").split("/")[j]) for r in k.rows]
        adam = [num(k.get(r, "Adam").split("/")[j]) for r in k.rows]
        axes[0].plot(ks, sgd, "o-", color=color, label=name)
        axes[1].plot(ks, adam, "x", color=color, **PAPER_STYLE, label=f"{name}, exact replay")
    sk = [num(smooth.get(r, "K")) for r in smooth.rows]
    for name, color in (("WIIG", "tab:green"), ("DIA", "tab:blue")):
        axes[1].plot(
            sk, [num(smooth.get(r, name)) for r in smooth.rows], "o-", color=color, label=f"{name}, smoothed replay"
        )
    for ax, title in zip(axes, ("SGD clients", "Adam clients")):
        ax.set(xlabel="local steps K", title=title)
        ax.set_xticks([1, 4, 8])
    axes[0].set_ylabel("SSIM (paper space)")
    for ax in axes:
        ax.legend(fontsize=6.5)
    return finish(fig, axes, "FedAvg rounds, MLP MNIST p = 0.25: attacks on the client's update")


def fig_dp_sgd(pg: Pages) -> Figure:
    t = pg.find("dp_sgd.md", "model", "p", "defense", "target ε", "accuracy %", "DIA SSIM")
    levels = ["–", "∞", "8", "3", "1"]
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2)
    for p, color in (("0", "black"), ("0.25", "tab:blue"), ("0.5", "tab:orange")):
        sel = {t.get(r, "target ε"): r for r in t.rows if t.get(r, "model") == "mlp" and t.get(r, "p") == p}
        xs = [i for i, lv in enumerate(levels) if lv in sel]
        axes[0].plot(xs, [num(t.get(sel[levels[i]], "accuracy %")) for i in xs], "o-", color=color, label=f"p = {p}")
        axes[1].plot(xs, [num(t.get(sel[levels[i]], "DIA SSIM")) for i in xs], "o-", color=color, label=f"p = {p}")
    for ax, ylabel in zip(axes, ("test accuracy % (3 rounds)", "DIA SSIM (paper space)")):
        ax.set_xticks(range(len(levels)), ["none", "clip only", "ε = 8", "ε = 3", "ε = 1"], fontsize=8)
        ax.set(ylabel=ylabel)
    axes[0].legend(fontsize=7)
    return finish(fig, axes, "DP-SGD clients (Opacus), MLP MNIST: what ε costs and what it stops")


def fig_strategies(pg: Pages) -> Figure:
    t = pg.find("strategies.md", "strategy", "partition", "accuracy %", "DIA SSIM")
    markers = {"iid": "o", "dir1": "s", "dir0.1": "^"}
    strategies = list(dict.fromkeys(t.get(r, "strategy") for r in t.rows))
    fig = Figure(figsize=(6.4, 4))
    ax = fig.subplots()
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for s, color in zip(strategies, colors):
        for part, marker in markers.items():
            sel = [r for r in t.rows if t.get(r, "strategy") == s and t.get(r, "partition") == part]
            ax.scatter(
                [num(t.get(r, "accuracy %")) for r in sel],
                [num(t.get(r, "DIA SSIM")) for r in sel],
                c=color,
                marker=marker,
                s=40,
                label=f"{s}, {part}",
            )
    ax.set(xlabel="test accuracy % after 3 rounds", ylabel="DIA SSIM (paper space)", ylim=(0.5, 1.02))
    ax.legend(fontsize=6, ncol=3, loc="lower left")
    return finish(fig, [ax], "Flower strategies and label skew, MLP: DIA stays high everywhere")


def fig_secagg(pg: Pages) -> Figure:
    fig = Figure(figsize=(10, 3.4))
    axes = fig.subplots(1, 3, sharey=True)
    for ax, model in zip(axes, ("MLP", "LeNet", "ViT")):
        t = pg.find("secagg.md", "N", "quantization", "recognisable by the server's attacks", section=model)
        quants = list(dict.fromkeys(t.get(r, "quantization") for r in t.rows))
        for q in quants:
            sel = [r for r in t.rows if t.get(r, "quantization") == q]
            k_n = [pairs(t.get(r, "recognisable by the server's attacks")) for r in sel]
            label = re.sub(r" \(Flower's clipping and quantization ranges\)", "", q)
            if model == "ViT" and q == "SecAgg+, fine":
                label += " (clipping range 1)"
            # the plain replies drawn wide and pale, so that a SecAgg+ line on top of them stays visible
            style = dict(lw=6, alpha=0.3) if "no secure" in q else dict(marker="o", ls="-" if "fine" in q else "--")
            ax.plot([int(t.get(r, "N")) for r in sel], [k / n for k, n in k_n], label=label, **style)
        log_ticks(ax, [2, 4, 8, 16])
        ax.set(xlabel="clients N", title=model)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("share of images recognisable")
    return finish(fig, axes, "Flower's SecAgg+: what the server's attacks recover from the mean")


def fig_speed(pg: Pages) -> Figure:
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2)
    for ax, (cols, title) in zip(axes, ((("GFLOP / iteration",), "CPU, 2 cores"), (("ms / iteration",), "one H200"))):
        t = pg.find("performance.md", "model / data", "V", "path", "× plain loop", *cols)
        best: dict[str, dict[int, float]] = {}
        model = ""
        for r in t.rows:
            model = t.get(r, "model / data") or model
            v = int(num(t.get(r, "V")))
            best.setdefault(model, {})
            best[model][v] = max(best[model].get(v, 0.0), num(t.get(r, "× plain loop")))
        for m, by_v in best.items():
            vs = sorted(by_v)
            ax.plot(vs, [by_v[v] for v in vs], "o-", label=m)
        ax.set(xscale="log", yscale="log", xlabel="victims attacked at once V", title=title)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("× the plain one-victim loop")
    return finish(fig, axes, "Speed of the batched attack engine (make bench / make gpu-check)")


FIGURES: dict[str, Callable[[Pages], Figure]] = {
    "headline": fig_headline,
    "closed_forms": fig_closed_forms,
    "cocktail_party": fig_cocktail_party,
    "deployed": fig_deployed,
    "ssim_spaces": fig_ssim_spaces,
    "profiles": fig_profiles,
    "table1_mlp": fig_table1_mlp,
    "fig5a": fig_fig5a,
    "table2": fig_table2,
    "table1_vit": fig_table1_vit,
    "fig5b": fig_fig5b,
    "fig5c": fig_fig5c,
    "table3": fig_table3,
    "own_models": fig_own_models,
    "fedavg": fig_fedavg,
    "dp_sgd": fig_dp_sgd,
    "strategies": fig_strategies,
    "secagg": fig_secagg,
    "speed": fig_speed,
    "differences": fig_differences,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"figures to draw (default: all): {', '.join(FIGURES)}"
    )
    parser.add_argument("--pages", type=Path, default=Path("docs/results"))
    parser.add_argument("--performance", type=Path, default=Path("docs/performance.md"))
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in FIGURES]
    if unknown:
        print(f"error: unknown figure {unknown[0]!r}; choose from {', '.join(FIGURES)}", file=sys.stderr)
        return 2
    pages = Pages(args.pages, args.performance)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or FIGURES:
        try:
            fig = FIGURES[name](pages)
        except (LookupError, ValueError) as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            return 2
        path = args.out / f"summary_{name}.png"
        fig.savefig(path, dpi=DPI)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
