"""Benchmark: DIA victim-iterations per second of the batched engine as a RATIO to the plain
one-victim-at-a-time loop (benchmarks/plain_baseline.py), both measured in this process on the
same jobs; with GFLOP/s against this machine's fp32 GEMM peak (measured in the same run) and peak
memory, for the dense targets ("before") and the factored low-rank targets ("after").

    make bench                                                       # MLP and ViT, short (B = 1)
    .venv/bin/python benchmarks/attack_throughput.py --models mlp vit lenet resnet18
    .venv/bin/python benchmarks/attack_throughput.py --models mlp --jobs 1 128 512 --iterations 20
    .venv/bin/python benchmarks/attack_throughput.py --threads 1     # a machine others are loading too
    .venv/bin/python benchmarks/attack_throughput.py --device cuda  # on a GPU machine
    .venv/bin/python benchmarks/attack_throughput.py --models vit --bf16  # also the factored path in bf16
    .venv/bin/python benchmarks/attack_throughput.py --models fedavg --threads 2  # the FedAvg rows alone

Absolute figures drift by tens of percent between runs on shared machines; the ratios are what to
quote. The baseline, dense and factored paths are timed in turns, and each figure is the best of a
few short repeats (other load only adds time); the baseline's is the best over the model's block,
which errs on its side. Prints figures; asserts nothing. FLOPs per iteration are counted by torch's
FlopCounterMode on one iteration of each setting. Peak memory: the process's peak RSS during the
setting (Linux; reset before each setting) on the CPU, torch.cuda.max_memory_allocated on a GPU.
The one-off factoring of the targets (once per group of jobs, before the first iteration) is
printed beside each factored row, not counted in its iterations.

The FedAvg rows ("fedavg" in --models): DIA on update captures of MLP/MNIST rounds of K = 4 steps
(N = 4 images, batch 1, in order; SGD lr 0.05 and Adam lr 1e-3), ``--fedavg-jobs`` jobs in one
module. "loop" replays the jobs one after another (``replay_terms``'s loop, the baseline of these
rows); "batch" is what the engine runs: the low-rank batched replay where it applies (SGD on an
all-Linear model, ``attacker.engine.replay_lowrank``), the loop otherwise (Adam). Both are timed in
turns on the same module; a timed repeat of the loop is one iteration (long and steady).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from plain_baseline import plain_attacks, run_plain  # beside this script: its directory is on sys.path
from torch.utils.flop_counter import FlopCounterMode

from attacker.attacks import make_attack
from attacker.engine import layer_terms
from attacker.engine.inversion import InversionModule
from attacker.engine.replay_lowrank import one_job_loop
from attacker.jobs import jobs_from_images
from fedsim.client_step import LocalPlan, OptimizerSpec, Schedule
from fedsim.models import ModelSpec

SETTINGS = {
    "mlp": ("mlp", "mnist"),
    "lenet": ("lenet", "mnist"),
    "vit": ("vit", "cifar10"),
    "resnet18": ("resnet18", "cifar10"),
}
# Default V per model: a few sizes up to where that model's throughput stops growing on 2 cores.
DEFAULT_JOBS = {"mlp": [1, 32, 128, 512], "lenet": [1, 32, 128], "vit": [1, 8, 16], "resnet18": [1, 8, 16]}
# The FedAvg rows: the client's optimizer and learning rate (configs/experiments/fedavg.yaml's).
FEDAVG_OPTIMIZERS = {"sgd": OptimizerSpec("sgd", 0.05), "adam": OptimizerSpec("adam", 1e-3)}


def gemm_peak(device: torch.device, n: int | None = None, reps: int = 5) -> float:
    """fp32 GFLOP/s of an n x n matrix product, the best of ``reps``. A GPU needs a larger product
    than a CPU to approach its peak (2048^3 takes well under a millisecond there)."""
    n = n or gemm_size(device)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


class Peak:
    """The fp32 GEMM peak the % column divides by: the best of every measurement in this run (at its
    start, after each repeat round of the timings, at its end), so that a measurement slowed by other
    load does not flatter the % column; the timings are best-of too."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.first = self.best = gemm_peak(device)

    def measure(self, reps: int = 2) -> float:
        now = gemm_peak(self.device, reps=reps)
        self.best = max(self.best, now)
        return now


def gemm_size(device: torch.device) -> int:
    return 8192 if device.type == "cuda" else 2048


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_module(
    model: str, dataset: str, jobs: int, device: torch.device | str = "cpu", batch_size: int = 1, **attack: float
) -> InversionModule:
    """V DIA jobs on random images; job i is the same job for every V (same image, label, seed).
    attack: overrides of the DIA preset (make_attack)."""
    spec = ModelSpec(model, dataset, 0.25)
    shape = spec.input_shape
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(batch_size, *shape, generator=g).clamp(-0.4, 2.0), torch.tensor([i % 10] * batch_size))
        for i in range(jobs)
    ]
    vjobs, _ = jobs_from_images(spec, batches)
    return InversionModule(vjobs, [make_attack("dia", **attack)] * jobs, None).to(device)


def make_fedavg_module(
    optimizer: OptimizerSpec, jobs: int, steps: int = 4, device: torch.device | str = "cpu"
) -> InversionModule:
    """V DIA jobs on MLP/MNIST update captures: each client runs ``steps`` SGD or Adam steps of
    batch 1 over its ``steps`` random images, in order, and shares Δ."""
    spec = ModelSpec("mlp", "mnist", 0.25)
    plan = LocalPlan(Schedule(epochs=1, batch_size=1, order="in-order"), optimizer)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(steps, *spec.input_shape, generator=g).clamp(-0.4, 2.0), torch.tensor([i % 10] * steps))
        for i in range(jobs)
    ]
    vjobs, _ = jobs_from_images(spec, batches, plan=plan)
    return InversionModule(vjobs, [make_attack("dia")] * jobs, None).to(device)


def bench_fedavg(args: argparse.Namespace, device: torch.device, peak: Peak, memory: PeakMemory) -> list[dict]:
    """The FedAvg rows (see the module docstring): per optimizer, the loop and the dispatch, in turns."""
    sync = lambda: _sync(device)  # noqa: E731
    v, out = args.fedavg_jobs, []
    name = f"fedavg-K{args.fedavg_steps}"
    for opt_name, optimizer in FEDAVG_OPTIMIZERS.items():
        module = make_fedavg_module(optimizer, v, args.fedavg_steps, device)
        step = functools.partial(engine_step, module)
        paths: dict[str, Callable[[], Any]] = {"loop": functools.partial(_looped, step), "batch": step}
        flops, mem, times = {}, {}, {path: [] for path in paths}
        for path, run in paths.items():
            memory.reset()
            run()  # warm-up (and the one-off caching of the targets for the dispatch)
            flops[path], mem[path] = count_flops(run), memory.peak_gb()
        for _ in range(args.repeats):
            for path, run in paths.items():
                n = args.iterations if path == "batch" and opt_name == "sgd" else 1  # a loop: one is long
                sync()
                start = time.perf_counter()
                for _ in range(n):
                    run()
                sync()
                times[path].append((time.perf_counter() - start) / n)
            peak.measure()
        base = v / min(times["loop"])
        for path in paths:
            dt = min(times[path])
            label = f"{opt_name}-{path}"
            ratio = None if path == "loop" else v / dt / base
            note = {"loop": "", "batch": "   (low-rank, all jobs at once)"}[path]
            if path == "batch" and opt_name != "sgd":
                note = "   (not batched: the dispatch takes the loop)"
            print(row(name, v, label, v / dt, ratio, dt, flops[path], peak.best, mem[path]) + note, flush=True)
            out.append({"model": name, "V": v, "path": label, "rate": v / dt})
        del module, step, paths
    return out


def _looped(step: Callable[[], Any]) -> None:
    with one_job_loop():
        step()


def autocast_step(module: InversionModule, device: torch.device):
    """engine_step under bf16 autocast (GEMMs in bfloat16, reductions and norms in float32): the
    lower-precision path worth trying for speed; timed beside the others, not used by the engine."""

    def step() -> list[float]:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return engine_step(module)

    return step


def bf16_loss_error(module: InversionModule, device: torch.device) -> float:
    """Largest relative difference of the jobs' losses, bf16 autocast against float32, same state."""
    active = module.active()
    exact = module.job_losses(active)[0].detach()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        low = module.job_losses(active)[0].detach().float()
    return float(((low - exact).abs() / exact.abs().clamp_min(1e-12)).max())


def previous_step(step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` with every per-job product of the layer terms a bmm (layer_terms.SMALL_PRODUCT = 0),
    as the engine ran before its small-product form: the same values up to float rounding."""

    def run() -> Any:
        saved, layer_terms.SMALL_PRODUCT = layer_terms.SMALL_PRODUCT, 0
        try:
            return step()
        finally:
            layer_terms.SMALL_PRODUCT = saved

    return run


def engine_step(module: InversionModule) -> list[float]:
    """The per-iteration work of InversionModule.training_step without Lightning and without the
    best-iterate and stopping bookkeeping (the plain baseline leaves those out too)."""
    active = module.active()
    module.unknowns.zero_grad_rows()
    losses, _ = module.job_losses(active)
    losses.sum().backward()
    values = losses.detach().cpu().tolist()
    module.step_jobs(active, values)
    return values


class PeakMemory:
    """Peak memory of one setting: peak RSS (reset through /proc/self/clear_refs) or CUDA's peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed memory back so RSS restarts low
        except OSError:
            pass
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (Linux >= 4.0)
        except OSError:
            pass

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
        except OSError:
            pass
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # whole run, not per setting


def count_flops(step) -> float:
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(counter.get_total_flops())


HEADER = (
    f"{'model':<9}{'V':>5}  {'path':<10}{'victim-it/s':>12}{'x baseline':>11}{'ms/iter':>9}"
    f"{'GFLOP/iter':>11}{'GFLOP/s':>9}{'% peak':>8}{'peak GB':>9}"
)


def row(
    name: str, v: int, path: str, rate: float, ratio: float | None, dt: float, flops: float, peak: float, mem: float
) -> str:
    ratio_s = f"{ratio:>10.1f}x" if ratio is not None else f"{'1.0x':>11}"
    return (
        f"{name:<9}{v:>5}  {path:<10}{rate:>12.1f}{ratio_s}{dt * 1e3:>9.1f}{flops / 1e9:>11.3f}"
        f"{flops / dt / 1e9:>9.1f}{100 * flops / dt / 1e9 / peak:>7.0f}%{mem:>9.2f}"
    )


def bench_model(
    name: str, jobs: list[int], args: argparse.Namespace, device: torch.device, peak: Peak, memory: PeakMemory
) -> list[dict]:
    """One model's rows. The baseline, the dense and the factored paths are timed in turns (one
    repeat of each, then the next), so that load from elsewhere falls on all three alike; each
    figure is its best repeat, the baseline's the best over the whole model block."""
    model, dataset = SETTINGS[name]
    sync = lambda: _sync(device)  # noqa: E731
    # The baseline: the first few of the same jobs, each alone, from the engine's initial state.
    nb = args.baseline_victims
    memory.reset()
    attacks = plain_attacks(make_module(model, dataset, nb, device, args.batch_size), nb, device)
    for _ in range(2):
        attacks[0].step()  # warm-up (changes job 0's start a little; only the timing is used here)
    flops_b = count_flops(attacks[0].step)
    mem_b = memory.peak_gb()
    base_times: list[float] = []  # seconds per victim-iteration

    def time_baseline() -> None:
        base_times.append(run_plain(attacks, args.iterations, sync)[0] / (nb * args.iterations))

    time_baseline()
    rows = []
    for v in jobs:
        memory.reset()
        module = make_module(model, dataset, v, device, args.batch_size)
        ghost = module.ghost
        step = functools.partial(engine_step, module)
        ghost.factored = False  # the dense targets: the engine before factoring
        for _ in range(2):
            step()
        flops_d, mem_d = count_flops(step), memory.peak_gb()
        memory.reset()
        ghost.factored = True
        targets = module.matcher.targets(slice(None))
        sync()
        start = time.perf_counter()
        ghost.set_targets(targets)  # all jobs active: what the engine's first step does
        sync()
        factor_s = time.perf_counter() - start
        for _ in range(2):
            step()
        flops_f, mem_f = count_flops(step), memory.peak_gb()
        used = len(ghost.used_factors)
        weights = sum(1 for m, _ in ghost.layers if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
        paths: dict[str, Callable[[], Any]] = {"dense": step, "factored": step}
        if args.previous:
            paths["fact-prev"] = previous_step(step)
        bf16_err = None
        if args.bf16:
            paths["fact+bf16"] = autocast_step(module, device)
            bf16_err = bf16_loss_error(module, device)
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.repeats):
            for path, run in paths.items():  # the flag alone switches paths; the factors stay cached
                ghost.factored = path != "dense"
                run()
                sync()
                start = time.perf_counter()
                for _ in range(args.iterations):
                    run()
                sync()
                times[path].append((time.perf_counter() - start) / args.iterations)
            time_baseline()
            peak.measure()
        bf16 = (min(times["fact+bf16"]), bf16_err) if args.bf16 else None
        previous = min(times["fact-prev"]) if args.previous else None
        rows.append(
            (
                v,
                min(times["dense"]),
                flops_d,
                mem_d,
                min(times["factored"]),
                flops_f,
                mem_f,
                used,
                weights,
                factor_s,
                bf16,
                previous,
            )
        )
        del module, ghost, step
    dt_b = min(base_times)
    base_rate = 1 / dt_b
    print(row(name, 1, "baseline", base_rate, None, dt_b, flops_b, peak.best, mem_b), flush=True)
    out = [{"model": name, "V": 1, "path": "baseline", "rate": base_rate}]
    for v, dt_d, flops_d, mem_d, dt_f, flops_f, mem_f, used, weights, factor_s, bf16, previous in rows:
        print(row(name, v, "dense", v / dt_d, v / dt_d / base_rate, dt_d, flops_d, peak.best, mem_d), flush=True)
        print(
            row(name, v, "factored", v / dt_f, v / dt_f / base_rate, dt_f, flops_f, peak.best, mem_f)
            + f"   ({used}/{weights} weight layers factored; factoring took {factor_s:.2f} s once)",
            flush=True,
        )
        out += [
            {"model": name, "V": v, "path": "dense", "rate": v / dt_d},
            {"model": name, "V": v, "path": "factored", "rate": v / dt_f},
        ]
        if previous is not None:  # same FLOPs up to the tiny products' (counted as a bmm, or not at all)
            print(
                row(name, v, "fact-prev", v / previous, v / previous / base_rate, previous, flops_f, peak.best, mem_f)
                + "   (factored, every per-job product a bmm: the engine before its small-product form)",
                flush=True,
            )
            out.append({"model": name, "V": v, "path": "fact-prev", "rate": v / previous})
        if bf16 is not None:  # same FLOPs as the factored row (the counter counts operations, not precision)
            dt_h, err = bf16
            print(
                row(name, v, "fact+bf16", v / dt_h, v / dt_h / base_rate, dt_h, flops_f, peak.best, mem_f)
                + f"   (bf16 autocast; job losses off the float32 ones by up to {100 * err:.2g} %)",
                flush=True,
            )
            out.append({"model": name, "V": v, "path": "fact+bf16", "rate": v / dt_h})
    return out


def lightning_overhead(args: argparse.Namespace) -> None:
    """Per-iteration time of the Lightning Trainer's loop (``trainer.fit``: the module's own
    ``training_step``, with its best-iterate and stopping bookkeeping and logging) against
    ``engine_step`` called in a plain Python loop, on the same jobs: the median over the iterations
    after the first (which factors the targets), so neither the one-off factoring nor the fit's
    start-up is counted."""
    import lightning as L

    name = next((m for m in args.models if m != "fedavg"), "mlp")
    model, dataset = SETTINGS[name]
    v, n = (args.jobs or DEFAULT_JOBS[name])[-1], args.iterations * 5
    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, *_: Any) -> None:
            ends.append(time.perf_counter())

    module = make_module(model, dataset, v)
    module.chunk = n + 1
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    trainer.fit(module)
    t_lightning = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    module = make_module(model, dataset, v)
    engine_step(module)  # the first iteration factors the targets
    plain = []
    for _ in range(n):
        start = time.perf_counter()
        engine_step(module)
        plain.append(time.perf_counter() - start)
    t_plain = statistics.median(plain)
    print(
        f"Lightning Trainer vs plain loop ({name}, V={v}, median of {n} iterations after the first): "
        f"{t_lightning * 1e3:.1f} vs {t_plain * 1e3:.1f} ms/iteration (overhead {1e3 * (t_lightning - t_plain):.1f} ms)"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp", "vit", "fedavg"],
        choices=[*SETTINGS, "fedavg"],
        help="fedavg: the FedAvg replay rows (MLP/MNIST update captures, SGD and Adam)",
    )
    parser.add_argument(
        "--jobs",
        nargs="+",
        type=int,
        help="V values for every model (default: per model, "
        + ", ".join(f"{m} {' '.join(map(str, v))}" for m, v in DEFAULT_JOBS.items())
        + ")",
    )
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations per repeat, after 2 warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per setting; the best one counts")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, the number of cores)")
    parser.add_argument(
        "--baseline-victims", type=int, default=4, help="victims the plain loop runs, one after another"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="images per victim job (B)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--fedavg-jobs", type=int, default=16, help="jobs (V) of the FedAvg rows")
    parser.add_argument("--fedavg-steps", type=int, default=4, help="local steps K (= images N, batch 1)")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="also time the factored path under bf16 autocast (an experiment: the engine runs float32)",
    )
    parser.add_argument(
        "--previous",
        action="store_true",
        help="also time the factored path as the engine ran it before its small-product form "
        "(layer_terms.SMALL_PRODUCT = 0: every per-job product a bmm), in turns with the others",
    )
    parser.add_argument(
        "--lightning", action="store_true", help="also time the Lightning Trainer against the plain loop"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    memory = PeakMemory(device)
    peak = Peak(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(
        f"torch {torch.__version__}, {where}; fp32 GEMM peak {peak.first:.0f} GFLOP/s now ({gemm_size(device)}^3, "
        "best of 5; the % peak column uses the best measured in the run up to its row); "
        f"B = {args.batch_size}, DIA, best of {args.repeats} x {args.iterations} timed iterations per setting"
    )
    print(
        f"baseline: the plain loop, one victim at a time ({args.baseline_victims} of the same jobs in turn); "
        "'x baseline' = victim-it/s over the baseline's, this run"
    )
    if "fedavg" in args.models:
        print("fedavg rows: 'x baseline' = victim-it/s over the one-job replay loop's on the same jobs, this run")
    print(HEADER)
    results = []
    for name in args.models:
        if name == "fedavg":
            results += bench_fedavg(args, device, peak, memory)
        else:
            results += bench_model(name, args.jobs or DEFAULT_JOBS[name], args, device, peak, memory)
    end_peak = peak.measure(reps=5)
    print(
        f"fp32 GEMM peak: {peak.first:.0f} GFLOP/s at the start of the run, {end_peak:.0f} at its end, "
        f"best in the run {peak.best:.0f} (the % peak column uses the best up to its row)"
    )
    if args.lightning:
        lightning_overhead(args)
    return results


if __name__ == "__main__":
    main()
