"""Benchmark: DIA victim-iterations per second and peak memory for V batched jobs (B = 1), the
achieved GFLOP/s against this machine's fp32 GEMM peak (measured in the same run), and the
Lightning Trainer's overhead against a plain loop over the same module.

    .venv/bin/python benchmarks/attack_throughput.py                 # all models, V = 1 8 32 128
    .venv/bin/python benchmarks/attack_throughput.py --models mlp --jobs 1 128 --iterations 30

Prints figures; asserts nothing. FLOPs per iteration are counted by torch's FlopCounterMode on
one iteration of each setting.
"""

from __future__ import annotations

import argparse
import logging
import resource
import time
import warnings

import torch

from attacker.attacks import make_attack
from attacker.inversion import InversionModule
from attacker.jobs import jobs_from_images
from fedsim.models import ModelSpec

SETTINGS = {"mlp": ("mlp", "mnist"), "lenet": ("lenet", "mnist"), "vit": ("vit", "cifar10"), "resnet18": ("resnet18", "cifar10")}


def gemm_peak(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def make_module(model: str, dataset: str, jobs: int) -> InversionModule:
    spec = ModelSpec(model, dataset, 0.25)
    shape = spec.input_shape
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(1, *shape, generator=g).clamp(-0.4, 2.0), torch.tensor([i % 10])) for i in range(jobs)]
    vjobs, _ = jobs_from_images(spec, batches)
    return InversionModule(vjobs, [make_attack("dia")] * jobs, None)


def plain_step(module: InversionModule) -> None:
    """The same per-iteration work as InversionModule.training_step, without Lightning."""
    active = module.active()
    for j in active:
        module.job_optimizers[j].zero_grad(set_to_none=True)
    losses, _ = module.job_losses(active)
    losses.sum().backward()
    for j in active:
        module.images[j].grad.sign_()
        module.job_optimizers[j].step()


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(SETTINGS))
    parser.add_argument("--jobs", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations per setting (after 2 warm-up)")
    parser.add_argument("--lightning", action="store_true", help="also time the Lightning Trainer against the plain loop")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(torch.get_num_threads())
    peak = gemm_peak()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fp32 GEMM peak {peak:.0f} GFLOP/s")
    print(f"{'model':<10}{'V':>5}{'victim-it/s':>13}{'ms/iter':>10}{'GFLOP/iter':>12}{'GFLOP/s':>9}{'% peak':>8}{'peak RSS GB':>13}")
    from torch.utils.flop_counter import FlopCounterMode

    for name in args.models:
        model, dataset = SETTINGS[name]
        for v in args.jobs:
            module = make_module(model, dataset, v)
            for _ in range(2):
                plain_step(module)
            counter = FlopCounterMode(display=False)
            with counter:
                plain_step(module)
            flops = counter.get_total_flops()
            start = time.perf_counter()
            for _ in range(args.iterations):
                plain_step(module)
            dt = (time.perf_counter() - start) / args.iterations
            print(f"{name:<10}{v:>5}{v / dt:>13.0f}{dt * 1e3:>10.1f}{flops / 1e9:>12.3f}{flops / dt / 1e9:>9.1f}"
                  f"{100 * flops / dt / 1e9 / peak:>7.0f}%{peak_rss_gb():>13.2f}", flush=True)
            del module
    if args.lightning:
        import lightning as L

        for name in args.models[:1]:
            model, dataset = SETTINGS[name]
            v, n = args.jobs[-1], args.iterations * 5
            module = make_module(model, dataset, v)
            module.chunk = n
            trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
            start = time.perf_counter()
            trainer.fit(module)
            t_lightning = (time.perf_counter() - start) / n
            module = make_module(model, dataset, v)
            start = time.perf_counter()
            for _ in range(n):
                plain_step(module)
            t_plain = (time.perf_counter() - start) / n
            print(f"Lightning Trainer vs plain loop ({name}, V={v}, {n} iterations): {t_lightning * 1e3:.1f} vs "
                  f"{t_plain * 1e3:.1f} ms/iteration (overhead {1e3 * (t_lightning - t_plain):.1f} ms, includes fit start-up)")


if __name__ == "__main__":
    main()
