"""The paper's experiments as config files: cells of attack runs, resumable, reported beside the paper.

An experiment file (``configs/experiments/*.yaml``) holds defaults and a list of *cells*; each cell is one
``attacker run`` (model, dataset, p, B, attacks, attack overrides) plus the paper's value for every
metric the paper reports for it. ``run_experiments`` runs every selected cell into
``OUT/cells/<experiment>-<cell>`` (a finished cell is skipped, an interrupted one resumes from its
checkpoint), optionally trains the federation for Table 1's accuracy column, and writes
``OUT/results.md``, ``OUT/results.csv`` and ``OUT/figures/*.png``.

Parsing lives in :mod:`.spec`, running in :mod:`.run` (and, with ``--ray``, as Ray tasks in
:mod:`.cluster`), the report in :mod:`.report`, and the output folder's layout in :mod:`.layout`.
"""

from .cluster import ClusterError, ClusterLostError, RayOptions
from .layout import accuracy_dir, cell_dir, run_state
from .report import collect_rows, write_report
from .run import accuracy_jobs, capture_federation, run_accuracy, run_experiments
from .spec import (
    PAPER_VICTIMS,
    Cell,
    Experiment,
    ExperimentError,
    Settings,
    build_cell_config,
    cell_config,
    load_experiment,
    parse_experiment,
    select_cells,
)

__all__ = [
    "PAPER_VICTIMS",
    "Cell",
    "ClusterError",
    "ClusterLostError",
    "Experiment",
    "ExperimentError",
    "RayOptions",
    "Settings",
    "accuracy_dir",
    "accuracy_jobs",
    "build_cell_config",
    "capture_federation",
    "cell_config",
    "cell_dir",
    "collect_rows",
    "load_experiment",
    "parse_experiment",
    "run_accuracy",
    "run_experiments",
    "run_state",
    "select_cells",
    "write_report",
]
