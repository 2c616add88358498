"""`attacker`: run gradient inversion attacks from the command line.

attacker demo                      the main job: IG (eval), WIIG and DIA on MNIST victims of an MLP, p = 0.25
attacker demo --capture-kind update  the same on a FedAvg training round (4 local steps, fresh masks per step)
attacker run CONFIG.yaml           an attack config (see configs/attacks/)
attacker run --model vit --dataset cifar10 --p 0.25 --paper-victims   (the paper's victims, fetched on first use)
attacker watch RUN_DIR             attack a federated run's captures live, as the curious server writes them
attacker audit RUN_DIR             one report on an audited federated run: the best attack per image, a verdict
attacker presets                   the attack presets and their defaults
attacker experiment configs/experiments/table1.yaml --victims 4 --iterations 2000
                                   a paper experiment: every cell, resumable, results.md beside the paper
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedsim.capture import CaptureError
from fedsim.data import DataUnavailableError, VictimFileError
from fedsim.models import ModelSpecError
from fedsim.models.own import trust_factory
from fedsim.run_config import SETTINGS, RunConfigError, model_options

from .attacks import CLOSED_FORM_GROUP, PRESETS, REPLAY_ORDERS, AttackConfigError
from .closed_form.solvers import SOLVERS
from .config import DEVICES, ConfigError, RunConfig, parse_config, read_config_data
from .engine.checkpoints import CheckpointError
from .live import watch
from .pipeline import RunDirError, run_attack
from .profiles import DEFAULT_PROFILE, PROFILES
from .story import OFFLINE_DEMO, run_story

USER_ERRORS = (
    CaptureError,
    CheckpointError,
    ConfigError,
    DataUnavailableError,
    VictimFileError,
    ModelSpecError,
    AttackConfigError,
    RunDirError,
)

# A wide console when piped (CI logs, files) so the results table is not squeezed.
console = Console() if sys.stdout.isatty() else Console(width=160)


def build_parser() -> argparse.ArgumentParser:
    """The `attacker` parser with every subcommand; builds it only (docs/reference.md is rendered from it)."""
    # Over 80 lines, on purpose: a flat list of argparse declarations, one subcommand after the other,
    # reads as the CLI's reference; split, each subcommand's options would hide behind a call.
    parser = argparse.ArgumentParser(
        prog="attacker", description="Gradient inversion attacks (IG, WIIG, DIA, APRIL) on federated gradients."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def shared(p: argparse.ArgumentParser, key: str) -> None:
        """A setting the attack shares with the federation: name, type, choices and help from the one schema."""
        setting = SETTINGS[key]
        p.add_argument(f"--{key}", type=setting.type, choices=setting.choices, help=setting.help)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", help="run folder (default: runs/<command>-<time>)")
        for key in ("model", "dataset", "p", "victim-batch-size", "data-root", "labels"):
            shared(p, key)
        # Your own model's keyword options (a JSON object, as the federation's --model-options takes them).
        p.add_argument("--model-options", metavar="JSON", help=SETTINGS["model-options"].help)
        p.add_argument("--seed", type=int, help="seed of the dummies, masks and victim sampling of the attack")
        p.add_argument("--victims", type=int, help="number of victim images")
        p.add_argument("--victim-file", help="a victim file (torch.save dict of normalized inputs and targets)")
        p.add_argument("--captures", help="a federated run folder: attack its captured gradients")
        p.add_argument(
            "--attacks",
            nargs="+",
            help=f"attack presets: {', '.join(PRESETS)}; closed forms: {', '.join(SOLVERS)}, or "
            f"{CLOSED_FORM_GROUP} (every one that applies)",
        )
        p.add_argument("--iterations", type=int, help="iteration cap per job (paper: 20000)")
        p.add_argument(
            "--profile", choices=list(PROFILES), help=f"attack settings per model family (default: {DEFAULT_PROFILE})"
        )
        p.add_argument("--device", choices=DEVICES, help="auto: a GPU when there is one (default)")
        p.add_argument("--no-lpips", action="store_true", help="skip LPIPS")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    run = sub.add_parser("run", help="run an attack config")
    run.add_argument("config", nargs="?", help="YAML attack config")
    common(run)
    run.add_argument(
        "--paper-victims",
        action="store_true",
        help="the paper's victims of --dataset, from <data-root>/dia-victims (fetched with a pinned "
        "SHA-256 on first use, or by `make victims`; DLA_OFFLINE=1 turns fetching off)",
    )
    run.add_argument(
        "--replay-order",
        choices=REPLAY_ORDERS,
        help="update captures: known (in-order batches; default) or unknown (one dummy copy per epoch)",
    )
    demo = sub.add_parser("demo", help="the main job: federated training with dropout, capture, IG/WIIG/DIA, report")
    common(demo)
    demo.add_argument(
        "--offline-victims",
        action="store_true",
        help="skip the federation: attack victims from a client's partition directly",
    )
    demo.add_argument(
        "--capture-kind",
        choices=SETTINGS["capture-kind"].choices,
        default="gradient",
        help="gradient: the paper's one-step round; update: a FedAvg training round of 4 local SGD "
        "steps with fresh masks per step, attacked by replaying the steps",
    )
    watch = sub.add_parser("watch", help="attack a federated run's captures live, as they arrive")
    watch.add_argument("run_dir", help="the federated run folder (its captures/ is read, never written)")
    common(watch)
    watch.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the run folder")
    watch.add_argument("--timeout", type=float, help="give up after this many seconds")
    audit = sub.add_parser("audit", help="audit a federated run: attack its captures, one report with a verdict")
    audit.add_argument(
        "run_dir", help="the federated run folder, run with --audit (its captures/ and oracle/ are read)"
    )
    audit.add_argument(
        "--out",
        help="audit folder (default: runs/audit-<time>); one holding a finished attack "
        "run of the same captures is reused",
    )
    audit.add_argument(
        "--attacks",
        nargs="+",
        help="attack presets (default: closed_form ig_eval dia dia_hold, each where it applies, and wiig as the "
        "oracle's bound)",
    )
    audit.add_argument("--iterations", type=int, help="iteration cap per job (default: the profile's, paper 20000)")
    audit.add_argument("--threshold", type=float, help="recognisable: [0,1] SSIM >= this, in (0, 1] (default 0.6)")
    audit.add_argument("--model", help="the captures' own model (module.path:factory), to allow importing it")
    audit.add_argument(
        "--profile", choices=list(PROFILES), help=f"attack settings per model family (default: {DEFAULT_PROFILE})"
    )
    audit.add_argument("--device", choices=DEVICES, help="auto: a GPU when there is one (default)")
    audit.add_argument("--no-lpips", action="store_true", help="skip LPIPS")
    audit.add_argument("--quiet", action="store_true", help="no progress bar")
    sub.add_parser("presets", help="list the attack presets and the closed-form attacks")
    exp = sub.add_parser(
        "experiment", help="run a paper experiment (configs/experiments/*.yaml): cells, resume, report"
    )
    exp.add_argument("configs", nargs="+", metavar="CONFIG", help="experiment YAML file(s)")
    exp.add_argument("--out", help="output folder (default: runs/experiments/<names>)")
    exp.add_argument(
        "--victims",
        type=int,
        help="victim images per cell, rounded up to a multiple of B (default: the config's, paper 128)",
    )
    exp.add_argument("--iterations", type=int, help="iteration cap per job (paper: 20000)")
    exp.add_argument(
        "--profile",
        choices=list(PROFILES),
        default=DEFAULT_PROFILE,
        help="attack settings per model family (attacker/profiles.py)",
    )
    exp.add_argument("--device", default="auto", choices=DEVICES, help="auto: a GPU when there is one (default)")
    exp.add_argument(
        "--cells",
        nargs="+",
        default=[],
        metavar="FILTER",
        help="run only cells whose '<experiment>-<cell>' or '<cell>' id matches: a glob, an exact id, "
        "or else a substring",
    )
    exp.add_argument("--include-optional", action="store_true", help="also run optional cells (ViT-B/16, MLP in fig5c)")
    exp.add_argument(
        "--victim-source",
        choices=["paper", "builtin", "federated"],
        default="paper",
        help="paper: the paper's victims in <data-root>/dia-victims (fetched on first use); builtin: "
        "victims from a client's partition; "
        "federated: the curious server's captures of a one-round Flower simulation",
    )
    exp.add_argument("--data-root", default="data", help="dataset folder for builtin victims and federated training")
    exp.add_argument(
        "--no-accuracy", action="store_true", help="skip the federated training of Table 1's accuracy column"
    )
    exp.add_argument(
        "--fl-rounds", type=int, default=3, help="federated rounds for the accuracy column (paper: to convergence)"
    )
    exp.add_argument("--fl-local-steps", type=int, default=0, help="> 0: local batches per round instead of one epoch")
    exp.add_argument("--fl-clients", type=int, help="clients of the federation (default: the config's, paper 10)")
    exp.add_argument("--no-lpips", action="store_true", help="skip LPIPS")
    exp.add_argument(
        "--seed", type=int, default=0, help="seed of each cell's attack and of the accuracy column's federation"
    )
    exp.add_argument("--report-only", action="store_true", help="rewrite results.md/csv and figures from what has run")
    exp.add_argument("--quiet", action="store_true", help="no per-cell progress bars")
    exp.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the cells as Ray tasks: on a local Ray started for the run (no ADDRESS), or on an "
        "existing cluster (ray://HOST:10001, HOST:6379 or auto); paths must be the same on every node",
    )
    exp.add_argument("--ray-cpus-per-task", type=float, help="CPUs each cell's task asks for (default 1)")
    exp.add_argument(
        "--ray-gpus-per-task",
        type=float,
        help="GPUs each cell's task asks for; fractions share a GPU, e.g. 0.25 for the MLP (default 0)",
    )
    exp.add_argument(
        "--ray-max-retries",
        type=int,
        help="reruns of a cell whose worker dies, resuming from its checkpoints (default 2)",
    )
    exp.add_argument("--ray-local-cpus", type=int, help="CPUs of the local Ray (default: all of this machine's)")
    exp.add_argument("--ray-timeout", type=float, help="seconds to wait for an existing cluster to answer (default 20)")
    return parser


def _experiment(args: argparse.Namespace) -> int:
    from .experiments import (
        ClusterLostError,
        RayOptions,
        Settings,
        load_experiment,
        run_experiments,
        select_cells,
        write_report,
    )

    if args.victims is not None and args.victims <= 0:
        raise ConfigError(f"--victims must be positive, got {args.victims}")
    if args.iterations is not None and args.iterations <= 0:
        raise ConfigError(f"--iterations must be positive, got {args.iterations}")
    if args.fl_rounds <= 0:
        raise ConfigError(f"--fl-rounds must be positive, got {args.fl_rounds}")
    experiments = [load_experiment(path) for path in args.configs]
    names = [e.name for e in experiments]
    if len(set(names)) != len(names):
        raise ConfigError(f"experiment names repeat: {names}")
    settings = Settings(
        victims=args.victims,
        iterations=args.iterations,
        device=args.device,
        victim_source=args.victim_source,
        data_root=args.data_root,
        lpips=not args.no_lpips,
        cells=list(args.cells),
        include_optional=args.include_optional,
        accuracy=not args.no_accuracy,
        fl_rounds=args.fl_rounds,
        fl_local_steps=args.fl_local_steps,
        fl_clients=args.fl_clients,
        progress=not args.quiet,
        seed=args.seed,
        profile=args.profile,
    )
    ray_fields = {
        "ray_cpus_per_task": "cpus_per_task",
        "ray_gpus_per_task": "gpus_per_task",
        "ray_max_retries": "max_retries",
        "ray_local_cpus": "local_cpus",
        "ray_timeout": "connect_timeout_s",
    }
    ray_given = {flag: getattr(args, flag) for flag in ray_fields if getattr(args, flag) is not None}
    if args.ray is None and ray_given:
        raise ConfigError(f"--{next(iter(ray_given)).replace('_', '-')} needs --ray")
    ray = None
    if args.ray is not None:  # --ray alone: a local Ray for this run; --ray ADDRESS: an existing cluster
        ray = RayOptions(address=args.ray or None, **{ray_fields[flag]: value for flag, value in ray_given.items()})
        ray.check()
    out = Path(args.out or f"runs/experiments/{'+'.join(names)}")
    if args.report_only:
        path = write_report(experiments, select_cells(experiments, settings), out, settings)
        console.print(f"wrote [bold]{path}[/bold]")
        return 0
    try:
        result = run_experiments(experiments, out, settings, log=lambda m: console.print(m, highlight=False), ray=ray)
    except ClusterLostError as err:  # not the user's input: exit 1, like failed cells; what finished is kept
        console.print(
            f"[bold red]error:[/bold red] {err}; the finished cells are kept in {out}, run the same command "
            f"again to go on",
            highlight=False,
            soft_wrap=True,
        )
        return 1
    console.print(
        f"{result['cells']} cells: {result['ran']} run, {result['skipped']} already finished (skipped), "
        f"{result['failed']} failed; {result['seconds']:.0f} s. Report: [bold]{result['report']}[/bold]"
    )
    return 1 if result["failed"] else 0


def _apply_args(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    if not isinstance(data.get("victims") or {}, dict):
        return data  # parse_config names the problem
    victims = dict(data.get("victims") or {})
    for arg, key in (
        ("model", "model"),
        ("dataset", "dataset"),
        ("p", "p"),
        ("victim_batch_size", "victim_batch_size"),
        ("victims", "count"),
        ("data_root", "data_root"),
    ):
        value = getattr(args, arg)
        if value is not None:
            victims[key] = value
    if getattr(args, "model_options", None) is not None:
        try:
            victims["model_options"] = model_options({"model-options": args.model_options})
        except RunConfigError as err:
            raise ConfigError(str(err)) from None
    paper = getattr(args, "paper_victims", False)
    if args.victim_file and paper:
        raise ConfigError("--victim-file and --paper-victims exclude each other: give one")
    if args.victim_file:
        victims["source"], victims["file"] = "file", args.victim_file
    if paper:
        victims["source"] = "paper"
        victims.pop("file", None)
    if args.captures:
        victims["source"], victims["captures"] = "captures", args.captures
    if victims.get("source") == "captures":
        # the captures name their own model and options; --model only allows importing it (as audit's)
        for key in ("model", "model_options"):
            victims.pop(key, None)
    data = dict(data, victims=victims)
    if args.attacks:
        data["attacks"] = args.attacks
    if args.iterations is not None:
        data["attack_overrides"] = dict(data.get("attack_overrides") or {}, max_iterations=args.iterations)
    if getattr(args, "replay_order", None) is not None:
        data["attack_overrides"] = dict(data.get("attack_overrides") or {}, replay_order=args.replay_order)
    for arg in ("labels", "device", "seed", "profile"):
        if getattr(args, arg) is not None:
            data[arg] = getattr(args, arg)
    if args.no_lpips:
        data["lpips"] = False
    return data


def _print_summary(result: dict[str, Any]) -> None:
    table = Table(
        title=f"Results ({result['seconds']:.0f} s) — SSIM in paper space (normalized), [0,1] space and per-image "
        "min-max scaled"
    )
    for col in (
        "attack",
        "model",
        "p",
        "B",
        "victims",
        "SSIM paper",
        "SSIM [0,1]",
        "SSIM min-max",
        "PSNR paper",
        "LPIPS",
        "MMD",
        "TRD",
        "values",
    ):
        table.add_column(col, justify="right" if col not in ("attack", "model") else "left")

    def cell(e: dict, key: str, digits: int = 3) -> str:
        return f"{e[key + '_mean']:.{digits}f} ± {e[key + '_std']:.{digits}f}" if key + "_mean" in e else "–"

    for e in result["summary"]:
        table.add_row(
            e["attack"],
            f"{e['model']}/{e['dataset']}",
            str(e["p"]),
            str(e["batch_size"]),
            str(e["victims"]),
            cell(e, "ssim_paper"),
            cell(e, "ssim_std"),
            cell(e, "ssim_minmax"),
            cell(e, "psnr_paper", 2),
            cell(e, "lpips"),
            cell(e, "mmd"),
            cell(e, "trd"),
            f"{e['optimized_values']:,}",
        )
    console.print(table)
    run_dir = Path(result["run_dir"])
    console.print(
        f"run folder: [bold]{run_dir}[/bold]  (report.md, grid.png, loss_curves.png, metrics.csv, summary.csv)"
    )


def _quiet_libraries() -> None:
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def configure_logging() -> None:
    """Library warnings as plain lines on stderr, each once.

    Flower's ``flwr`` logger prints through a console handler of its own; propagating to the root
    handler as well would print every Flower line twice (its DEBUG lines once more), so it stops at
    its own handler."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("flwr").propagate = False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trust_factory(getattr(args, "model", None))  # typed by the user: theirs to import (fedsim.models.own)
    if args.command == "presets":
        table = Table(title="attack presets")
        for col in ("name", "masks", "distance", "lambda_pos", "lambda_mask", "lr", "max_iterations"):
            table.add_column(col)
        for name, a in PRESETS.items():
            table.add_row(
                name, a.masks, a.distance, str(a.lambda_pos), str(a.lambda_mask), str(a.lr), str(a.max_iterations)
            )
        console.print(table)
        forms = Table(title=f"closed-form attacks (one shot, no optimization; {CLOSED_FORM_GROUP}: all that apply)")
        for col in ("name", "needs", "gives"):
            forms.add_column(col)
        for name, solver in SOLVERS.items():
            forms.add_row(name, solver.needs, solver.mechanism)
        console.print(forms)
        return 0
    _quiet_libraries()
    configure_logging()
    try:
        if args.command == "experiment":
            return _experiment(args)
        if args.command == "audit":
            from .audit import audit_command

            return audit_command(args, console)
        if args.command == "demo" and not args.offline_victims:
            out = Path(args.out or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}")
            overrides = {"max_iterations": args.iterations} if args.iterations else {}
            result = run_story(
                out,
                attack_overrides=overrides,
                lpips=not args.no_lpips,
                data_root=args.data_root or "data",
                # a bar only on a terminal: piped to a file its last frame is left as clutter
                device=args.device or "auto",
                progress=not args.quiet and console.is_terminal,
                log=lambda m: console.print(m),
                num_clients=args.victims,
                capture_kind=args.capture_kind,
                profile=args.profile or DEFAULT_PROFILE,
            )
            _print_summary(result)
            console.print(f"main job report: [bold]{out / 'report.md'}[/bold]")
            return 0
        if args.command == "demo":
            data: dict[str, Any] = copy.deepcopy(OFFLINE_DEMO)
        elif getattr(args, "config", None):  # only `run` takes a config file; `watch` has none
            data = read_config_data(args.config)
            victims = data.get("victims")
            if isinstance(victims, dict) and isinstance(victims.get("model"), str):
                trust_factory(victims["model"])  # the user's own config file, given on the command line
        else:
            data = {}
        cfg: RunConfig = parse_config(_apply_args(data, args))
        out = Path(args.out or f"runs/{args.command}-{datetime.now():%Y%m%d-%H%M%S}")
        if args.command == "watch":
            if not Path(args.run_dir).is_dir():
                raise ConfigError(f"{args.run_dir} is not a folder (expected a federated run folder)")
            summaries = watch(
                args.run_dir, out, cfg, poll_s=args.poll, timeout_s=args.timeout, log=lambda m: console.print(m)
            )
            for result in summaries:
                _print_summary(result)
            return 0
        result = run_attack(cfg, out, progress=not args.quiet, log=lambda m: console.print(m))
    except USER_ERRORS as err:
        console.print(f"[bold red]error:[/bold red] {err}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: run the same command again to resume from the last checkpoint[/yellow]")
        return 130
    _print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
