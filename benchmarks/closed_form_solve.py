"""Time the closed-form solvers per job on the paper's victims, and the first Linear's rank-one fit
against a full SVD of the same gradients (the way it was first written) in the same run.

    python benchmarks/closed_form_solve.py [--victims 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from attacker.closed_form.run import ClosedForms
from attacker.closed_form.solvers import _rank_one
from attacker.jobs import jobs_from_images
from fedsim.data import load_victim_file, paper_victims
from fedsim.models import ModelSpec

CELLS = [
    ("mlp", "mnist", "first_linear"),
    ("mlp", "cifar10", "first_linear"),
    ("vit", "mnist", "vit_patches"),
    ("vit", "cifar10", "vit_patches"),
]


def _svd_top(matrix: torch.Tensor) -> torch.Tensor:
    torch.linalg.svdvals(matrix)  # the rank, as the first version computed it
    return torch.linalg.svd(matrix, full_matrices=False)[2][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victims", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"closed-form solves, {args.victims} paper victims per cell, p = 0.25, {args.threads} thread(s)")
    for model, dataset, solver in CELLS:
        images, labels = load_victim_file(paper_victims(dataset, "data"))
        spec = ModelSpec(model, dataset, 0.25)
        batches = [(images[i : i + 1], labels[i : i + 1]) for i in range(args.victims)]
        jobs, _ = jobs_from_images(spec, batches)
        forms = ClosedForms()
        forms.reason(solver, jobs[0])  # the structure, found once per model
        started = time.perf_counter()
        exact = sum(forms.solve(solver, job).extras["exact"] for job in jobs)
        per_job = (time.perf_counter() - started) / len(jobs)
        line = f"{model}/{dataset} {solver}: {per_job:.3f} s per job, {exact} of {len(jobs)} exact"
        if solver == "first_linear":
            grads = [job.gradient[0].double() for job in jobs]
            started = time.perf_counter()
            for g in grads:
                _svd_top(g)
            svd = time.perf_counter() - started
            started = time.perf_counter()
            for g in grads:
                _rank_one(g)
            gram = time.perf_counter() - started
            n = len(grads)
            line += f"; rank-one fit {gram / n:.3f} s/job against full SVD {svd / n:.3f} ({svd / gram:.1f}x)"
        print(line)


if __name__ == "__main__":
    main()
