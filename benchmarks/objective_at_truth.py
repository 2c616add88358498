"""The attack's objective at its reconstruction against the objective at the client's true image and
masks, term by term, per job of a finished run: does the optimizer stop short of a better minimum (the
truth's objective is lower), or does the objective prefer the reconstruction (the truth's is higher)?

    python benchmarks/objective_at_truth.py CONFIG.yaml RUN_DIR [--lambda-features W] [--tv W]

CONFIG is the run's YAML (it rebuilds the same victim jobs); RUN_DIR holds reconstructions.safetensors.
The terms are the engine's: one cosine distance over all parameter gradients, TV (mean |dx| + mean |dy|),
the features term (relative squared error of the last Linear's input against the closed-form h), and
the mask regularizer (weight 1e-4). Prints one row per job; the weights only scale the total column.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from attacker.closed_form.solvers import find_last_linear, last_linear_features
from attacker.config import load_config
from attacker.engine.objectives import mask_regularizer, total_variation
from attacker.jobs import model_from_job
from attacker.pipeline import load_jobs
from fedsim.models.dropout import DropoutMode, set_dropout_mode, set_masks


def terms(model, layer, job, images, masks, target_h):
    seen = []
    hook = layer.module.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    set_dropout_mode(model, DropoutMode.LEARN)
    set_masks(model, masks)
    loss = F.cross_entropy(model(images), job.labels)
    hook.remove()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    g = torch.cat([x.flatten() for x in grads])
    t = torch.cat([x.flatten() for x in job.gradient])
    cos = 1 - (g @ t) / (g.norm() * t.norm() + 1e-8)
    h = seen[-1].reshape(-1)
    feat = (h - target_h).pow(2).sum() / target_h.pow(2).sum()
    return {
        "grad_cos": float(cos),
        "tv": float(total_variation(images, 1)),
        "features": float(feat),
        "mask_reg": float(mask_regularizer(masks, 1, job.p)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--attack", default="dia")
    parser.add_argument("--tv", type=float, default=1e-2)
    parser.add_argument("--lambda-features", type=float, default=0.0)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    jobs, oracles = load_jobs(cfg, log=lambda *_: None)
    saved = load_file(str(args.run_dir / "reconstructions.safetensors"))
    w = {"grad_cos": 1.0, "tv": args.tv, "features": args.lambda_features, "mask_reg": 1e-4}
    weights = f"weights tv {args.tv:g}, features {args.lambda_features:g}"
    print(f"job | at | grad_cos | tv | features | mask_reg | total ({weights})")
    for job, oracle in zip(jobs, oracles):
        model = model_from_job(job)
        layer = find_last_linear(model, tuple(job.spec.input_shape))
        target_h = last_linear_features(layer, job, model).values[0].reshape(-1)
        rec_images = saved[f"{job.job_id}/{args.attack}/images"]
        n = len([k for k in saved if k.startswith(f"{job.job_id}/{args.attack}/mask")])
        rec_masks = [saved[f"{job.job_id}/{args.attack}/mask{i:02d}"] for i in range(n)]
        for at, images, masks in (("recon", rec_images, rec_masks), ("truth", oracle.images, list(oracle.masks))):
            row = terms(model, layer, job, images, masks, target_h)
            total = sum(w[k] * v for k, v in row.items())
            print(f"{job.job_id} | {at} | " + " | ".join(f"{row[k]:.4g}" for k in w) + f" | {total:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
