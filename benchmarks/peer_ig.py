"""Run the authors' later attack code on the paper's victims and score it as the project scores its own.

The peer comparison of docs/results/table2_resnet18.md: Scheliga et al.'s later repository
(github.com/dAI-SY-Group/ConvolutionalVariationalBottleneck, "CVB") holds an Inverting Gradients attack
and a ResNet-18 with GroupNorm(2), ``ResNet18GN``, the closest public code to the paper's ResNet cell.
This script imports that code from a checkout the user names (it is not vendored: the comparison is
with their code as they wrote it), builds their model under a given seed, runs their IG on the first
``--victims`` paper victims (loaded by the project's safe loader, so both sides see the same tensors),
and scores each best-loss reconstruction with the project's ``image_metrics`` (paper space, [0,1],
min-max SSIM). The project's side of the comparison is ``attacker run`` (the command is in
docs/results/table2_resnet18.md).

Needs the peer's own dependencies beside the project's (munch, dill, prettytable, einops):
``pip install --target DEPS munch dill prettytable einops`` and ``PYTHONPATH=DEPS``.

    PYTHONPATH=DEPS:. python benchmarks/peer_ig.py --peer CVB_CHECKOUT --out runs/peer/paper-s0 \
        --settings paper --model-seed 0 --victims 4 --iterations 2000

One JSON per victim under ``--out`` (a rerun skips those done), and ``summary.json`` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

import torch

from attacker.metrics import image_metrics
from fedsim.data import load_victim_file, paper_victims
from fedsim.data.normalization import CIFAR10_MEAN, CIFAR10_STD, MNIST_MEAN, MNIST_STD

# The peer's two settings for its IG on the ResNet: the paper's (Adam lr 0.1, TV 1e-2, plateau 800,
# as the DIA paper and its repository state) and the later repository's own (configs/attacks/IG.yaml
# with configs/models/ResNet18.yaml: lr 1, TV 0.1, plateau 400). Both keep the peer's signed gradients,
# box clipping, cosine gradient distance and randn init.
SETTINGS = {
    "paper": {"lr": 0.1, "tv": 1e-2, "plateau": 800},
    "later": {"lr": 1.0, "tv": 0.1, "plateau": 400},
}
DATASETS = {"cifar10": ("CIFAR10", CIFAR10_MEAN, CIFAR10_STD), "mnist": ("MNIST", MNIST_MEAN, MNIST_STD)}


def peer_config(peer: Path, dataset: str, settings: str, iterations: int):  # noqa: ANN201 - the peer's Munch
    from src.utils import build_config, update_config

    config = build_config(peer / "configs/main_config.yaml")
    for part in ("fedavg.yaml", "attacks/IG.yaml", f"data/{DATASETS[dataset][0]}.yaml", "models/ResNet18.yaml"):
        config = update_config(config, build_config(peer / "configs" / part))
    s = SETTINGS[settings]
    config.attack.optimizer.lr = s["lr"]
    config.attack.regularization = s["tv"]
    config.attack.scheduler.patience = s["plateau"]
    config.attack.max_iterations = iterations
    config.attack.metrics = []  # scored here, by the project's metrics (the peer's would fetch LPIPS weights)
    config.attack.victim_batchsize = 1
    config.checkpoint_path = None
    config.device = "cpu"
    if dataset == "mnist":
        config.data.shape = [3, 28, 28]  # the paper feeds MNIST to the CNNs as 3 channels, as the project does
    return config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", type=Path, required=True, help="a checkout of ConvolutionalVariationalBottleneck")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--settings", choices=sorted(SETTINGS), default="paper")
    ap.add_argument("--dataset", choices=sorted(DATASETS), default="cifar10")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--victims", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=2000)
    args = ap.parse_args(argv)
    if not (args.peer / "src/attacks.py").is_file():
        print(f"error: {args.peer} is not a ConvolutionalVariationalBottleneck checkout (no src/attacks.py)")
        return 2
    sys.path.insert(0, str(args.peer.resolve()))
    try:
        from src.attacks import get_attack
        from src.models.modelzoo import get_model
        from src.utils import set_seeds
    except ImportError as err:
        hint = "pip install --target DEPS munch dill prettytable einops, then PYTHONPATH=DEPS:."
        print(f"error: the peer's code needs {err.name or err}: {hint}")
        return 2

    _, mean, std = DATASETS[args.dataset]
    inputs, targets = load_victim_file(paper_victims(args.dataset))
    if inputs.shape[1] == 1:
        inputs = inputs.repeat(1, 3, 1, 1)
    config = peer_config(args.peer, args.dataset, args.settings, args.iterations)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(args.victims):
        path = args.out / f"victim-{i}.json"
        if path.is_file():
            rows.append(json.loads(path.read_text()))
            continue
        torch.manual_seed(args.model_seed)  # the model's init: the only seed the comparison varies
        with contextlib.redirect_stdout(io.StringIO()):
            model = get_model(config.model.name, config)
        set_seeds(config.attack.rec_seed)  # the peer's own seed for the dummy's init
        x, y = inputs[i : i + 1], targets[i : i + 1]
        start = time.perf_counter()
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            attack = get_attack("IG", config.data.dataset, model, [x], [y], config)
            recons, _ = attack.attack()
        seconds = time.perf_counter() - start
        rec = recons[0]["Reconstructions"]
        scores = {k: float(v[0]) for k, v in image_metrics(x, rec, mean, std).items() if k.startswith("ssim")}
        row = {"victim": i, "seconds": round(seconds, 1), "iterations": args.iterations, **scores}
        row["peer_log_tail"] = log.getvalue().strip().splitlines()[-2:]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1))
        tmp.replace(path)
        rows.append(row)
        print(
            f"victim {i}: SSIM paper {scores['ssim_paper']:.3f} [0,1] {scores['ssim_std']:.3f} "
            f"min-max {scores['ssim_minmax']:.3f} ({seconds:.0f} s)",
            flush=True,
        )
    summary = {k: sum(r[k] for r in rows) / len(rows) for k in ("ssim_paper", "ssim_std", "ssim_minmax")}
    summary.update(settings=args.settings, model_seed=args.model_seed, victims=len(rows), iterations=args.iterations)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
