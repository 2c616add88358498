"""``fedsim`` command line: simulate a federation, sweep accuracy against p, list captures, and run the
same app in Flower's deployment engine on loopback (``deploy-local``)."""

from __future__ import annotations

from fedsim import flower_env

flower_env.apply()  # before anything imports flwr

import argparse  # noqa: E402
import csv  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console()


def _add_federation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--rounds", type=int, default=3, help="number of server rounds")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--partitioning", choices=["iid", "dirichlet"], default="iid")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--local-steps", type=int, default=0, help="> 0: batches per round instead of epochs")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--early-stop-patience", type=int, default=0, help="rounds without improvement; 0: off")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--no-download", action="store_true", help="never try to download datasets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other run config key (see fedsim.run_config.DEFAULTS); repeatable")


def _base_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": args.model,
        "dataset": args.dataset,
        "num-server-rounds": args.rounds,
        "num-clients": args.clients,
        "partitioning": args.partitioning,
        "local-epochs": args.local_epochs,
        "local-steps": args.local_steps,
        "batch-size": args.batch_size,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "early-stop-patience": args.early_stop_patience,
        "data-root": args.data_root,
        "download": not args.no_download,
        "seed": args.seed,
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        cfg[key.strip()] = value.strip()
    return cfg


def _rounds_table(results: dict[str, Any], title: str) -> Table:
    table = Table(title=title)
    for col in ("round", "test acc", "test loss", "train loss", "clients", "captured", "elapsed s"):
        table.add_column(col, justify="right")
    for row in results["rounds"]:
        table.add_row(str(row["round"]), f"{100 * row['accuracy']:.2f}%", f"{row['loss']:.4f}",
                      f"{row['train_loss']:.4f}", str(row["num_replies"]), "yes" if row["captured"] else "",
                      f"{row['elapsed_s']:.1f}")
    return table


def _capture_config(args: argparse.Namespace, runs: str) -> dict[str, Any] | None:
    """The run config of a capturing federation (simulate, deploy-local); None after a config error."""
    from fedsim.run_config import RunConfigError, resolve_config

    cfg = _base_config(args)
    cfg.update({"p": args.p, "capture-rounds": args.capture_rounds, "capture-kind": args.capture_kind,
                "victim-batch-size": args.victim_batch_size, "audit": args.audit,
                "label-policy": args.label_policy})
    cfg["run-dir"] = args.run_dir or f"{runs}/{time.strftime('%Y%m%d-%H%M%S')}-{args.model}-{args.dataset}-p{args.p}"
    try:
        resolve_config(cfg)
    except RunConfigError as exc:
        console.print(f"[red]config error:[/red] {exc}")
        return None
    return cfg


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedsim.simulation import load_results, run_simulation_job

    cfg = _capture_config(args, "runs/fedsim")
    if cfg is None:
        return 2
    console.print(f"[bold]fedsim simulate[/bold]: {args.model}/{args.dataset} p={args.p}, {args.clients} clients, "
                  f"{args.rounds} rounds -> {cfg['run-dir']}")
    t0 = time.time()
    run_dir = run_simulation_job(cfg)
    results = load_results(run_dir)
    console.print(_rounds_table(results, f"{args.model}/{args.dataset} p={args.p}"))
    console.print(f"final accuracy {100 * results['final_accuracy']:.2f}%, best {100 * results['best_accuracy']:.2f}% "
                  f"(round {results['best_round']}), {results['num_captures']} captures, "
                  f"{time.time() - t0:.1f} s; results in [bold]{run_dir}[/bold]")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from fedsim.simulation import load_results, run_simulation_job

    out = Path(args.out or f"runs/sweep/{time.strftime('%Y%m%d-%H%M%S')}-{args.model}-{args.dataset}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in args.p:
        cfg = _base_config(args)
        cfg.update({"p": p, "run-dir": str(out / f"p{p}")})
        console.print(f"[bold]sweep[/bold] {args.model}/{args.dataset} p={p} ...")
        t0 = time.time()
        results = load_results(run_simulation_job(cfg))
        rows.append({"model": args.model, "dataset": args.dataset, "p": p, "rounds": results["rounds_run"],
                     "final_accuracy": results["final_accuracy"], "best_accuracy": results["best_accuracy"],
                     "best_round": results["best_round"], "wall_s": round(time.time() - t0, 1)})
    csv_path = out / "accuracy_vs_p.csv"
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    png_path = out / "accuracy_vs_p.png"
    _plot_sweep(rows, png_path, f"{args.model} / {args.dataset}, {args.clients} clients, {args.rounds} rounds")
    table = Table(title=f"test accuracy against dropout rate ({args.model}/{args.dataset})")
    for col in ("p", "final acc", "best acc", "best round", "wall s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['p']:g}", f"{100 * r['final_accuracy']:.2f}%", f"{100 * r['best_accuracy']:.2f}%",
                      str(r["best_round"]), f"{r['wall_s']:.1f}")
    console.print(table)
    console.print(f"wrote {csv_path} and {png_path}")
    return 0


def _plot_sweep(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
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
    plt.close(fig)


def cmd_captures(args: argparse.Namespace) -> int:
    from fedsim.capture import CaptureError, list_captures, load_capture

    paths = list_captures(args.run_dir)
    table = Table(title=f"captures in {args.run_dir}")
    for col in ("round", "client", "kind", "model", "p", "B", "lr", "labels", "path"):
        table.add_column(col)
    bad = 0
    for path in paths:
        try:
            c = load_capture(path, check_model=False)
        except CaptureError as exc:
            bad += 1
            console.print(f"[red]{exc}[/red]")
            continue
        labels = "" if c.labels is None else ",".join(str(int(v)) for v in c.labels[:8])
        table.add_row(str(c.round), str(c.client), c.kind, c.spec.name, f"{c.p:g}", str(c.batch_size), f"{c.lr:g}",
                      labels, path.name)
    console.print(table)
    return 1 if bad else 0


def cmd_deploy_local(args: argparse.Namespace) -> int:
    from fedsim.deployment import DeploymentError, deploy_local
    from fedsim.simulation import load_results

    cfg = _capture_config(args, "runs/deploy")
    if cfg is None:
        return 2
    if args.node_auth and not args.tls_dir:
        console.print("[red]--node-auth needs --tls-dir[/red] (Flower allows SuperNode authentication only over TLS)")
        return 2
    node_keys = None
    if args.node_auth:
        node_keys = [Path(args.tls_dir) / f"supernode-{i + 1}" for i in range(args.clients)]
        missing = [str(k) for k in node_keys if not k.is_file() or not k.with_name(k.name + ".pub").is_file()]
        if missing:
            console.print(f"[red]missing SuperNode keys[/red] {missing}; run deploy/make-certs.sh {args.tls_dir} {args.clients}")
            return 2
    if args.audit:
        console.print("[yellow]warning:[/yellow] --audit makes the clients send their ground truth (the oracle) to the "
                      "server; in a deployment the server is the attacker. Use it only for measurements.")
    transport = "TLS" if args.tls_dir else "insecure"
    console.print(f"[bold]fedsim deploy-local[/bold]: {args.model}/{args.dataset} p={args.p}, SuperLink + {args.clients} "
                  f"SuperNodes on loopback ({transport}{', SuperNode auth' if node_keys else ''}), {args.rounds} rounds "
                  f"-> {cfg['run-dir']}")
    t0 = time.time()
    try:
        result = deploy_local(cfg, tls=args.tls_dir, node_keys=node_keys, timeout=args.timeout,
                              echo=None if args.quiet else sys.stdout)
    except (DeploymentError, FileExistsError) as exc:
        console.print(f"[red]deployment failed:[/red] {exc}")
        return 1
    results = load_results(result.run_dir)
    console.print(_rounds_table(results, f"deployment run {result.run_id}: {args.model}/{args.dataset} p={args.p}"))
    console.print(f"run {result.run_id} {result.status}; final accuracy {100 * results['final_accuracy']:.2f}%, "
                  f"{results['num_captures']} captures, {time.time() - t0:.1f} s; every process stopped. "
                  f"Results in [bold]{result.run_dir}[/bold], logs in {result.work_dir / 'logs'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run one federation in Flower's simulation engine (Ray)")
    _add_federation_args(sim)
    sim.add_argument("--p", type=float, default=0.25, help="dropout rate")
    sim.add_argument("--capture-rounds", default="", help="'all' or rounds like '1,3'")
    sim.add_argument("--capture-kind", choices=["gradient", "update"], default="gradient")
    sim.add_argument("--victim-batch-size", type=int, default=1, help="B of the one-step capture rounds")
    sim.add_argument("--label-policy", choices=["known", "unknown"], default="known")
    sim.add_argument("--audit", action="store_true", help="also store the clients' ground truth (oracle)")
    sim.add_argument("--run-dir", default=None)
    sim.set_defaults(func=cmd_simulate)

    sweep = sub.add_parser("sweep", help="Table 1's accuracy column: test accuracy against p")
    _add_federation_args(sweep)
    sweep.add_argument("--p", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
    sweep.add_argument("--out", default=None, help="output folder (one run folder per p inside)")
    sweep.set_defaults(func=cmd_sweep)

    dep = sub.add_parser("deploy-local", help="the same app in Flower's deployment engine: SuperLink + SuperNodes "
                         "as processes on loopback, flwr run, then stop them all")
    _add_federation_args(dep)
    dep.set_defaults(clients=2, rounds=2)
    dep.add_argument("--p", type=float, default=0.25, help="dropout rate")
    dep.add_argument("--capture-rounds", default="", help="'all' or rounds like '1,3'")
    dep.add_argument("--capture-kind", choices=["gradient", "update"], default="gradient")
    dep.add_argument("--victim-batch-size", type=int, default=1, help="B of the one-step capture rounds")
    dep.add_argument("--label-policy", choices=["known", "unknown"], default="known")
    dep.add_argument("--audit", action="store_true",
                     help="clients also send their ground truth (off by default: the server is the attacker)")
    dep.add_argument("--run-dir", default=None)
    dep.add_argument("--tls-dir", default=None,
                     help="TLS between CLI/SuperNodes and SuperLink with ca.crt, server.pem, server.key from "
                          "deploy/make-certs.sh DIR")
    dep.add_argument("--node-auth", action="store_true",
                     help="SuperNode authentication with DIR/supernode-<i> keys (needs --tls-dir)")
    dep.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is abandoned")
    dep.add_argument("--quiet", action="store_true", help="do not echo the run's log stream")
    dep.set_defaults(func=cmd_deploy_local)

    caps = sub.add_parser("captures", help="list the captures of a run folder")
    caps.add_argument("run_dir")
    caps.set_defaults(func=cmd_captures)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
