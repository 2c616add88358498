"""Why the span-based attacks (dia_span, dark_background, dia_hold) take plain-SGD rounds and not Adam's:
how much of the first Linear's shared update lies in the span of the client's images, per optimizer and B.

    python benchmarks/adam_span.py [--batch-sizes 1 8 32 64] [--jobs 2]

Each row is a FedAvg round of K = 4 local steps (4 epochs of one batch, the deployed cells' settings: SGD lr
0.05, Adam lr 1e-3) of the MLP on offline MNIST partitions at p = 0.25, built the way the attacker builds its
victims (attacker.pipeline.load_jobs). Printed per row, averaged over the jobs:

- in span: the fraction of the update's squared norm in the row space of the images (1 for SGD: every
  step's gradient is D_t^T X, so each row is a combination of the images);
- rank-B fit: the same for the best rank-B approximation of the update (how far from rank B it is);
- sign fit (B = 1): the fraction explained by u·sign(x)^T. Adam normalises each entry by its own history,
  and at B = 1 every entry's history is one hidden unit's sequence times one pixel, so its update keeps
  only the pixel's sign: a one-image Adam update is (almost exactly) rank one with sign(x) as its row.
"""

from __future__ import annotations

import argparse

import torch

from attacker.config import parse_config
from attacker.pipeline import load_jobs

ROUNDS = {
    "sgd": {"local_epochs": 4, "batch_size": 64, "optimizer": "sgd", "lr": 0.05, "batch_order": "in-order"},
    "adam": {"local_epochs": 4, "batch_size": 64, "optimizer": "adam", "lr": 0.001, "batch_order": "in-order"},
}


def fractions(update: torch.Tensor, images: torch.Tensor) -> dict[str, float]:
    """Fractions of ||update||^2 (out x in) in the images' row space, in its best rank-B fit and, for
    one image, in the rank-one fit with sign(x) as its row."""
    w = update.double()
    x = images.reshape(len(images), -1).double()  # B x in, the model's input space
    q, _ = torch.linalg.qr(x.T)  # in x B, orthonormal basis of the span
    total = float(w.pow(2).sum())
    out = {"in span": float((w @ q).pow(2).sum()) / total}
    s = torch.linalg.svdvals(w)
    out["rank-B fit"] = float(s[: len(x)].pow(2).sum()) / total
    if len(x) == 1:
        sign = torch.sign(x[0])
        u = w @ sign / sign.pow(2).sum()
        out["sign fit"] = 1 - float((w - torch.outer(u, sign)).pow(2).sum()) / total
    return out


def measure(batch_sizes: list[int], jobs: int) -> list[dict]:
    """One row per (B, optimizer): the fractions averaged over ``jobs`` victim jobs."""
    table = []
    for b in batch_sizes:
        for name, local_round in ROUNDS.items():
            cfg = parse_config(
                {
                    "victims": {
                        "model": "mlp",
                        "dataset": "mnist",
                        "p": 0.25,
                        "victim_batch_size": b,
                        "count": b * jobs,
                        "local_round": local_round,
                    },
                    "attacks": ["dia"],
                    "lpips": False,
                }
            )
            victims, oracles = load_jobs(cfg, log=lambda *_: None)
            rows = [fractions(job.gradient[0], oracle.images) for job, oracle in zip(victims, oracles)]
            mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
            table.append({"optimizer": name, "B": b, "jobs": len(rows), **mean})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--jobs", type=int, default=2, help="victim jobs per row (default 2)")
    args = parser.parse_args(argv)
    print("| optimizer | B | jobs | in span | rank-B fit | sign fit (B = 1) |")
    print("|---|---|---|---|---|---|")
    for row in measure(args.batch_sizes, args.jobs):
        sign = f"{row['sign fit']:.6f}" if "sign fit" in row else "–"
        print(
            f"| {row['optimizer']} | {row['B']} | {row['jobs']} | {row['in span']:.6f} | {row['rank-B fit']:.6f} "
            f"| {sign} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
