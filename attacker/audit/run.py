"""`attacker audit RUN_DIR`: the attack run (or a finished one reused), the scores, the report files."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedsim.capture import load_capture

from ..attacks import make_attack
from ..metrics import LpipsScorer
from ..pipeline import load_jobs, run_attack
from ..report import atomic_write, image_grid
from .inputs import (
    DEFAULT_ATTACKS,
    DEFAULT_THRESHOLD,
    THRESHOLD_METRIC,
    AuditError,
    AuditOptions,
    _names,
    attack_config,
    check_out,
    check_run_dir,
    closed_forms_skipped,
)
from .render import GRID_FILE, markdown, verdict
from .scores import score_images, summarize
from .setting import describe_setting, with_privacy_spent

GRID_MAX_JOBS = 16


def run_audit(
    run_dir: str | Path, out: str | Path, options: AuditOptions, log: Callable[[str], Any] = print
) -> dict[str, Any]:
    """Audit ``run_dir`` into ``out``: attack (or reuse a finished attack run there), score, report.
    Returns the audit (``audit.json``'s content)."""
    run_dir, out = Path(run_dir), Path(out)
    threshold = options.threshold
    if not (isinstance(threshold, int | float) and 0 < threshold <= 1):
        raise AuditError(f"--threshold is a [0,1] SSIM and must be in (0, 1], got {threshold}")
    check_run_dir(run_dir)
    reuse = check_out(out, run_dir)
    cfg = attack_config(out, run_dir, options, reuse)
    attacks = list(dict.fromkeys(_names(cfg.attacks)))
    server = [a for a in attacks if not make_attack(a).receives_oracle]
    if not server:
        raise AuditError(
            f"the attacks {', '.join(attacks)} all need the oracle; the audit needs one a real server can run "
            f"(e.g. {', '.join(DEFAULT_ATTACKS)})"
        )
    if reuse:
        log(f"reusing the finished attack run in {out} ({', '.join(attacks)})")
    else:
        run_attack(cfg, out, progress=options.progress, log=log)
    skipped = closed_forms_skipped(out)
    attacks = [a for a in attacks if a not in skipped]
    server = [a for a in server if a not in skipped]
    jobs, oracles = load_jobs(cfg, log)
    first = load_capture(jobs[0].meta["capture"], check_model=False)
    setting = with_privacy_spent(describe_setting(first), run_dir)
    scorer = LpipsScorer(allow_download=True, download_timeout=5.0) if options.lpips else None
    tensors = load_file(str(out / "reconstructions.safetensors"))
    scores = score_images(jobs, oracles, tensors, attacks, threshold, scorer)
    if not scores.images:
        raise AuditError(f"no captured client-round of {run_dir} has an oracle record to score against")
    # the budget the server's attacks had (a run's captures share one model, hence one profile entry)
    optimized = [a for a in cfg.attack_configs() if not a.receives_oracle and not a.solver]
    cap = max((cfg.for_model(a, jobs[0].spec).max_iterations for a in optimized), default=0)
    summary = summarize(scores.images, server, threshold, cap, len(scores.clients))
    summary["closed_forms_skipped"] = sorted(skipped)
    lpips_state = (
        "not computed (--no-lpips)"
        if scorer is None
        else "computed (AlexNet backbone)"
        if scorer.available
        else f"unavailable: {scorer.unavailable_cause}"
    )
    audit = {
        "run_dir": str(run_dir),
        "audit_dir": str(out),
        "threshold": {"metric": THRESHOLD_METRIC, "space": "[0,1]", "value": threshold},
        "setting": setting,
        "profile": cfg.profile,
        "attacks": attacks,
        "lpips": lpips_state,
        "summary": summary,
        "clients": [asdict(c) for c in scores.clients],
        "images": [asdict(r) for r in scores.images],
        "unscored": scores.unscored,
        "grid": GRID_FILE,
        "closed_forms_skipped": skipped,
    }
    audit["verdict"] = verdict(setting, summary, threshold)
    by_id = {j.job_id: (j, o) for j, o in zip(jobs, oracles)}
    grid_jobs, grid_oracles = [by_id[r.job_id][0] for r in scores.grid], [by_id[r.job_id][1] for r in scores.grid]
    atomic_write(out / GRID_FILE, image_grid(grid_jobs, grid_oracles, scores.grid, GRID_MAX_JOBS))
    atomic_write(out / "audit.json", json.dumps(audit, indent=1, allow_nan=False, default=_json_default))
    atomic_write(out / "audit.md", markdown(audit))
    return audit


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


def audit_command(args: Any, console: Any) -> int:
    """`attacker audit`: the CLI's options to :func:`run_audit`; prints the verdict and the report's path.
    Bad input raises (a ConfigError: the CLI prints one line and exits 2)."""
    from datetime import datetime

    options = AuditOptions(
        attacks=args.attacks,
        iterations=args.iterations,
        threshold=DEFAULT_THRESHOLD if args.threshold is None else args.threshold,
        device=args.device,
        lpips=not args.no_lpips,
        profile=args.profile,
        progress=not args.quiet,
    )
    out = Path(args.out or f"runs/audit-{datetime.now():%Y%m%d-%H%M%S}")
    audit = run_audit(args.run_dir, out, options, log=lambda m: console.print(m, highlight=False))
    console.print(audit["verdict"], highlight=False, soft_wrap=True)
    console.print(f"audit report: [bold]{out / 'audit.md'}[/bold] (audit.json, {GRID_FILE})", highlight=False)
    return 0
