"""Score results against the oracle: image metrics in both value spaces, LPIPS, MMD and TRD."""

from __future__ import annotations

from typing import Any

from fedsim.data import get_spec

from .inversion import JobResult
from .jobs import Oracle, VictimJob
from .metrics import LpipsScorer, mask_metrics, score_batch

METRIC_KEYS = ("ssim_paper", "psnr_paper", "mse_paper", "ssim_std", "psnr_std", "mse_std", "lpips")


def score_results(
    jobs: list[VictimJob],
    oracles: list[Oracle | None],
    results: list[JobResult],
    lpips: LpipsScorer | None = None,
) -> list[dict[str, Any]]:
    """One row per job: what was attacked, how the optimization ended, and every metric."""
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
            "defense": job.meta.get("defense", "none"),  # the capture's defense and the attack's adaptation to it
            "adaptation": job.meta.get("adaptation", "none"),
            "status": res.status,
            "iterations": res.iterations,
            "best_iteration": res.best_iteration,
            "best_loss": res.best_loss,
            "optimized_values": res.optimized_values,
        }
        if oracle is not None:
            spec = get_spec(job.spec.dataset, job.spec.input_shape[0])
            scored = score_batch(oracle.images, res.images, spec.mean, spec.std, lpips_scorer=lpips, labels=job.labels)
            for key in METRIC_KEYS:
                entry = scored["metrics"].get(key)
                row[key] = entry["mean"] if entry else None
            row["matched"] = scored["matched"]
            if scored.get("unmatched_metrics"):
                row["ssim_paper_unmatched"] = scored["unmatched_metrics"]["ssim_paper"]["mean"]
                row["ssim_std_unmatched"] = scored["unmatched_metrics"]["ssim_std"]["mean"]
            if res.masks is not None and len(res.masks) == len(oracle.masks):
                row.update(mask_metrics(res.masks, list(oracle.masks), job.p))
        rows.append(row)
    return rows
