"""Per audited image and per attack its scores against the oracle, the best of the attacks a real
server can run (never WIIG: the oracle's bound, kept apart), and per client and round their means."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from fedsim.data import get_spec

from ..attacks import make_attack
from ..closed_form.solvers import follows_labels
from ..jobs import JobResult, Oracle, VictimJob
from ..metrics import LpipsScorer, score_batch
from ..scoring import prior_for, prior_images, prior_score, rdlv
from .inputs import THRESHOLD_METRIC, AuditError

IMAGE_KEYS = ("ssim_paper", "ssim_std", "ssim_minmax", "psnr_paper", "lpips")


@dataclass
class ImageScore:
    """One audited image: every attack's scores, the best server attack's, the oracle's bound."""

    job: str
    round: Any
    client: Any
    index: int
    label: int
    attacks: dict[str, dict[str, float | None]]
    best_attack: str
    best: dict[str, float | None]
    recognisable: bool
    oracle_attack: str | None
    oracle: dict[str, float | None] | None
    oracle_recognisable: bool


@dataclass
class ClientScore:
    """One client and round (a job): the means of its images' best scores and how many are recognisable."""

    job: str
    round: Any
    client: Any
    images: int
    best_attacks: dict[str, int]
    ssim_paper: float | None
    ssim_std: float | None
    ssim_minmax: float | None
    psnr_paper: float | None
    lpips: float | None
    rdlv: float | None
    recognisable: int
    oracle: dict[str, Any] | None


@dataclass
class Scores:
    """The audit's scoring: per image, per client and round, the grid's rows (the best reconstruction
    per image, the oracle's), and the jobs without ground truth (not scored)."""

    images: list[ImageScore] = field(default_factory=list)
    clients: list[ClientScore] = field(default_factory=list)
    grid: list[JobResult] = field(default_factory=list)
    unscored: list[str] = field(default_factory=list)


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _rank(entry: dict[str, Any]) -> float:
    score = entry.get(THRESHOLD_METRIC)
    return -math.inf if score is None else score


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def score_images(
    jobs: list[VictimJob],
    oracles: list[Oracle | None],
    tensors: dict[str, torch.Tensor],
    attacks: list[str],
    threshold: float,
    lpips: LpipsScorer | None,
) -> Scores:
    """Per image and per job (client and round) the scores of every attack, the best of the server's,
    the oracle's bound; the grid's rows; the jobs without ground truth (not scored)."""
    oracle_side = {a for a in attacks if make_attack(a).receives_oracle}
    out = Scores()
    priors = prior_images(oracles)
    for job, oracle in zip(jobs, oracles):
        if oracle is None:
            out.unscored.append(job.job_id)
            continue
        spec = get_spec(job.spec.dataset, job.spec.input_shape[0])
        scored: dict[str, tuple[dict[str, Any], torch.Tensor]] = {}
        for attack in attacks:
            recon = tensors.get(f"{job.job_id}/{attack}/images")
            if recon is not None:  # e.g. WIIG does not run on the Δ/(lr·K) baseline of an update
                labels = job.labels if follows_labels(attack) else None
                result = score_batch(oracle.images, recon, spec.mean, spec.std, lpips_scorer=lpips, labels=labels)
                scored[attack] = (result, recon)
        if not any(a not in oracle_side for a in scored):
            raise AuditError(f"the attack run holds no reconstruction of {job.job_id} by an attack without oracle")
        rows: list[ImageScore] = []
        best_images, bound_images = [], []
        for i in range(oracle.images.shape[0]):
            per_attack = {
                attack: {
                    key: _finite(result["metrics"][key]["per_image"][i]) if result["metrics"].get(key) else None
                    for key in IMAGE_KEYS
                }
                for attack, (result, _) in scored.items()
            }
            best = max((a for a in per_attack if a not in oracle_side), key=lambda a: _rank(per_attack[a]))
            bound = max((a for a in per_attack if a in oracle_side), key=lambda a: _rank(per_attack[a]), default=None)
            for chosen, into in ((best, best_images), (bound, bound_images)):
                if chosen is not None:  # the matched reconstruction of original i (Hungarian, B > 1)
                    result, recon = scored[chosen]
                    into.append(recon[result["permutation"][i]])
            rows.append(
                ImageScore(
                    job.job_id,
                    job.meta.get("round"),
                    # an aggregate's images each belong to one of its clients
                    job.meta["image_clients"][i] if "image_clients" in job.meta else job.meta.get("client"),
                    i,
                    int(job.labels[i]),
                    per_attack,
                    best,
                    per_attack[best],
                    _rank(per_attack[best]) >= threshold,
                    bound,
                    per_attack[bound] if bound else None,
                    bound is not None and _rank(per_attack[bound]) >= threshold,
                )
            )
        out.images += rows
        prior = prior_for(priors, oracle.images)
        paper = _mean([r.best["ssim_paper"] for r in rows])
        prior_ssim = prior_score(oracle.images, prior, spec.mean, spec.std) if prior is not None else None
        has_bound = any(r.oracle_attack for r in rows)
        means = {key: _mean([r.best[key] for r in rows]) for key in IMAGE_KEYS}
        out.clients.append(
            ClientScore(
                job.job_id,
                job.meta.get("round"),
                job.meta.get("client"),
                len(rows),
                dict(Counter(r.best_attack for r in rows)),
                **means,
                rdlv=rdlv(paper, prior_ssim),
                recognisable=sum(r.recognisable for r in rows),
                oracle={
                    "ssim_std": _mean([r.oracle[THRESHOLD_METRIC] for r in rows if r.oracle]),
                    "recognisable": sum(r.oracle_recognisable for r in rows),
                }
                if has_bound
                else None,
            )
        )
        empty = dict(masks=None, best_loss=math.nan, best_iteration=0, iterations=0, status="", optimized_values=0)
        out.grid.append(JobResult(job.job_id, "best attack", torch.stack(best_images), **empty))
        if has_bound and len(bound_images) == len(rows):
            out.grid.append(JobResult(job.job_id, "WIIG (oracle)", torch.stack(bound_images), **empty))
    return out


def summarize(images: list[ImageScore], server: list[str], threshold: float, cap: int, n_jobs: int) -> dict[str, Any]:
    """The audit's totals (its JSON form): counts, each attack alone, the best image, the oracle's bound."""
    recognised = [r for r in images if r.recognisable]
    n = len(images)
    summary: dict[str, Any] = {
        "clients_rounds": n_jobs,
        "images": n,
        "recognisable": len(recognised),
        "fraction": len(recognised) / n if n else 0.0,
        "recognisable_by_attack": dict(Counter(r.best_attack for r in recognised)),
        # each attack on its own: what IG alone, or DIA alone, would have shown
        "recognisable_alone": {
            a: sum(a in r.attacks and _rank(r.attacks[a]) >= threshold for r in images) for a in server
        },
        "best_ssim_std": _finite(max(_rank(r.best) for r in images)),
        "server_attacks": server,
        "iterations_cap": cap,
        "oracle_bound": None,
    }
    bounded = [r for r in images if r.oracle_attack]
    if bounded:
        summary["oracle_bound"] = {
            "attack": Counter(r.oracle_attack for r in bounded).most_common(1)[0][0],
            "images": len(bounded),
            "recognisable": sum(r.oracle_recognisable for r in bounded),
        }
    return summary
