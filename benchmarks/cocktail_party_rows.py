"""RESULTS' Cocktail Party rows: the closed form ``cocktail_party`` on the MLP's one-step gradients of
B = 4..64 paper victims at once, per dataset and dropout rate. Each cell is one ``attacker run`` (folder
OUT/DATASET-pP-BB, reused once finished); prints one markdown table: SSIM per image (the recovered
images matched to the originals by distance alone), how many images came back recognisably and
exactly, how many jobs the dropout-zero separation solved exactly, and the solve time per job.

    python benchmarks/cocktail_party_rows.py OUT [--datasets mnist cifar10] [--p 0.25 0.5 0] [--batch 4 8 16]
        [--victims 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

from attacker.closed_form.solvers import EXACT_RTOL

RECOGNISABLE = 0.6  # the audit's threshold: [0,1] SSIM


def cell(out: Path, dataset: str, p: float, batch: int, victims: int) -> tuple[list[dict], list[float]]:
    folder = out / f"{dataset}-p{p:g}-B{batch}"
    if not (folder / "metrics.json").is_file():
        cmd = [sys.executable, "-m", "attacker.cli", "run", "--paper-victims", "--model", "mlp"]
        cmd += ["--dataset", dataset, "--p", str(p), "--victims", str(victims), "--victim-batch-size", str(batch)]
        cmd += ["--attacks", "cocktail_party", "--no-lpips", "--device", "cpu", "--quiet", "--out", str(folder)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / "metrics.json").read_text()), per_image(folder)


def per_image(folder: Path, attack: str = "cocktail_party") -> list[float]:
    """Each image's [0,1] SSIM: the run's reconstructions by ``attack`` against its victims, matched by
    distance (empty where the attack did not run on the folder's jobs)."""
    from safetensors.torch import load_file

    from attacker.config import load_config
    from attacker.metrics import score_batch
    from attacker.pipeline import load_jobs
    from fedsim.data import get_spec

    jobs, oracles = load_jobs(load_config(folder / "config.yaml"), lambda _: None)
    tensors = load_file(str(folder / "reconstructions.safetensors"))
    out = []
    for job, oracle in zip(jobs, oracles):
        spec = get_spec(job.spec.dataset, job.spec.input_shape[0])
        key = f"{job.job_id}/{attack}/images"
        if key not in tensors:
            continue
        recon = tensors[key]
        out += score_batch(oracle.images, recon, spec.mean, spec.std)["metrics"]["ssim_std"]["per_image"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--datasets", nargs="+", default=["mnist", "cifar10"])
    parser.add_argument("--p", nargs="+", type=float, default=[0.25, 0.5, 0.0])
    parser.add_argument("--batch", nargs="+", type=int, default=[4, 8, 16, 32, 64])
    parser.add_argument("--victims", type=int, default=64)
    args = parser.parse_args(argv)
    print(
        "| data | p | B | jobs | SSIM paper space | SSIM [0,1] | images recognisable ([0,1] ≥ 0.6) "
        "| jobs solved exactly | images exact | images found by dropout's zeros | s per job |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dataset in args.datasets:
        for p in args.p:
            for batch in args.batch:
                rows, ssim = cell(args.out, dataset, p, batch, args.victims)
                exact = sum(r["status"] == "solved" for r in rows)
                found = sum(r.get("images_separated", 0) for r in rows)
                # each image's own check: its next-layer misfit (what "exact" means for the whole job)
                exact_images = sum(m <= r.get("exact_tolerance", EXACT_RTOL) for r in rows for m in r["scale_misfits"])
                print(
                    f"| {dataset} | {p:g} | {batch} | {len(rows)} | {mean(r['ssim_paper'] for r in rows):.3f} "
                    f"| {mean(ssim):.3f} | {sum(v >= RECOGNISABLE for v in ssim)} of {len(ssim)} "
                    f"| {exact} of {len(rows)} | {exact_images} of {len(ssim)} "
                    f"| {found if p > 0 else '–'} of {len(ssim)} "
                    f"| {mean(r['solve_seconds'] for r in rows):.2f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
