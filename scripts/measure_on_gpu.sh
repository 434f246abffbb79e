#!/usr/bin/env bash
# Expert-block and MoE-layer benchmarks on one GPU of the measurement machines, which
# have torch and triton but not torchtitan: its wheels are carried in .whl/ (see
# docs/results/README.md). Results go to $OUT (or ./gpu_results).
set -uo pipefail
out=${OUT:-gpu_results}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
# The source tree as an importable package (what `pip install -e .` maps).
ln -sfn ../kernels torchtitan_ext/kernels
ln -sfn ../experiments torchtitan_ext/experiments
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m torchtitan_ext.bench.moe_layer --out "$out/moe_layer.json" 2>&1 | tee "$out/moe_layer.log"
python3 -m torchtitan_ext.bench.expert_block --out "$out/expert_block.json" 2>&1 | tee "$out/expert_block.log"
