"""Score results against the oracle: image metrics in both value spaces, LPIPS, MMD and TRD."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fedsim.data import get_spec
from fedsim.defenses import NO_DEFENSE

from .closed_form.solvers import follows_labels
from .jobs import JobResult, Oracle, VictimJob
from .metrics import LpipsScorer, mask_metrics, score_batch

METRIC_KEYS = ("ssim_paper", "psnr_paper", "mse_paper", "ssim_std", "psnr_std", "mse_std", "ssim_minmax", "lpips")


def score_results(
    jobs: list[VictimJob],
    oracles: list[Oracle | None],
    results: list[JobResult],
    lpips: LpipsScorer | None = None,
) -> list[dict[str, Any]]:
    """One row per job: what was attacked, how the optimization ended, and every metric."""
    from .curves import iterations_to  # attacker.curves imports Lightning: not at the CLI's import

    priors = prior_images(oracles)
    prior_ssim: dict[str, float] = {}
    rows = []
    for job, oracle, res in zip(jobs, oracles, results):
        row: dict[str, Any] = {
            "job": job.job_id,
            "attack": res.attack,
            "model": job.spec.name,
            "dataset": job.spec.dataset,
            "p": job.p,
            "batch_size": job.batch_size,
            "labels": job.label_source,
            "defense": job.meta.get("defense", NO_DEFENSE),  # the capture's defense and the attack's adaptation to it
            "adaptation": job.meta.get("adaptation", "none"),
            "status": res.status,
            "iterations": res.iterations,
            "best_iteration": res.best_iteration,
            "best_loss": res.best_loss,
            "optimized_values": res.optimized_values,
            **res.extras,
        }
        if oracle is not None:
            spec = get_spec(job.spec.dataset, job.spec.input_shape[0])
            labels = job.labels if follows_labels(res.attack) else None
            scored = score_batch(oracle.images, res.images, spec.mean, spec.std, lpips_scorer=lpips, labels=labels)
            for key in METRIC_KEYS:
                entry = scored["metrics"].get(key)
                row[key] = entry["mean"] if entry else None
            row["matched"] = scored["matched"]
            row["iters_to_ssim90"] = iterations_to(res.ssim_curve) if res.ssim_curve else None
            if "exact" in res.extras:  # a closed form: its answer is there at iteration 0, or never
                row["iters_to_ssim90"] = 0 if row["ssim_paper"] is not None and row["ssim_paper"] >= 0.9 else None
            key = _key(oracle.images)
            if key in priors and key not in prior_ssim:  # once per victim batch, not once per attack on it
                prior_ssim[key] = prior_score(oracle.images, priors[key], spec.mean, spec.std)
            row["rdlv"] = rdlv(row["ssim_paper"], prior_ssim.get(key))
            if scored.get("unmatched_metrics"):
                row["ssim_paper_unmatched"] = scored["unmatched_metrics"]["ssim_paper"]["mean"]
                row["ssim_std_unmatched"] = scored["unmatched_metrics"]["ssim_std"]["mean"]
            if res.masks is not None and len(res.masks) == len(oracle.masks):
                row.update(mask_metrics(res.masks, list(oracle.masks), job.p))
        rows.append(row)
    return rows


# -- Relative Data Leakage Value (NVFlare's leakage study, Hatamizadeh et al., IEEE TMI 2023) ---------
# RDLV = (SSIM(reconstruction, original) - SSIM(prior, original)) / SSIM(prior, original): how much
# the attack gained over what the attacker knew without the update. Our prior is the mean of the run's
# OTHER victims' images (leave-one-job-out): a typical image of the population, never the victim itself,
# and no data beyond what the run already holds. Scored in paper space like the headline SSIM.


def _key(images: torch.Tensor) -> str:
    return hashlib.sha1(images.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def prior_images(oracles: list[Oracle | None]) -> dict[str, torch.Tensor]:
    """Per victim batch (keyed by its content: several attacks share one), the mean image of every
    other batch's victims; empty with fewer than two distinct batches."""
    known = {_key(o.images): o.images for o in oracles if o is not None}
    if len(known) < 2:
        return {}
    total = sum(images.double().sum(0) for images in known.values())
    count = sum(images.shape[0] for images in known.values())
    return {
        key: ((total - images.double().sum(0)) / (count - images.shape[0])).to(images.dtype)
        for key, images in known.items()
    }


def prior_for(priors: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor | None:
    """The prior of one victim batch from :func:`prior_images`'s dict (None: no prior)."""
    return priors.get(_key(images))


def prior_score(originals: torch.Tensor, prior: torch.Tensor, mean: Any, std: Any) -> float:
    """SSIM (paper space) of the prior image against each original, averaged over the batch."""
    scored = score_batch(originals, prior.expand_as(originals).contiguous(), mean, std, match=False)
    return scored["metrics"]["ssim_paper"]["mean"]


def rdlv(ssim_recon: float | None, ssim_prior: float | None) -> float | None:
    """The RDLV of one job (None without a prior, or when the prior's SSIM is not positive)."""
    if ssim_recon is None or ssim_prior is None or ssim_prior <= 0:
        return None
    return (ssim_recon - ssim_prior) / ssim_prior
