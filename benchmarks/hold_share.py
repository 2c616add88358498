"""A probe, not an attack: how many of a FedAvg SGD round's images must be held at their true values before
``dia_hold`` finds the rest? It tells whether the MLP's B = 64 round (docs/results/deployed.md: 8 of 64 held
by ``dark_background``, no other image found at any cap) lacks a bigger closed-form share or something else.

    python benchmarks/hold_share.py --held 8 16 32 [--batch-size 64] [--iterations 1000] [--out runs/hold-share]

The round is the deployed cells' (MLP / MNIST, p = 0.25, the paper's victims, SGD lr 0.05, K = 4 epochs of one
batch). For each N, the first N images of the job are held at the client's TRUE images (the oracle, used here
only to measure) and the others start from noise in the images' span; ``dia_hold`` learns them and every
image's masks. Printed per N: how many of the B - N free images are recognisable ([0,1] SSIM >= 0.6, matched
by distance as benchmarks/cocktail_party_rows.py counts), their mean [0,1] SSIM, and the seconds. Each N writes
its own run folder under --out; a folder that already exists is refused (one line, exit 2) before any work.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from attacker.closed_form import run as closed_form_run
from attacker.config import ConfigError, parse_config
from attacker.pipeline import load_jobs, run_attack
from fedsim.data import DataUnavailableError, VictimFileError

ROUND = {"local_epochs": 4, "batch_size": 64, "optimizer": "sgd", "lr": 0.05, "batch_order": "in-order"}


def config(batch_size: int, iterations: int, lr: float) -> dict:
    return {
        "victims": {
            "source": "paper",
            "model": "mlp",
            "dataset": "mnist",
            "p": 0.25,
            "victim_batch_size": batch_size,
            "count": batch_size,
            "local_round": ROUND,
        },
        "attacks": ["dia_hold"],
        "attack_overrides": {"max_iterations": iterations, "lr": lr},
        "lpips": False,
        "device": "cpu",
    }


def held_truth(truths: dict[str, torch.Tensor], n: int):
    """A stand-in for ``ClosedForms.first_guess``: the job's first n true images held, noise elsewhere."""

    def first_guess(self, job):
        truth = truths[job.job_id]
        start = torch.randn(truth.shape, generator=torch.Generator().manual_seed(0))
        start[:n] = truth[:n]
        held = torch.zeros(len(truth), dtype=torch.bool)
        held[:n] = True
        return closed_form_run.Guess(start, held)

    return first_guess


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, nargs="+", required=True, help="numbers of true images held")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=0.1, help="dia_hold's step size (its default 0.1)")
    parser.add_argument("--out", type=Path, default=Path("runs/hold-share"))
    args = parser.parse_args(argv)
    import cocktail_party_rows  # benchmarks/ on the path: the per-image count

    taken = [args.out / f"held{n}" for n in args.held if (args.out / f"held{n}").exists()]
    if taken:
        print(f"error: {taken[0]} exists; choose another --out", file=sys.stderr)
        return 2
    too_many = [n for n in args.held if not 0 <= n < args.batch_size]
    if too_many:
        print(f"error: --held {too_many[0]} must be in [0, the batch size {args.batch_size})", file=sys.stderr)
        return 2
    cfg = parse_config(config(args.batch_size, args.iterations, args.lr))
    try:
        jobs, oracles = load_jobs(cfg, log=lambda *_: None)
    # e.g. the paper's victims not fetched and no network: the CLI's own one-line errors
    except (ConfigError, VictimFileError, DataUnavailableError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    truths = {job.job_id: oracle.images for job, oracle in zip(jobs, oracles)}
    original = closed_form_run.ClosedForms.first_guess
    what = f"B = {args.batch_size}, dia_hold cap {args.iterations}, lr {args.lr:g}"
    print(f"MLP / MNIST p = 0.25, SGD K = 4 round, {what}")
    print("held (true) | free images recognisable | free mean [0,1] SSIM | s")
    for n in args.held:
        folder = args.out / f"held{n}"
        closed_form_run.ClosedForms.first_guess = held_truth(truths, n)
        started = time.time()
        try:
            run_attack(cfg, folder, progress=False, log=lambda *_: None)
        finally:
            closed_form_run.ClosedForms.first_guess = original
        seconds = time.time() - started
        scores = cocktail_party_rows.per_image(folder, "dia_hold")
        # per_image is in the victims' order (the reconstructions matched to them): the free ones follow the n held
        free = scores[n:]
        found = sum(s >= 0.6 for s in free)
        mean = sum(free) / max(len(free), 1)
        print(f"{n:11d} | {found:3d} of {len(scores) - n:3d} | {mean:.3f} | {seconds:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
