"""The audit's input: its options, the checks that run before anything is written, and the attack
run's config (a finished one to reuse, or a new one for the run's captures)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fedsim.capture import list_captures, list_oracles

from ..attacks import CLOSED_FORM_GROUP, attack_names
from ..config import ConfigError, RunConfig, load_config, parse_config
from ..profiles import DEFAULT_PROFILE

DEFAULT_THRESHOLD = 0.6
THRESHOLD_METRIC = "ssim_std"  # SSIM on images mapped back to [0,1]: the space a person looks at
# Closed forms first (one shot: an exact leak is found before any optimization), then IG and DIA;
# plus wiig (the oracle's bound) when the run kept the oracle. A closed form that does not apply is
# skipped, its reason in the report.
# dia_hold (DIA in the images' span from the closed forms' answer, holding the images they pinned down) where
# the captures give the images' span (a first Linear, a gradient or an SGD round), skipped with the reason
# elsewhere, as the closed forms that do not apply: ahead of dia_span wherever both were measured
# (docs/results/deployed.md), so the audit runs it in dia_span's place
DEFAULT_ATTACKS = (CLOSED_FORM_GROUP, "ig_eval", "dia", "dia_hold")
IMAGE_KEYS = ("ssim_paper", "ssim_std", "ssim_minmax", "psnr_paper", "lpips")


class AuditError(ConfigError):
    """Input the audit cannot take (the CLI: one line, exit 2, nothing written)."""


@dataclass
class AuditOptions:
    """The audit's choices; None: the attack run's (when reused) or the defaults."""

    attacks: list[str] | None = None
    iterations: int | None = None
    threshold: float = DEFAULT_THRESHOLD
    device: str | None = None
    lpips: bool = True
    profile: str | None = None
    progress: bool = True


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise AuditError(f"{run_dir} is not a folder (expected a federated run folder: fedsim simulate --run-dir)")
    if not list_captures(run_dir):
        if not (run_dir / "config.json").is_file() and not (run_dir / "captures").is_dir():
            raise AuditError(f"{run_dir} is not a federated run folder (no config.json, no captures/)")
        raise AuditError(f"{run_dir} holds no captures: run the federation with --capture-rounds (e.g. 1) and --audit")
    if not list_oracles(run_dir):
        raise AuditError(
            f"{run_dir} was not audited: it has no oracle/ (the clients' true images), which the audit scores "
            "the reconstructions against; run the federation with --audit"
        )


def _same_folder(a: str | Path, b: Path) -> bool:
    return Path(a).expanduser().resolve() == b.expanduser().resolve()


def check_out(out: Path, run_dir: Path) -> bool:
    """Whether ``out`` holds a finished attack run of ``run_dir``'s captures (to reuse); an error when
    it cannot take the audit. An interrupted attack run of the same captures is resumed by the pipeline."""
    resolved, fed = out.expanduser().resolve(), run_dir.expanduser().resolve()
    if resolved == fed or fed in resolved.parents:
        raise AuditError(f"--out {out} lies inside the federated run folder {run_dir}; choose another --out")
    if out.exists() and not out.is_dir():
        raise AuditError(f"--out {out} exists and is not a folder; choose another --out")
    marker = out / "run.json"
    if not marker.is_file():
        if out.exists() and any(out.iterdir()):
            raise AuditError(f"{out} exists and is not a run folder of this tool; choose another --out")
        return False
    cfg = load_config(out / "config.yaml")
    if cfg.victims.source != "captures" or not _same_folder(cfg.victims.captures or "", run_dir):
        other = cfg.victims.captures if cfg.victims.source == "captures" else f"{cfg.victims.source} victims"
        raise AuditError(f"{out} holds an attack run of other victims ({other}); choose another --out")
    try:
        return json.loads(marker.read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def _names(attacks: list[str]) -> list[str]:
    return attack_names(attacks)  # aliases (ig) to the preset's name (ig_eval), closed_form to its solvers


def attack_config(out: Path, run_dir: Path, options: AuditOptions, reuse: bool) -> RunConfig:
    """The attack run's config: the finished one in ``out`` (options that contradict it are refused), or
    a new one for ``run_dir``'s captures."""
    if reuse:
        cfg = load_config(out / "config.yaml")
        ran = {
            "--attacks": (sorted(set(_names(cfg.attacks))), sorted(set(_names(options.attacks or cfg.attacks)))),
            "--iterations": (cfg.attack_overrides.get("max_iterations"), options.iterations),
            "--profile": (cfg.profile, options.profile),
        }
        for flag, (theirs, asked) in ran.items():
            if asked is not None and asked != theirs:
                raise AuditError(
                    f"{out} holds a finished attack run with {flag} {theirs}, not {asked}; drop {flag} to "
                    "report that run, or choose another --out"
                )
        return cfg
    attacks = options.attacks or [*DEFAULT_ATTACKS, *(["wiig"] if list_oracles(run_dir) else [])]
    return parse_config(
        {
            # absolute: a later audit with --out here recognises the captures from any working folder
            "victims": {"source": "captures", "captures": str(run_dir.expanduser().resolve())},
            "attacks": list(attacks),
            "attack_overrides": {"max_iterations": options.iterations} if options.iterations is not None else {},
            "device": options.device or "auto",
            "lpips": options.lpips,
            "profile": options.profile or DEFAULT_PROFILE,
            "skip_inapplicable": not options.attacks,  # the defaults: each where it applies
        }
    )


def closed_forms_skipped(out: Path) -> dict[str, str]:
    """The closed forms the attack run skipped, with why (``closed_form.json``; a run from before
    closed forms has none)."""
    try:
        return dict(json.loads((out / "closed_form.json").read_text()).get("skipped", {}))
    except (OSError, ValueError, AttributeError):
        return {}
