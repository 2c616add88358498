"""`attacker audit RUN_DIR`: one report a person can act on, for one audited federated run.

A thin layer over the attack pipeline: it runs the attacks on the run's captures
(``pipeline.run_attack``, into the audit folder), or reuses a finished attack run of the same captures
found there, then scores every audited image against the oracle with the same scorer as the run
(``metrics.score_batch``), keeps per image the best of the attacks a real server can run (IG, DIA, ...;
never WIIG, which replays the clients' true masks and is reported apart as the oracle's upper bound),
and writes ``audit.md``, ``audit.json`` and ``audit_grid.png`` beside the attack run's own files.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedsim.capture import Capture, list_captures, list_oracles, load_capture
from fedsim.capture_kinds import CAPTURE_KINDS
from fedsim.client_step import CLIENT_OPTIMIZERS
from fedsim.data import get_spec
from fedsim.defenses import DEFENSES, NO_DEFENSE

from .attacks import CLOSED_FORM_GROUP, attack_names, make_attack
from .closed_form.solvers import SOLVERS
from .config import ConfigError, RunConfig, load_config, parse_config
from .jobs import JobResult, Oracle, VictimJob
from .metrics import LpipsScorer, score_batch
from .pipeline import load_jobs, run_attack
from .profiles import DEFAULT_PROFILE
from .report import atomic_write, fmt_mean_std, image_grid
from .scoring import prior_for, prior_images, prior_score, rdlv

DEFAULT_THRESHOLD = 0.6
THRESHOLD_METRIC = "ssim_std"  # SSIM on images mapped back to [0,1]: the space a person looks at
# Closed forms first (one shot: an exact leak is found before any optimization), then IG and DIA;
# plus wiig (the oracle's bound) when the run kept the oracle. A closed form that does not apply is
# skipped, its reason in the report.
DEFAULT_ATTACKS = (CLOSED_FORM_GROUP, "ig_eval", "dia")
IMAGE_KEYS = ("ssim_paper", "ssim_std", "ssim_minmax", "psnr_paper", "lpips")
GRID_FILE = "audit_grid.png"
GRID_MAX_JOBS = 16
LABELS = {
    "ig_eval": "IG",
    "ig_train": "IG (train)",
    "wiig": "WIIG",
    "dia": "DIA",
    "april": "APRIL",
    "dia_april": "DIA+APRIL",
    "dia_onestep": "DIA on Δ/(lr·K)",
    "vit_patches": "the closed-form patch solve",
    "first_linear": "the closed-form first-Linear solve",
}


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


def label(attack: str) -> str:
    return LABELS.get(attack, attack)


def _listing(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# -- input checks: all before anything is written ---------------------------------------------------


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
        }
    )


def closed_forms_skipped(out: Path) -> dict[str, str]:
    """The closed forms the attack run skipped, with why (``closed_form.json``; a run from before
    closed forms has none)."""
    try:
        return dict(json.loads((out / "closed_form.json").read_text()).get("skipped", {}))
    except (OSError, ValueError, AttributeError):
        return {}


# -- the setting, from the captures' records ---------------------------------------------------------


def describe_setting(capture: Capture) -> dict[str, Any]:
    """p, the model, what the server captured (one-step gradient, or a FedAvg update with K and the
    optimizer) and the defense, as one capture's record states them."""
    hp = capture.hyperparameters
    kind = CAPTURE_KINDS[capture.kind]
    opt = ""  # the client's optimizer matters where its local round is replayed
    if kind.replays_local_round:
        algorithm = CLIENT_OPTIMIZERS.get(str(hp.get("optimizer")))
        opt = str(hp.get("optimizer")) if algorithm is None else algorithm.words(hp.get("momentum", 0))
    short, text = kind.setting(capture, opt)
    defense = capture.defense
    strength = ""
    if defense in DEFENSES and DEFENSES[defense].level and DEFENSES[defense].level in hp:
        strength = f" ({DEFENSES[defense].level_name} = {hp[DEFENSES[defense].level]})"
    return {
        "model": capture.spec.name,
        "dataset": capture.spec.dataset,
        "p": capture.p,
        "capture_kind": capture.kind,
        "capture": short,
        "capture_text": text,
        "local_steps": capture.local_steps,
        "optimizer": hp.get("optimizer") if kind.replays_local_round else None,
        "defense": defense,
        "defense_short": "no defense" if defense == NO_DEFENSE else f"defense {defense}{strength}",
        "defense_text": "no defense"
        if defense == NO_DEFENSE
        else f"defense {defense}{strength}: the server captured {capture.defense_captured or 'the defended reply'}",
    }


def with_privacy_spent(setting: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Under a DP defense the setting says the epsilon spent over the whole run, as the run's
    results.json (``privacy``) has it: the clients' Opacus accountant for dp-sgd, Flower's accountant
    composed over the rounds for the update-level DP defenses. Unchanged where the run has no such
    record (still running, or a defense without noise)."""
    if setting["defense"] == NO_DEFENSE:
        return setting
    try:
        privacy = json.loads((run_dir / "results.json").read_text()).get("privacy")
        eps, delta = privacy.get("epsilon"), float(privacy["delta"])
        accountant = str(privacy.get("accountant", "the run's accountant")).split(" (")[0]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return setting
    if eps is None or not math.isfinite(float(eps)):
        if DEFENSES.get(setting["defense"]) is None or not DEFENSES[setting["defense"]].in_local_round:
            return setting
        spent = "clipping only, no noise: no privacy guarantee"  # dp-sgd with dp-noise-from none
    else:
        spent = f"spent ε = {float(eps):.3g} at δ = {delta:g} over the run ({accountant})"
        setting = {**setting, "privacy": {"epsilon": float(eps), "delta": delta, "accountant": accountant}}
    return {
        **setting,
        "defense_short": f"{setting['defense_short']}, {spent}",
        "defense_text": f"{setting['defense_text']}; {spent}",
    }


# -- scoring: per image, per attack; the best of the server's attacks ---------------------------------


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
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[JobResult], list[str]]:
    """Per image and per job (client and round) the scores of every attack, the best of the server's,
    the oracle's bound; the grid's rows; the jobs without ground truth (not scored)."""
    oracle_side = {a for a in attacks if make_attack(a).receives_oracle}
    images: list[dict[str, Any]] = []
    clients: list[dict[str, Any]] = []
    grid: list[JobResult] = []
    unscored: list[str] = []
    priors = prior_images(oracles)
    for job, oracle in zip(jobs, oracles):
        if oracle is None:
            unscored.append(job.job_id)
            continue
        spec = get_spec(job.spec.dataset, job.spec.input_shape[0])
        scored: dict[str, tuple[dict[str, Any], torch.Tensor]] = {}
        for attack in attacks:
            recon = tensors.get(f"{job.job_id}/{attack}/images")
            if recon is not None:  # e.g. WIIG does not run on the Δ/(lr·K) baseline of an update
                result = score_batch(oracle.images, recon, spec.mean, spec.std, lpips_scorer=lpips, labels=job.labels)
                scored[attack] = (result, recon)
        if not any(a not in oracle_side for a in scored):
            raise AuditError(f"the attack run holds no reconstruction of {job.job_id} by an attack without oracle")
        rows = []
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
                {
                    "job": job.job_id,
                    "round": job.meta.get("round"),
                    # an aggregate's images each belong to one of its clients
                    "client": job.meta["image_clients"][i] if "image_clients" in job.meta else job.meta.get("client"),
                    "index": i,
                    "label": int(job.labels[i]),
                    "attacks": per_attack,
                    "best_attack": best,
                    "best": per_attack[best],
                    "recognisable": _rank(per_attack[best]) >= threshold,
                    "oracle_attack": bound,
                    "oracle": per_attack[bound] if bound else None,
                    "oracle_recognisable": bound is not None and _rank(per_attack[bound]) >= threshold,
                }
            )
        images += rows
        prior = prior_for(priors, oracle.images)
        paper = _mean([r["best"]["ssim_paper"] for r in rows])
        prior_ssim = prior_score(oracle.images, prior, spec.mean, spec.std) if prior is not None else None
        has_bound = any(r["oracle_attack"] for r in rows)
        clients.append(
            {
                "job": job.job_id,
                "round": job.meta.get("round"),
                "client": job.meta.get("client"),
                "images": len(rows),
                "best_attacks": dict(Counter(r["best_attack"] for r in rows)),
                **{key: _mean([r["best"][key] for r in rows]) for key in IMAGE_KEYS},
                "rdlv": rdlv(paper, prior_ssim),
                "recognisable": sum(r["recognisable"] for r in rows),
                "oracle": {
                    "ssim_std": _mean([r["oracle"][THRESHOLD_METRIC] for r in rows if r["oracle"]]),
                    "recognisable": sum(r["oracle_recognisable"] for r in rows),
                }
                if has_bound
                else None,
            }
        )
        empty = dict(masks=None, best_loss=math.nan, best_iteration=0, iterations=0, status="", optimized_values=0)
        grid.append(JobResult(job.job_id, "best attack", torch.stack(best_images), **empty))
        if has_bound and len(bound_images) == len(rows):
            grid.append(JobResult(job.job_id, "WIIG (oracle)", torch.stack(bound_images), **empty))
    return images, clients, grid, unscored


# -- the verdict and the report ----------------------------------------------------------------------


def verdict(setting: dict[str, Any], summary: dict[str, Any], threshold: float) -> str:
    """The audit's outcome in plain words: who reconstructed how many images, in which setting."""
    n, k = summary["images"], summary["recognisable"]
    server = _listing([label(a) for a in summary["server_attacks"]])
    where = (
        f"With p = {setting['p']:g} and {setting['capture']} on {setting['model']} / {setting['dataset']} "
        f"({setting['defense_short']})"
    )
    rule = f"[0,1] SSIM ≥ {threshold:g}"
    protection = f"Dropout at p = {setting['p']:g}" if setting["p"] else "Training without dropout (p = 0)"
    if setting["defense"] != NO_DEFENSE:
        protection += f" with {setting['defense_short']}"
    if k:
        winners = summary["recognisable_by_attack"]
        who = (
            label(next(iter(winners)))
            if len(winners) == 1
            else f"{_listing([label(a) for a in winners])} together "
            f"({', '.join(f'{label(a)} {c}' for a, c in winners.items())})"
        )
        text = (
            f"{where}, {who} reconstructed {k} of {n} audited images recognisably ({rule}; "
            f"{100 * k / n:.0f} %), from the captures alone, as the curious server can. "
            f"{protection} does not protect these clients' images."
        )
        for name in winners:  # a closed form names its mechanism: what in the gradient gives the image away
            if name in SOLVERS:
                text += f" {label(name).capitalize()}: {SOLVERS[name].mechanism}."
    else:
        best = summary["best_ssim_std"]
        reached = f"; the best image reached [0,1] SSIM {best:.2f}" if best is not None else ""
        text = (
            f"{where}, {server} reconstructed none of the {n} audited images recognisably ({rule}{reached}). "
            f"That is what these attacks achieved with up to "
            f"{summary['iterations_cap']:,} iterations per job, not a guarantee: longer or stronger attacks, "
            "or a lower threshold, may find more."
        )
        if summary.get("closed_forms_skipped") and not any(a in SOLVERS for a in summary["server_attacks"]):
            text += f" No closed-form attack applies ({', '.join(summary['closed_forms_skipped'])}: see the report)."
    bound = summary.get("oracle_bound")
    if bound:
        text += (
            f" {label(bound['attack'])}, which replays the clients' true dropout masks from the audit's oracle, "
            f"reconstructed {bound['recognisable']} of {bound['images']} recognisably: the optimization's bound, "
            "reported apart because a real server has no oracle."
        )
    return text


def _cell(value: float | None, digits: int = 3) -> str:
    return fmt_mean_std(value, None, digits)


def markdown(audit: dict[str, Any]) -> str:
    s, summary, thr = audit["setting"], audit["summary"], audit["threshold"]["value"]
    bound = summary.get("oracle_bound")
    head = (
        "| round | client | images | best attack | SSIM (paper space) | SSIM ([0,1]) | SSIM (min-max) | RDLV | LPIPS "
        f"| recognisable (≥ {thr:g}) |"
    )
    if bound:
        head += f" {label(bound['attack'])} SSIM [0,1] (oracle) | recognisable |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in audit["clients"]:
        best = ", ".join(f"{label(a)} ({n})" if c["images"] > 1 else label(a) for a, n in c["best_attacks"].items())
        row = (
            f"| {c['round']} | {c['client']} | {c['images']} | {best} | {_cell(c['ssim_paper'])} | "
            f"{_cell(c['ssim_std'])} | {_cell(c['ssim_minmax'])} | {_cell(c['rdlv'], 2)} | {_cell(c['lpips'])} | "
            f"{c['recognisable']} of {c['images']} |"
        )
        if bound:
            o = c["oracle"] or {}
            row += f" {_cell(o.get('ssim_std'))} | {o.get('recognisable', 0)} of {c['images']} |"
        lines.append(row)
    unscored = (
        f"\n{len(audit['unscored'])} client-round(s) without an oracle record were not scored: "
        f"{', '.join(audit['unscored'])}.\n"
        if audit["unscored"]
        else ""
    )
    server = _listing([label(a) for a in summary["server_attacks"]])
    alone = ""
    if len(summary["server_attacks"]) > 1:
        alone = " (each alone: " + ", ".join(f"{label(a)} {n}" for a, n in summary["recognisable_alone"].items()) + ")"
    oracle_line = (
        f"{label(bound['attack'])} (the oracle's upper bound: it replays the clients' true dropout masks, which "
        "only this simulation's audit mode recorded; a real server has no oracle, so it never counts as the "
        "best attack and is reported apart)"
        if bound
        else "no oracle attack"
    )
    skipped_lines = "".join(f"\n- Skipped: {reason}." for reason in audit.get("closed_forms_skipped", {}).values())
    return f"""# Gradient-leakage audit of `{audit["run_dir"]}`

{audit["verdict"]}

## Setting (from the captures' records)

- Model: {s["model"]} on {s["dataset"]}, dropout p = {s["p"]:g}.
- What the curious server captured: {s["capture_text"]}; {summary["clients_rounds"]} client-round(s), \
{summary["images"]} image(s) audited.
- Defense: {s["defense_text"]}.
- Attacks: {server}, which need only the captures (the best of them per image counts), and {oracle_line}. \
Up to {summary["iterations_cap"]:,} iterations per job, attack profile {audit["profile"]}; every attack's own \
table, grid and curves: [report.md](report.md).
- Recognisable: [0,1] SSIM ≥ {thr:g} (`--threshold`): {summary["recognisable"]} of {summary["images"]} \
({100 * summary["fraction"]:.0f} %) by the best attack per image{alone}.
- LPIPS: {audit["lpips"]}.{skipped_lines}

## Per client and round (the best attack per image)

{chr(10).join(lines)}
{unscored}
SSIM in *paper space* is computed on normalized tensors (data range 1/std, the space of the paper's
tables), *[0,1]* on images mapped back to [0,1], *min-max* on each image scaled by its own range.
RDLV: the gain in paper-space SSIM over a prior (the mean image of the run's other clients), relative
to the prior's; "–" with a single client-round. Per image and per attack: `audit.json`.

## Originals against reconstructions

![originals (top row), the best reconstruction per image, the oracle's bound]({GRID_FILE})
"""


def _summary(
    images: list[dict[str, Any]], server: list[str], threshold: float, cap: int, n_jobs: int
) -> dict[str, Any]:
    recognised = [r for r in images if r["recognisable"]]
    n = len(images)
    summary: dict[str, Any] = {
        "clients_rounds": n_jobs,
        "images": n,
        "recognisable": len(recognised),
        "fraction": len(recognised) / n if n else 0.0,
        "recognisable_by_attack": dict(Counter(r["best_attack"] for r in recognised)),
        # each attack on its own: what IG alone, or DIA alone, would have shown
        "recognisable_alone": {
            a: sum(a in r["attacks"] and _rank(r["attacks"][a]) >= threshold for r in images) for a in server
        },
        "best_ssim_std": _finite(max(_rank(r["best"]) for r in images)),
        "server_attacks": server,
        "iterations_cap": cap,
        "oracle_bound": None,
    }
    bounded = [r for r in images if r["oracle_attack"]]
    if bounded:
        summary["oracle_bound"] = {
            "attack": Counter(r["oracle_attack"] for r in bounded).most_common(1)[0][0],
            "images": len(bounded),
            "recognisable": sum(r["oracle_recognisable"] for r in bounded),
        }
    return summary


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
    images, clients, grid, unscored = score_images(jobs, oracles, tensors, attacks, threshold, scorer)
    if not images:
        raise AuditError(f"no captured client-round of {run_dir} has an oracle record to score against")
    # the budget the server's attacks had (a run's captures share one model, hence one profile entry)
    optimized = [a for a in cfg.attack_configs() if not a.receives_oracle and not a.solver]
    cap = max((cfg.for_model(a, jobs[0].spec).max_iterations for a in optimized), default=0)
    summary = _summary(images, server, threshold, cap, len(clients))
    summary["closed_forms_skipped"] = sorted(skipped)
    lpips_state = (
        "not computed (--no-lpips)"
        if scorer is None
        else "computed (AlexNet backbone)"
        if scorer.available
        # the scorer's message without its lead and its closing advice: the reason, in one sentence
        else "unavailable: "
        + (scorer.unavailable_reason or "").removeprefix("LPIPS unavailable: ").split(". LPIPS will")[0]
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
        "clients": clients,
        "images": images,
        "unscored": unscored,
        "grid": GRID_FILE,
        "closed_forms_skipped": skipped,
    }
    audit["verdict"] = verdict(setting, summary, threshold)
    by_id = {j.job_id: (j, o) for j, o in zip(jobs, oracles)}
    grid_jobs, grid_oracles = [by_id[r.job_id][0] for r in grid], [by_id[r.job_id][1] for r in grid]
    atomic_write(out / GRID_FILE, image_grid(grid_jobs, grid_oracles, grid, GRID_MAX_JOBS))
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
