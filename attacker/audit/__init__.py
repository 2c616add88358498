"""`attacker audit RUN_DIR`: one report a person can act on, for one audited federated run.

A thin layer over the attack pipeline: it runs the attacks on the run's captures
(``pipeline.run_attack``, into the audit folder), or reuses a finished attack run of the same captures
found there, then scores every audited image against the oracle with the same scorer as the run
(``metrics.score_batch``), keeps per image the best of the attacks a real server can run (IG, DIA, ...;
never WIIG, which replays the clients' true masks and is reported apart as the optimization's bound with the oracle),
and writes ``audit.md``, ``audit.json`` and ``audit_grid.png`` beside the attack run's own files.
"""

from __future__ import annotations

from .inputs import DEFAULT_ATTACKS, DEFAULT_THRESHOLD, THRESHOLD_METRIC, AuditError, AuditOptions
from .render import GRID_FILE, LABELS, label, markdown, verdict
from .run import audit_command, run_audit
from .scores import ClientScore, ImageScore, Scores, score_images
from .setting import describe_setting, with_privacy_spent

__all__ = [
    "DEFAULT_ATTACKS",
    "DEFAULT_THRESHOLD",
    "GRID_FILE",
    "LABELS",
    "THRESHOLD_METRIC",
    "AuditError",
    "AuditOptions",
    "ClientScore",
    "ImageScore",
    "Scores",
    "audit_command",
    "describe_setting",
    "label",
    "markdown",
    "run_audit",
    "score_images",
    "verdict",
    "with_privacy_spent",
]
