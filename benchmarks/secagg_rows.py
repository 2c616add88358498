"""RESULTS' secure-aggregation rows: for each N and quantization, a Flower simulation of N clients with one
image each under SecAgg+ (round 1 captured, audit on), ``attacker audit`` of it, and beside it the same
clients without secure aggregation (each one-step gradient captured alone). Prints one markdown table:
the quantization step and the true update's RMS entry (from the oracle: the clean batch gradient of the
clients' images with their masks), the captured mean's actual error, and IG / DIA / WIIG SSIM per image.

    python benchmarks/secagg_rows.py OUT [--model lenet] [--clients 2 4] [--iterations N] [--fedavg K]
        [--cells fine plain]

Runs that finished are reused (a folder holding results.json / audit.json), so the table can be rebuilt.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fedsim import task
from fedsim.capture import find_oracles, list_captures, load_capture
from fedsim.models import set_dropout_mode, set_masks
from fedsim.run_config import resolve_config

# The fine grid: weights unscaled (one image per client, max-weight 1), clipped to [-1, 1], 2**28 levels
# (2**28 - 1 at N = 16: N times the range must stay below SecAgg+'s modulus 2**32).
# (folder, the table's words, secure aggregation on, its flags)
FINE_LEVELS = 2**28
CELLS = (
    ("fine", "SecAgg+, fine", True, ["--max-weight", "1", "--clipping-range", "1", "--quantization-range", "FINE"]),
    # the same grid over Flower's clipping range [-8, 8]: for a model with weights beyond [-1, 1] (the ViT's
    # position embedding and cls token), which the fine cell's range clips and so corrupts
    (
        "fine8",
        "SecAgg+, fine, clipping range 8",
        True,
        ["--max-weight", "1", "--clipping-range", "8", "--quantization-range", "FINE"],
    ),
    ("mw1", "SecAgg+, max-weight 1 (Flower's clipping and quantization ranges)", True, ["--max-weight", "1"]),
    ("defaults", "SecAgg+, Flower's defaults", True, []),
    ("plain", "no secure aggregation", False, []),
)
ATTACKS = ("ig_eval", "dia", "wiig")
# every closed form that applies runs first, as in the audit; under SecAgg+ (B = N > 1) none does, and the
# audit records why
CLOSED_FORM = "closed_form"


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-m", *cmd], check=True, stdout=fh, stderr=subprocess.STDOUT)


def federation(
    out: Path, n: int, secagg: bool, quantization: list[str], fedavg: int = 0, model: tuple[str, str] = ("mlp", "mnist")
) -> Path:
    run = out / "fed"
    if not (run / "results.json").is_file():
        flags = ["--model", model[0], "--dataset", model[1]]
        levels = str(min(FINE_LEVELS, (2**32 - 1) // n))
        flags += ["--secagg", *(levels if q == "FINE" else q for q in quantization)] if secagg else []
        if fedavg:  # a FedAvg round: K = fedavg SGD steps of batch 1 on as many images per client
            flags += ["--capture-kind", "update", "--capture-images", str(fedavg), "--batch-size", "1"]
            flags += ["--optimizer", "sgd", "--lr", "0.01"]
        base = ["--clients", str(n), "--rounds", "1", "--capture-rounds", "1", "--audit", "--no-download"]
        _run(["fedsim.cli", "simulate", *base, *flags, "--run-dir", str(run)], out / "fed.log")
    return run


def audit(out: Path, run: Path, iterations: int | None) -> dict:
    folder = out / "audit"
    if not (folder / "audit.json").is_file():
        extra = ["--iterations", str(iterations)] if iterations else []
        _run(
            ["attacker.cli", "audit", str(run), "--out", str(folder), "--attacks", CLOSED_FORM, *ATTACKS]
            + ["--no-lpips", "--quiet"]
            + extra,
            out / "audit.log",
        )
    return json.loads((folder / "audit.json").read_text())


def clean_size(run: Path) -> tuple[float, float, float]:
    """(step, the clean gradient's or update's RMS entry, the captured mean's RMS error) of an aggregate
    capture: the clients' true images and masks, one batch (one-step) or each client's round replayed
    from the shared start and averaged (FedAvg)."""
    (capture,) = [load_capture(p) for p in list_captures(run)]
    if capture.update is not None:
        return (capture.aggregate.step, *_clean_update(run))
    records = find_oracles(run, capture)
    cfg = resolve_config({k: v for k, v in json.loads((run / "config.json").read_text()).items()})
    images = torch.cat([r.images for r in records]).float()
    labels = torch.cat([r.labels for r in records])
    masks = [torch.cat([r.masks[i] for r in records]).float() for i in range(len(records[0].masks))]
    model = task.make_model(cfg, capture.weights)
    set_dropout_mode(model, "replay")
    set_masks(model, masks)
    model.train()
    clean = torch.autograd.grad(F.cross_entropy(model(images), labels), list(model.parameters()))
    flat = torch.cat([g.flatten().double() for g in clean])
    got = torch.cat([g.flatten().double() for g in capture.gradient])
    return capture.aggregate.step, float(flat.pow(2).mean().sqrt()), float((got - flat).pow(2).mean().sqrt())


def _clean_update(run: Path) -> tuple[float, float]:
    from dataclasses import replace

    from attacker.captures import capture_paths, jobs_from_captures
    from attacker.engine.replay import replayed_update
    from attacker.jobs import model_from_job

    (job,), (oracle,), _ = jobs_from_captures(capture_paths(run), run)
    model = model_from_job(job)
    per_layer = len(oracle.masks) // len(job.steps)
    masks = [list(oracle.masks[t * per_layer : (t + 1) * per_layer]) for t in range(len(job.steps))]
    plan = replace(job.plan, dropout="replay", masks=masks)
    start = {k: v.detach() for k, v in model.named_parameters()}
    clean = replayed_update(model, start, plan, oracle.images, job.labels, job.members)
    names = [n for n, _ in model.named_parameters()]
    flat = torch.cat([clean[n].flatten().double() for n in names])
    got = torch.cat([g.flatten().double() for g in job.gradient])
    return float(flat.pow(2).mean().sqrt()), float((got - flat).pow(2).mean().sqrt())


def _closed_form(result: dict) -> str:
    """The closed forms' SSIM per image, or why none applied."""
    solved = [a for a in result["attacks"] if a not in ATTACKS]
    if not solved:
        return "none applies" if result.get("closed_forms_skipped") else "not run"
    return " ".join(f"{a}: {_ssims(result, a)}" for a in solved)


def _ssims(result: dict, attack: str) -> str:
    """Per image (the clients' order) the [0,1] SSIM, then the mean in paper space."""
    rows = sorted(result["images"], key=lambda r: (r["client"], r["index"]))
    values = " ".join(f"{r['attacks'][attack]['ssim_std']:.3f}" for r in rows)
    paper = sum(r["attacks"][attack]["ssim_paper"] for r in rows) / len(rows)
    return f"{values} (paper {paper:.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iterations", type=int, default=None, help="attack budget (default: the profile's)")
    parser.add_argument("--fedavg", type=int, default=0, metavar="K", help="FedAvg rounds of K images, K steps")
    parser.add_argument("--cells", nargs="+", default=["fine", "mw1", "defaults", "plain"], help="which quantizations")
    parser.add_argument("--model", default="mlp", help="the federation's model (p = 0.25, its default)")
    parser.add_argument("--dataset", default="mnist")
    args = parser.parse_args(argv)
    # the MLP/MNIST rows keep their first folders (n2-fine, ...), so earlier runs are reused
    prefix = "" if (args.model, args.dataset) == ("mlp", "mnist") else f"{args.model}-{args.dataset}-"
    rows = []
    for n in args.clients:
        for folder, name, secagg, quantization in CELLS:
            if folder not in args.cells:
                continue
            out = args.out / f"{prefix}n{n}-{folder}{f'-k{args.fedavg}' if args.fedavg else ''}"
            out.mkdir(parents=True, exist_ok=True)
            run = federation(out, n, secagg, quantization, args.fedavg, (args.model, args.dataset))
            result = audit(out, run, args.iterations)
            size = "–"
            if secagg:
                step, rms, error = clean_size(run)
                size = f"{step:.2g} / {rms:.2g} / {error:.2g}"
            ssim = " | ".join(_ssims(result, a) for a in ATTACKS)
            summary = result["summary"]
            seen = f"{summary['recognisable']} of {summary['images']}"
            bound = summary.get("oracle_bound") or {}
            seen += f" ({bound.get('recognisable', 0)} of {bound.get('images', 0)})" if bound else ""
            rows.append(f"| {n} | {name} | {size} | {_closed_form(result)} | {ssim} | {seen} |")
    units = "update" if args.fedavg else "gradient"
    cap = args.iterations or "the profile's"
    print(f"{args.model} / {args.dataset}, cap {cap}")
    print(
        f"| N | quantization | step / clean RMS / RMS error ({units} units) | closed form | IG | DIA | WIIG "
        "| recognisable by the server's attacks (by WIIG) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
