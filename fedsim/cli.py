"""``fedsim`` command line: simulate a federation, sweep accuracy against p, list captures, and run the
same app in Flower's deployment engine on loopback (``deploy-local``)."""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# A wide console when piped (CI logs, files) so tables are not squeezed to 80 columns.
console = Console() if sys.stdout.isatty() else Console(width=160)

# Extra option strings for a few run config keys (the flag is always "--" + the key).
ALIASES: dict[str, tuple[str, ...]] = {"num-server-rounds": ("--rounds",), "num-clients": ("--clients",)}

# Where a subcommand differs from the run config's defaults (fedsim.run_config.SCHEMA), all in one place.
# "run-dir" is the folder under which a run without --run-dir gets a new, timestamped folder.
SUBCOMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "simulate": {},
    "sweep": {},
    "deploy-local": {"num-clients": 2, "num-server-rounds": 2, "run-dir": "runs/deploy"},
}
METAVARS = {int: "INT", float: "FLOAT", str: "TEXT"}
SWEEP_P = ("0", "0.25", "0.5", "0.75")  # the dropout rates of a sweep without --p
SWEEP_OUT = "runs/sweep"


class UsageError(ValueError):
    """A command line that cannot run as given (a folder in the way, a missing file, a bad --set)."""


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors that mean "the user asked for something impossible": one line, exit 2.

    Called only when an exception is on its way out, so ``--help`` never imports torch."""
    from fedsim.capture import CaptureError
    from fedsim.data import DataUnavailableError
    from fedsim.models import ModelSpecError
    from fedsim.run_config import RunConfigError

    return (UsageError, RunConfigError, CaptureError, DataUnavailableError, ModelSpecError)


def _dest(key: str) -> str:
    return key.replace("-", "_")


def _shown(value: Any) -> str:
    return repr(value) if value == "" else str(value).lower() if isinstance(value, bool) else str(value)


def add_run_config_args(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None, exclude: tuple[str, ...] = ()
) -> None:
    """One flag per run config setting (``--`` + its key), help and defaults from the schema.

    Every flag defaults to None ("not given"), so :func:`run_config_from_args` can tell what the
    user set; ``defaults`` are this subcommand's departures from the schema's defaults."""
    from fedsim.run_config import SCHEMA

    defaults = dict(defaults or {})
    groups: dict[str, argparse._ArgumentGroup] = {}
    keys = [setting.key for setting in SCHEMA if setting.key not in exclude]
    for setting in SCHEMA:
        if setting.key not in keys:
            continue
        if setting.group not in groups:
            groups[setting.group] = parser.add_argument_group(f"run config: {setting.group}")
        default = defaults.get(setting.key, setting.default)
        flags = ["--" + setting.key, *ALIASES.get(setting.key, ())]
        if setting.key == "run-dir":
            text = f"{setting.help} (default: a new folder under {default})"
        else:
            allowed = setting.describe()
            text = f"{setting.help} ({allowed + '; ' if allowed else ''}default: {_shown(default)})"
        text = text.replace("%", "%%")
        if setting.type is bool:
            groups[setting.group].add_argument(
                *flags, dest=_dest(setting.key), default=None, action=argparse.BooleanOptionalAction, help=text
            )
        else:
            metavar = "{" + ",".join(setting.choices) + "}" if setting.choices else METAVARS[setting.type]
            groups[setting.group].add_argument(
                *flags, dest=_dest(setting.key), default=None, metavar=metavar, help=text
            )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any run config key (fedsim.run_config.SCHEMA), applied after the flags; repeatable",
    )
    parser.set_defaults(run_config_defaults=defaults, run_config_keys=keys)


def run_config_from_args(args: argparse.Namespace, **fixed: Any) -> dict[str, Any]:
    """The resolved run config: schema defaults < subcommand defaults < flags < --set < ``fixed``.

    Raises RunConfigError (unknown key, bad value) or UsageError (a --set without '=')."""
    from fedsim.run_config import resolve_config

    flags = {key: getattr(args, _dest(key)) for key in args.run_config_keys if getattr(args, _dest(key)) is not None}
    defaults = {k: v for k, v in args.run_config_defaults.items() if k != "run-dir"}
    return resolve_config(defaults, flags, _set_pairs(args), fixed)


def _set_pairs(args: argparse.Namespace) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def _new_run_dir(args: argparse.Namespace, cfg: dict[str, Any]) -> str:
    """--run-dir when given, else a new timestamped folder under the subcommand's runs folder."""
    from fedsim.run_config import DEFAULTS, to_run_config

    if args.run_dir is not None or "run-dir" in to_run_config(_set_pairs(args)):
        return cfg["run-dir"]
    base = args.run_config_defaults.get("run-dir", DEFAULTS["run-dir"])
    return f"{base}/{time.strftime('%Y%m%d-%H%M%S')}-{_slug(cfg['model'])}-{cfg['dataset']}-p{cfg['p']}"


def _slug(model: str) -> str:
    """A model name fit for a folder name: your own model's ``module.path:factory`` without the colon."""
    return model.replace(":", "-").replace("/", "-")


def _check_new_folder(path: str | Path, what: str) -> Path:
    """``path`` resolved; UsageError unless it is new or an empty folder (never write into a used one)."""
    path = Path(path).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {path} is a file, not a folder")
    if path.is_dir() and any(path.iterdir()):
        raise UsageError(f"{what} {path} is not empty; choose a new folder (runs never mix or overwrite)")
    return path


def _check_coupled_batches(cfg: dict[str, Any], model: Any) -> None:
    """Train-mode BatchNorm (``batchnorm_mode: "train"``, or a built-in model's batch norm) normalizes
    by the batch: run the model in train mode on a batch of each size the clients run (the victim batch
    of a one-step capture round, the local batch), so that a size it rejects (B = 1 where a feature map
    reaches 1x1: a single value per channel) is one line now, not a failure mid-simulation."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    from fedsim.capture_kinds import CAPTURE_KINDS
    from fedsim.models import DropoutMode, dropout_mode
    from fedsim.run_config import capture_rounds

    model.train()
    if not any(isinstance(m, _BatchNorm) and m.training for m in model.modules()):
        return
    sizes = {"batch-size": int(cfg["batch-size"])}
    if capture_rounds(cfg) and CAPTURE_KINDS[cfg["capture-kind"]].one_step_gradient:  # one step on the victims
        sizes["victim-batch-size"] = int(cfg["victim-batch-size"])
    for key, size in sorted(sizes.items(), key=lambda kv: kv[1]):
        try:
            with torch.no_grad(), dropout_mode(model, DropoutMode.OFF):
                model(torch.zeros(size, *model.spec.input_shape))
        except Exception as err:  # the model's own forward: its error, in one line
            text = str(err).strip().splitlines()
            raise UsageError(
                f"model {cfg['model']} runs BatchNorm in train mode (batch statistics) and fails on a batch of "
                f"{key} = {size} ({type(err).__name__}: {text[0] if text else ''}): use {key} >= 2"
            ) from None


def _check_model_and_data(cfg: dict[str, Any]) -> None:
    """Build the model and load the test split now, before any Ray or Flower process starts, so a
    bad model or a missing or corrupt data root is one line (the simulation reuses the split)."""
    from fedsim import task

    cfg["data-root"] = str(Path(cfg["data-root"]).expanduser().resolve())  # as the simulation resolves it
    _check_coupled_batches(cfg, task.make_model(cfg))
    for change in task.check_defense(cfg):  # dp-fix-model: what Opacus' ModuleValidator.fix changed
        console.print(f"dp-fix-model: {change}")
    task.load_split(cfg, train=False)
    task.check_data(cfg)  # the data source and its partitions (a partitioner that cannot split it)


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"  # results.json holds null where there is no number


def _rounds_table(results: dict[str, Any], title: str) -> Table:
    table = Table(title=title)
    for col in ("round", "test acc", "test loss", "train loss", "clients", "captured", "elapsed s"):
        table.add_column(col, justify="right")
    for row in results["rounds"]:
        table.add_row(
            str(row["round"]),
            f"{100 * row['accuracy']:.2f}%",
            _number(row["loss"]),
            _number(row["train_loss"]),
            str(row["num_replies"]),
            "yes" if row["captured"] else "",
            f"{row['elapsed_s']:.1f}",
        )
    return table


def _capture_config(args: argparse.Namespace) -> dict[str, Any]:
    """The checked run config of a capturing federation (simulate, deploy-local); its run folder is
    new or empty, and model and data load. Raises a user error before anything is written."""
    cfg = run_config_from_args(args)
    cfg["run-dir"] = str(_check_new_folder(_new_run_dir(args, cfg), "run folder"))
    _check_model_and_data(cfg)
    return cfg


def cmd_simulate(args: argparse.Namespace) -> int:
    cfg = _capture_config(args)
    from fedsim.simulation import load_results, run_simulation_job

    what = f"{cfg['model']}/{cfg['dataset']} p={cfg['p']}"
    console.print(
        f"[bold]fedsim simulate[/bold]: {what}, {cfg['num-clients']} clients, "
        f"{cfg['num-server-rounds']} rounds -> {cfg['run-dir']}"
    )
    t0 = time.time()
    run_dir = run_simulation_job(cfg)
    results = load_results(run_dir)
    console.print(_rounds_table(results, what))
    console.print(
        f"final accuracy {100 * results['final_accuracy']:.2f}%, best {100 * results['best_accuracy']:.2f}% "
        f"(round {results['best_round']}), {results['num_captures']} captures, "
        f"{time.time() - t0:.1f} s; results in [bold]{run_dir}[/bold]"
    )
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    # Every cell's config and the output folder are checked before the first cell runs.
    cells = [run_config_from_args(args, p=p) for p in args.p]
    ps = [cell["p"] for cell in cells]
    if len(set(ps)) != len(ps):
        raise UsageError(f"--p repeats a value: {' '.join(f'{p:g}' for p in ps)}")
    base = cells[0]
    out = _check_new_folder(
        args.out or f"{SWEEP_OUT}/{time.strftime('%Y%m%d-%H%M%S')}-{_slug(base['model'])}-{base['dataset']}",
        "--out folder",
    )
    _check_model_and_data(base)
    for cell in cells:
        cell.update({"run-dir": str(out / f"p{cell['p']}"), "data-root": base["data-root"]})
    from fedsim.simulation import load_results, run_simulation_job

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cfg in cells:
        console.print(f"[bold]sweep[/bold] {cfg['model']}/{cfg['dataset']} p={cfg['p']} ...")
        t0 = time.time()
        results = load_results(run_simulation_job(cfg))
        rows.append(
            {
                "model": cfg["model"],
                "dataset": cfg["dataset"],
                "p": cfg["p"],
                "rounds": results["rounds_run"],
                "final_accuracy": results["final_accuracy"],
                "best_accuracy": results["best_accuracy"],
                "best_round": results["best_round"],
                "wall_s": round(time.time() - t0, 1),
            }
        )
    csv_path = out / "accuracy_vs_p.csv"
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    png_path = out / "accuracy_vs_p.png"
    _plot_sweep(
        rows,
        png_path,
        f"{base['model']} / {base['dataset']}, {base['num-clients']} clients, {base['num-server-rounds']} rounds",
    )
    table = Table(title=f"test accuracy against dropout rate ({base['model']}/{base['dataset']})")
    for col in ("p", "final acc", "best acc", "best round", "wall s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['p']:g}",
            f"{100 * r['final_accuracy']:.2f}%",
            f"{100 * r['best_accuracy']:.2f}%",
            str(r["best_round"]),
            f"{r['wall_s']:.1f}",
        )
    console.print(table)
    console.print(f"wrote {csv_path} and {png_path}")
    return 0


def _plot_sweep(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no backend to choose, no display needed

    fig = Figure(figsize=(5, 3.5))
    ax = fig.subplots()
    ps = [r["p"] for r in rows]
    ax.plot(ps, [100 * r["final_accuracy"] for r in rows], "o-", label="final")
    ax.plot(ps, [100 * r["best_accuracy"] for r in rows], "s--", label="best", alpha=0.7)
    ax.set_xlabel("dropout rate p")
    ax.set_ylabel("global test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_captures(args: argparse.Namespace) -> int:
    from fedsim.capture import CaptureError, list_captures, load_capture

    folder = Path(args.run_dir)
    if not folder.exists():
        raise UsageError(f"{folder} does not exist (expected a run folder or its captures/)")
    if not folder.is_dir():
        raise UsageError(f"{folder} is a file, not a run folder")
    paths = list_captures(folder)
    if not paths:
        raise UsageError(f"{folder} holds no captures (expected a run folder or its captures/)")
    table = Table(title=f"captures in {folder}")
    for col in ("round", "client", "kind", "model", "p", "images", "B", "K", "lr", "labels", "defense", "path"):
        table.add_column(col)
    bad = 0
    for path in paths:
        try:
            c = load_capture(path, check_model=False)
        except CaptureError as exc:  # one bad record among good ones: listed, and the exit code says so
            bad += 1
            console.print(f"[red]{exc}[/red]")
            continue
        labels = c.label_policy if c.labels is None else ",".join(str(int(v)) for v in c.labels[:8])
        table.add_row(
            str(c.round),
            str(c.client) if c.aggregate is None else "mean of " + ",".join(map(str, c.aggregate.clients)),
            c.kind,
            c.spec.name,
            f"{c.p:g}",
            str(c.label_count),
            str(c.batch_size),
            str(c.local_steps),
            f"{c.lr:g}",
            labels,
            c.defense,
            path.name,
        )
    console.print(table)
    return 1 if bad else 0


def cmd_deploy_local(args: argparse.Namespace) -> int:
    from fedsim.deployment import DeploymentError, TLSFiles, deploy_local

    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    if args.node_auth and not args.tls_dir:
        raise UsageError("--node-auth needs --tls-dir (Flower allows SuperNode authentication only over TLS)")
    tls = None
    if args.tls_dir:
        try:
            tls = TLSFiles.from_dir(args.tls_dir)
        except DeploymentError as exc:
            raise UsageError(str(exc)) from None
    cfg = _capture_config(args)
    node_keys = None
    if args.node_auth:
        node_keys = [Path(args.tls_dir) / f"supernode-{i + 1}" for i in range(cfg["num-clients"])]
        missing = [str(k) for k in node_keys if not k.is_file() or not k.with_name(k.name + ".pub").is_file()]
        if missing:
            raise UsageError(
                f"missing SuperNode keys {missing}; run deploy/make-certs.sh {args.tls_dir} {cfg['num-clients']}"
            )
    from fedsim.simulation import load_results

    if cfg["audit"]:
        console.print(
            "[yellow]warning:[/yellow] --audit makes the clients send their ground truth (the oracle) to the "
            "server; in a deployment the server is the attacker. Use it only for measurements."
        )
    transport = "TLS" if tls else "insecure"
    what = f"{cfg['model']}/{cfg['dataset']} p={cfg['p']}"
    console.print(
        f"[bold]fedsim deploy-local[/bold]: {what}, SuperLink + {cfg['num-clients']} "
        f"SuperNodes on loopback ({transport}{', SuperNode auth' if node_keys else ''}), "
        f"{cfg['num-server-rounds']} rounds -> {cfg['run-dir']}"
    )
    t0 = time.time()
    try:
        result = deploy_local(
            cfg, tls=tls, node_keys=node_keys, timeout=args.timeout, echo=None if args.quiet else sys.stdout
        )
    except (DeploymentError, FileExistsError) as exc:
        console.print(f"[red]deployment failed:[/red] {exc}")
        return 1
    results = load_results(result.run_dir)
    console.print(_rounds_table(results, f"deployment run {result.run_id}: {what}"))
    console.print(
        f"run {result.run_id} {result.status}; final accuracy {100 * results['final_accuracy']:.2f}%, "
        f"{results['num_captures']} captures, {time.time() - t0:.1f} s; every process stopped. "
        f"Results in [bold]{result.run_dir}[/bold], logs in {result.work_dir / 'logs'}"
    )
    return 0


def cmd_victims(args: argparse.Namespace) -> int:
    """Fetch (or verify) the paper's victim sets: one line per set, exit 2 when any failed."""
    from fedsim.data import PAPER_VICTIMS, VictimFileError, paper_victims

    failed = 0
    for dataset in args.datasets or sorted(PAPER_VICTIMS):
        try:
            path = paper_victims(
                dataset,
                args.data_root,
                allow_download=True,  # the user asked for the fetch; offline it fails in one line per set
                base_url=args.url,
                timeout_s=args.timeout,
                log=lambda line: console.print(line, highlight=False, soft_wrap=True),
            )
        except VictimFileError as err:
            console.print(f"[bold red]error:[/bold red] {err}", highlight=False, soft_wrap=True)
            failed += 1
            continue
        console.print(f"{dataset}: {path} (sha256 verified)", highlight=False, soft_wrap=True)
    return 2 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run one federation in Flower's simulation engine (Ray)")
    add_run_config_args(sim, SUBCOMMAND_DEFAULTS["simulate"])
    sim.set_defaults(func=cmd_simulate)

    sweep = sub.add_parser("sweep", help="Table 1's accuracy column: test accuracy against p")
    add_run_config_args(sweep, SUBCOMMAND_DEFAULTS["sweep"], exclude=("p", "run-dir"))
    sweep.add_argument(
        "--p",
        nargs="+",
        default=list(SWEEP_P),
        metavar="P",
        help=f"dropout rates, one federation each (default: {' '.join(SWEEP_P)})",
    )
    sweep.add_argument(
        "--out",
        default=None,
        help=f"new output folder, one run folder per p inside (default: a new folder under {SWEEP_OUT})",
    )
    sweep.set_defaults(func=cmd_sweep)

    dep = sub.add_parser(
        "deploy-local",
        help="the same app in Flower's deployment engine: SuperLink + SuperNodes "
        "as processes on loopback, flwr run, then stop them all",
    )
    add_run_config_args(dep, SUBCOMMAND_DEFAULTS["deploy-local"])
    dep.add_argument(
        "--tls-dir",
        default=None,
        help="TLS between CLI/SuperNodes and SuperLink with ca.crt, server.pem, server.key from "
        "deploy/make-certs.sh DIR",
    )
    dep.add_argument(
        "--node-auth",
        action="store_true",
        help="SuperNode authentication with DIR/supernode-<i> keys (needs --tls-dir)",
    )
    dep.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is abandoned")
    dep.add_argument("--quiet", action="store_true", help="do not echo the run's log stream")
    dep.set_defaults(func=cmd_deploy_local)

    caps = sub.add_parser("captures", help="list the captures of a run folder")
    caps.add_argument("run_dir", help="a federated run folder (its captures/ is read)")
    caps.set_defaults(func=cmd_captures)

    vic = sub.add_parser("victims", help="fetch the paper's victim images (pinned SHA-256) into the data folder")
    vic.add_argument(
        "--data-root", default="data", help="data folder; the files go to DATA_ROOT/dia-victims (default: data)"
    )
    vic.add_argument("--datasets", nargs="+", metavar="NAME", help="mnist, cifar10 (default: both)")
    vic.add_argument(
        "--url",
        help="base URL of a mirror holding the same file names (default: $DLA_VICTIMS_URL, "
        "else the authors' repository)",
    )
    vic.add_argument("--timeout", type=float, default=20.0, help="seconds per file (default 20)")
    vic.set_defaults(func=cmd_victims)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user error (bad value, folder in the way, missing or corrupt data or
    captures) is one red line ``error: ...`` and exit 2, with nothing written; argparse's own usage
    errors exit 2 as well."""
    args = build_parser().parse_args(argv)
    from fedsim.models.own import trust_factory

    # the model the user names here is theirs to import (fedsim.models.own: names from elsewhere are not)
    trust_factory(getattr(args, "model", None))
    for item in getattr(args, "set", None) or []:
        key, _, value = item.partition("=")
        if key.strip() == "model":
            trust_factory(value.strip())
    try:
        return int(args.func(args) or 0)
    except _user_errors() as err:
        console.print(f"[bold red]error:[/bold red] {err}", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
