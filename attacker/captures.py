"""Victim jobs from the curious server's captures (the federated path).

The attacker reads only captures. The oracle folder of an audited simulation run is read for
WIIG's masks and for scoring, and is handed to nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fedsim.capture import Capture, CaptureError, find_oracle, list_captures, load_capture

from .jobs import Oracle, VictimJob, model_from_job
from .labels import recover_labels

log = logging.getLogger(__name__)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def jobs_from_captures(
    paths: list[Path], run_dir: Path | None = None, label_policy: str = "known"
) -> tuple[list[VictimJob], list[Oracle | None], list[str]]:
    """Load gradient captures as jobs. Captures that share the same global weights (one round)
    share one weights object, so their jobs run as one batched optimization. Returns the jobs,
    their oracles (None where the run was not audited) and a note per skipped capture."""
    jobs: list[VictimJob] = []
    oracles: list[Oracle | None] = []
    skipped: list[str] = []
    weight_sets: list[dict[str, torch.Tensor]] = []
    for path in paths:
        capture: Capture = load_capture(path)
        if capture.kind != "gradient" or capture.gradient is None:
            skipped.append(f"{path.name}: a multi-step update, not a one-step gradient (not attacked)")
            continue
        weights = {k: v.float() if v.is_floating_point() else v for k, v in capture.weights.items()}
        for known in weight_sets:
            if _same_weights(known, weights):
                weights = known
                break
        else:
            weight_sets.append(weights)
        gradient = [g.float() for g in capture.gradient]
        job_id = f"r{capture.round:04d}_c{capture.client:03d}"
        meta = {"round": capture.round, "client": capture.client, "capture": str(path)}
        if label_policy == "known" and capture.labels is not None:
            job = VictimJob(job_id, capture.spec, weights, gradient, capture.labels.long(), "known", meta)
        else:
            job = VictimJob(job_id, capture.spec, weights, gradient, torch.zeros(capture.batch_size, dtype=torch.long), "recovered", meta)
            job.labels = recover_labels(model_from_job(job), gradient, capture.batch_size)
        oracle = None
        if run_dir is not None and (Path(run_dir) / "oracle").is_dir():
            try:
                record = find_oracle(run_dir, capture)
                oracle = Oracle(record.images.float(), tuple(m.float() for m in record.masks))
            except CaptureError as err:
                log.warning("no oracle for %s: %s", job_id, err)
        jobs.append(job)
        oracles.append(oracle)
    return jobs, oracles, skipped


def capture_paths(run_dir: Path | str) -> list[Path]:
    paths = list_captures(run_dir)
    if not paths:
        raise CaptureError(f"no captures found under {run_dir} (expected a run folder with captures/)")
    return paths
