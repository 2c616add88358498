#!/bin/bash
# Your own model, audited beside the project's (RESULTS.md "Your own model"): timm and torchvision models
# each run a Flower simulation on the offline CIFAR-10 sample (2 clients, 1 round captured as one-step
# gradients, audit mode), then `attacker audit` attacks the captures; the project's model of the same
# kind runs on the same images (same seed and clients). Usage: benchmarks/own_models_audit.sh [OUT] (IT=500)
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${1:-runs/own-models-audit}
IT=${IT:-500}
BIN=${BIN:-.venv/bin}
if [ -e "$OUT" ]; then echo "error: $OUT exists; choose a new folder" >&2; exit 2; fi
mkdir -p "$OUT"
run() {  # NAME MODEL OPTIONS
  local name=$1 model=$2 opts=$3 t0 t1 t2
  t0=$(date +%s)
  "$BIN/fedsim" simulate --model "$model" --model-options "$opts" --dataset cifar10 --p 0.25 --clients 2 \
    --rounds 1 --capture-rounds 1 --audit --run-dir "$OUT/fed-$name" > "$OUT/$name.sim.log" 2>&1 \
    || { echo "$name: simulation failed (see $OUT/$name.sim.log)"; return; }
  t1=$(date +%s)
  "$BIN/attacker" audit "$OUT/fed-$name" --model "$model" --iterations "$IT" --no-lpips --out "$OUT/audit-$name" \
    --quiet > "$OUT/$name.audit.log" 2>&1 || { echo "$name: audit failed (see $OUT/$name.audit.log)"; return; }
  t2=$(date +%s)
  echo "$name: simulation $((t1 - t0)) s, audit $((t2 - t1)) s, report $OUT/audit-$name/audit.md"
}
run timm_resnet18 timm:resnet18 '{}'
run resnet18 resnet18 '{}'
run timm_vit timm:vit_tiny_patch16_224 '{"img_size": 32, "patch_size": 4, "depth": 4}'
run vit vit '{}'
run tv_squeezenet torchvision.models:squeezenet1_1 '{"dropout": 0.25}'
run lenet lenet '{}'
# nn.Hardsigmoid squeeze-excite gates (replaced by their exact twice-differentiable equivalent); no project twin
run timm_mobilenetv3 timm:mobilenetv3_small_050 '{}'
