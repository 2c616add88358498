"""GPU check, ready for when a GPU machine is lent (a few minutes):

    .venv/bin/python benchmarks/gpu_check.py            # exits at once, one line, without a GPU

1. the engine's loss on the GPU equals the CPU's for the same jobs, factored and dense paths;
2. throughput (benchmarks/attack_throughput.py on cuda: the batched engine as a ratio to the plain
   one-victim loop in the same run, dense and factored targets, GFLOP/s and % of the GPU's fp32
   GEMM peak, torch.cuda.max_memory_allocated) for the MLP/MNIST and the ViT/CIFAR-10 at a few V;
3. two small attacks end to end with `attacker run ... --device gpu` (MLP: IG (eval), WIIG and
   DIA; ViT: DIA; their results tables), each with its wall time and torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def check_cpu_equals_gpu() -> None:
    """The MLP's losses came out bit for bit equal on an H200, so the ViT (more, differently ordered
    reductions) is checked too, and each loss must have been computed on the device asked for."""
    from attack_throughput import make_module

    for model, dataset in (("mlp", "mnist"), ("vit", "cifar10")):
        for factored in (False, True):
            losses = []
            for device in ("cpu", "cuda"):
                module = make_module(model, dataset, 4, device)
                module.ghost.factored = factored
                loss, _ = module.job_losses(module.active())
                assert loss.device.type == device, f"the {device} loss was computed on {loss.device}"
                losses.append(loss.detach().cpu())
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
            print(
                f"engine loss, {model}, {'factored' if factored else 'dense'} targets: cuda equals cpu "
                f"(max difference {float((losses[1] - losses[0]).abs().max()):.1e})",
                flush=True,
            )


def attack_end_to_end(model: str, victims: int, attacks: list[str], iterations: int) -> int:
    """One ``attacker run`` on the GPU (MNIST: the paper's victims where `make victims` put them in the
    data folder, else the offline sample), with its wall time and CUDA peak memory."""
    from attacker.cli import main as attacker_main
    from fedsim.data import paper_victims_path

    victim_file = paper_victims_path("mnist", HERE.parent / "data")  # the paper's victims
    source = ["--victim-file", str(victim_file)] if victim_file.is_file() else []
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            "run",
            "--model",
            model,
            "--dataset",
            "mnist",
            "--p",
            "0.25",
            "--victims",
            str(victims),
            *source,
            "--attacks",
            *attacks,
            "--iterations",
            str(iterations),
            "--device",
            "gpu",
            "--no-lpips",
            "--quiet",
            "--out",
            str(Path(tmp) / "run"),
        ]
        print("attacker " + " ".join(argv), flush=True)
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        rc = attacker_main(argv)
        seconds = time.perf_counter() - start
    print(
        f"attacker run ({model}): exit {rc}, {seconds:.1f} s wall, torch.cuda.max_memory_allocated "
        f"{torch.cuda.max_memory_allocated() / 1e9:.2f} GB",
        flush=True,
    )
    return rc


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False); run it on a GPU machine",
            file=sys.stderr,
        )
        return 2
    from attack_throughput import main as bench

    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    check_cpu_equals_gpu()
    bench(["--device", "cuda", "--models", "mlp", "--jobs", "1", "128", "512", "2048", "--iterations", "20"])
    bench(["--device", "cuda", "--models", "vit", "--jobs", "1", "16", "64", "128", "--iterations", "10"])
    rc_mlp = attack_end_to_end("mlp", 16, ["ig_eval", "wiig", "dia"], 2000)
    rc_vit = attack_end_to_end(
        "vit", 128, ["dia"], 1000
    )  # one group of 128 on a GPU (the ViT's group_caps in fedsim.models.MODELS)
    return rc_mlp or rc_vit


if __name__ == "__main__":
    sys.exit(main())
