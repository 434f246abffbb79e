#!/usr/bin/env bash
# GPU checks and benchmarks on the measurement machines, which have torch and triton but not
# torchtitan: its wheels are carried in .whl/. Results go to $OUT (or ./gpu_results).
#   scripts/measure_on_gpu.sh tests   # the whole test suite, as the README runs it, where CUDA is
#     (TESTS="tests/test_fp8_experts_gpu.py ..." runs those only)
#   scripts/measure_on_gpu.sh bench   # MoE layer (eager and compiled, vs stock torchtitan eager and
#     compiled) and expert block benchmarks
#   scripts/measure_on_gpu.sh ep4 ep2 # EP equivalence + dispatch/combine benchmark on 4 and 2 GPUs
#   scripts/measure_on_gpu.sh train-tiny train-full   # training through the Trainer on 2 GPUs
#   scripts/measure_on_gpu.sh train-numerics   # 2 GPUs, 300 steps on the endless markov_text corpus: FP8
#     experts' loss against the bf16 layers'
#   scripts/measure_on_gpu.sh scale-out   # 4 or 8 GPUs of one host: ep4 (and ep8), then train-scale4 (or
#     train-scale8): EP 1 vs 4 (vs 8) losses of a tiny flavor, qwen3-30b-a3b and deepseek-v3-16b next to stock
#   scripts/measure_on_gpu.sh memory   # 2 GPUs: allocator snapshots of olmoe-1b-7b, stock and ours, and where
#     their reserved memory came from
#   scripts/measure_on_gpu.sh profile   # 2 GPUs (PROFILE_GPUS): profiled steps of olmoe-1b-7b (PROFILE_FLAVOR;
#     triton over symm_mem), as the flavor trains, with PROFILE_VARIANTS' options and (PROFILE_STOCK=1) its
#     stock sibling, each read by `bench trace`
#   scripts/measure_on_gpu.sh fp8   # 2 GPUs: FP8 expert tests, layer and whole-model runs next to bf16 and stock
#   scripts/measure_on_gpu.sh train-step   # one GPU: a training step of 4 olmoe-1b-7b layers per
#     backend (fp32 parameters under bf16 autocast, as torchtitan trains on one GPU) and of the
#     same layers with torchtitan's own MoE, each eager and compiled (torchtitan's apply_compile),
#     plus the "auto" choice for olmoe-1b-7b
#     (train-*: torch >= 2.13; see ../shared/gpu for bringing it to the measurement machines)
# Results record SOURCE_COMMIT when set (e.g. SOURCE_COMMIT=$(git rev-parse --short HEAD) taken
# where the checkout was copied from), else the copy's own git HEAD.
set -uo pipefail
out=${OUT:-gpu_results}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
# The checkout on PYTHONPATH: every module is the file its dotted name spells.
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off on the shared measurement hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
gpus=$(nvidia-smi --list-gpus | wc -l)
need_gpus() {  # need_gpus N TASK: stop with a clear message when this host has fewer than N GPUs
  if (( gpus < $1 )); then echo "$2 needs $1 GPUs of one host; this host has $gpus"; exit 2; fi
}
run_task() {
  local task=$1
  case $task in
    tests)
      # Every test file; on worker processes when pytest-xdist is installed, else in one process.
      # The Hugging Face checks need transformers, which the measurement machines lack: wheels in
      # .whl-hf/ (transformers, what it needs that the machine lacks, pytest-xdist) are installed when
      # present, e.g. pip download --only-binary=:all: --python-version 3.12 -d .whl-hf transformers
      # safetensors pytest-xdist (then delete the numpy wheel: the machine's own stays).
      if compgen -G ".whl-hf/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl-hf/*.whl || exit 1
      fi
      one_process=$(python3 -c "import xdist" 2>/dev/null || echo "-o addopts=-rfEs")
      # -v names each test as it ends, so a run cut short still names its failures.
      # TESTS names test files or node ids to run instead of every test file.
      python3 -m pytest -v -p no:cacheprovider $one_process ${TESTS:-} 2>&1 | tee "$out/gpu_tests.log" ;;
    bench)
      # BENCH_ROUNDS times every layer / implementation that many times, taking turns, and keeps the medians.
      # The layer bench times stock torchtitan's layer and each of BENCH_LAYERS (default grouped_mm triton),
      # eager and compiled (Inductor), at the 4 named shapes x 2 skews: 6 variants in each round, 12
      # compilations (the second skew of a shape reuses the first's). Sized for about 5 minutes on an H100
      # at one round (estimate: 10-20 s per compilation on a cold Inductor cache, about 5 s of timing per
      # shape and skew per round). for_loop and batched_mm_padded (eager: up to 280 ms per forward+backward
      # at Qwen3's shape) run only when named in BENCH_LAYERS; BENCH_COMPILE=eager|compiled|both (default both).
      python3 -m torchtitan_ext.bench layer --layers ${BENCH_LAYERS:-grouped_mm triton} --compile "${BENCH_COMPILE:-both}" \
          ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} --json "$out/moe_layer.json" 2>&1 | tee "$out/moe_layer.log"
      python3 -m torchtitan_ext.bench expert ${BENCH_ROUNDS:+--rounds $BENCH_ROUNDS} --json "$out/expert_block.json" 2>&1 | tee "$out/expert_block.log" ;;
    ep[0-9]*)
      ranks=${task#ep}
      need_gpus "$ranks" "$task"
      # EP_CHECK_BACKENDS narrows the equivalence check (e.g. "grouped_mm for_loop");
      # EP_TIMEOUT_S bounds each run (default 290 s; a cold Triton cache compiles for minutes).
      timeout "${EP_TIMEOUT_S:-290}" torchrun --nproc_per_node="$ranks" -m torchtitan_ext.bench ep --check \
          ${EP_CHECK_BACKENDS:+--check-backends $EP_CHECK_BACKENDS} \
          --json "$out/ep_dispatch_w$ranks.json" 2>&1 | tee "$out/ep_dispatch_w$ranks.log" ;;
    train-tiny|train-full|train-numerics|train-scale4|train-scale8)
      # TRAIN_ONLY narrows the runs (space-separated regular expressions on run names, e.g. "ep2.symm_mem").
      # The scale suites take longer than one sitting may allow (each full-size run: compilation and
      # 20 steps): TRAIN_ONLY="^qwen3-30b-a3b.fsdp8.ep8" runs one model and layout with its stock baseline;
      # give each part its own OUT.
      suite=${task#train-}
      # TRAIN_LOCAL_BATCH sets the full, numerics and scale suites' sequences per GPU per step (default:
      # full 4, an H200 takes 8; numerics 2; scale 1). Every run trains with the CUDA allocator settings
      # of PYTORCH_ALLOC_CONF when it is set (PYTORCH_ALLOC_CONF= for torch's defaults), else with the
      # train entry's expandable_segments:True (recorded in the JSON's environment).
      # TRAIN_ROUNDS (full and scale suites) launches the runs that many times, round after round, each
      # round beside its own stock run, and summarises each run by the median of its rounds.
      python3 scripts/gpu_training_runs.py "$suite" --out "$out/train_$suite.json" \
          ${TRAIN_ONLY:+--only $TRAIN_ONLY} ${TRAIN_LOCAL_BATCH:+--local-batch-size $TRAIN_LOCAL_BATCH} \
          ${TRAIN_ROUNDS:+--rounds $TRAIN_ROUNDS} \
          ${TRAIN_RUN_TIMEOUT_S:+--run-timeout $TRAIN_RUN_TIMEOUT_S} \
          2>&1 | tee "$out/train_$suite.log" ;;
    train-step)
      # TRAIN_STEP_BACKENDS narrows the backends (default: grouped_mm triton); TRAIN_STEP_COMPILE=eager|compiled|both
      # (default both). One run: stock torchtitan's MoE (olmoe-1b-7b-torchtitan-moe) first, then each backend,
      # each eager and compiled: 6 models built one after another, 3 compilations (each block alike: one
      # compiles, the others reuse it), a few minutes on an H100.
      sizes="--num-layers 4 --batch-size 2 --seq-len 4096"
      python3 -m torchtitan_ext.bench train-step --flavor olmoe-1b-7b --stock-flavor olmoe-1b-7b-torchtitan-moe $sizes \
          --backends ${TRAIN_STEP_BACKENDS:-grouped_mm triton} --compile "${TRAIN_STEP_COMPILE:-both}" \
          --json "$out/train_step_olmoe.json" 2>&1 | tee "$out/train_step_olmoe.log"
      TORCHTITAN_EXT_CACHE="$out/cache" python3 -m torchtitan_ext.bench auto --flavor olmoe-1b-7b \
          --json "$out/auto_olmoe.json" 2>&1 | tee "$out/auto_olmoe.log" ;;
    fp8)
      # FP8 experts (docs/fp8_experts.md), every number of the FP8 issue in one call on 2 GPUs of a host:
      # the FP8 GPU tests, the compiled layer at Qwen3's and OLMoE's shapes (FP8 grouped_mm and triton
      # next to bf16 and stock), then the full suite's runs stock compiled, bf16 grouped_mm over each
      # transport, the best bf16 (triton over symm_mem) and every FP8 run (about 2 minutes each;
      # TRAIN_LOCAL_BATCH as train-full).
      # torchtitan's own float8 experts (the torchtitan_fp8 layer) run where torchao is installed: a wheel in
      # .whl-fp8/ is (pip download --no-deps -d .whl-fp8 torchao).
      need_gpus 2 "$task"
      if compgen -G ".whl-fp8/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl-fp8/*.whl || exit 1
      fi
      stock_fp8=$(python3 -c "import torchao" 2>/dev/null && echo torchtitan_fp8)
      python3 -m pytest -v -p no:cacheprovider -o addopts=-rfEs tests/test_fp8_experts_gpu.py 2>&1 | tee "$out/fp8_tests.log"
      python3 -m torchtitan_ext.bench layer --shapes qwen3-30b-a3b olmoe-1b-7b --skew balanced \
          --layers grouped_mm triton grouped_mm_fp8 triton_fp8 $stock_fp8 --compile compiled --json "$out/moe_layer_fp8.json" \
          2>&1 | tee "$out/moe_layer_fp8.log"
      TRAIN_ONLY="torchtitan-moe.compiled$ grouped_mm.compiled$ grouped_mm.compiled.symm_mem$ grouped_mm.compiled.symm_mem.defaults$ triton.compiled.symm_mem$ triton.compiled.symm_mem.defaults$ fp8.compiled$ fp8.compiled.symm_mem$ fp8.compiled.symm_mem.defaults$" \
          run_task train-full ;;
    memory)
      # Where the reserved memory of olmoe-1b-7b (FSDP 2 x EP 2, compiled, batch TRAIN_LOCAL_BATCH (4) x 2048)
      # comes from: stock torchtitan's MoE and triton over symm_mem (the defaults: static rows under CUDA graphs),
      # MEMORY_STEPS (8) steps each with a CUDA allocator snapshot of both ranks at the last step, read by
      # `bench memory` (the summaries come back; the snapshots, hundreds of MB, stay on the machine). MEMORY_RUNS names the runs (default: stock triton_symm_mem).
      need_gpus 2 "$task"
      steps=${MEMORY_STEPS:-8}
      common="--training.steps $steps --training.local_batch_size ${TRAIN_LOCAL_BATCH:-4}
        --training.seq_len 2048 --parallelism.expert_parallel_degree 2 --metrics.log_freq 1 --compile.enable
        --profiler.enable_memory_snapshot --profiler.memory_snapshot_freq $steps"
      declare -A memory_runs=(
        [stock]="--flavor olmoe-1b-7b-torchtitan-moe"
        [triton_symm_mem]="--flavor olmoe-1b-7b --toml examples/triton.toml --toml examples/ep_symm_mem.toml"
        [grouped_mm_symm_mem]="--flavor olmoe-1b-7b --moe.compute_backend grouped_mm --toml examples/ep_symm_mem.toml"
        [triton_all_to_all]="--flavor olmoe-1b-7b --toml examples/triton.toml --moe.ep_transport all_to_all"
      )
      for name in ${MEMORY_RUNS:-stock triton_symm_mem}; do
        [[ -n ${memory_runs[$name]:-} ]] || { echo "unknown memory run $name (${!memory_runs[*]})"; exit 2; }
        dump=$(mktemp -d)
        python3 -m torchtitan_ext.train --nproc_per_node=2 ${memory_runs[$name]} $common --dump_folder "$dump" > "$out/memory_$name.log" 2>&1
        grep -E "step: |rror" "$out/memory_$name.log" | tail -n 24
        python3 -m torchtitan_ext.bench memory "$dump/profiling/memory_snapshot" \
            --json "$out/memory_$name.json" 2>&1 | tee "$out/memory_$name.txt"
      done ;;
    profile)
      # Where a step's GPU time goes: PROFILE_FLAVOR (olmoe-1b-7b) on PROFILE_GPUS (2) GPUs, FSDP x EP over all
      # of them, compiled, batch TRAIN_LOCAL_BATCH (4) x 2048; `triton` over symm_mem as the flavor trains (static
      # rows under CUDA graphs where moe.ep_receive_rows "auto" picks them), then with the options of each
      # PROFILE_VARIANTS entry (";"-separated; default "--moe.ep_receive_rows exact": the step that waits for
      # the host; "none": no variant); PROFILE_STOCK=1 first profiles the flavor's stock sibling
      # (<flavor>-torchtitan-moe, compiled: profile_stock.*). PROFILE_STEPS (6) steps each, torch.profiler
      # tracing the last; every rank's trace read by `bench trace` (kernel time by kind, the GPU's idle spans and
      # what the host ran then, top kernels, host syncs: a step paced by one rank's host shows that rank's GPU
      # idle and the others waiting in communication kernels).
      # E.g. PROFILE_FLAVOR=deepseek-v3-16b PROFILE_GPUS=4 TRAIN_LOCAL_BATCH=1 PROFILE_STOCK=1.
      gpus_needed=${PROFILE_GPUS:-2}
      need_gpus "$gpus_needed" "$task"
      flavor=${PROFILE_FLAVOR:-olmoe-1b-7b}
      steps=${PROFILE_STEPS:-6}
      variants=()
      [[ ${PROFILE_VARIANTS:-} == none ]] || IFS=';' read -ra variants <<< "${PROFILE_VARIANTS:---moe.ep_receive_rows exact}"
      profiled=()
      [[ ${PROFILE_STOCK:-0} == 1 ]] && profiled+=("stock")
      for index in "${!variants[@]}" "${#variants[@]}"; do profiled+=("$index"); done
      for name in "${profiled[@]}"; do
        dump=$(mktemp -d)
        if [[ $name == stock ]]; then
          run=(--flavor "$flavor-torchtitan-moe")
          echo "profile stock: $flavor-torchtitan-moe"
        elif (( name == 0 )); then
          run=(--flavor "$flavor" --toml examples/triton.toml --toml examples/ep_symm_mem.toml)
          echo "profile 0: as the flavor trains"
        else
          read -ra extra <<< "${variants[name - 1]}"
          run=(--flavor "$flavor" --toml examples/triton.toml --toml examples/ep_symm_mem.toml "${extra[@]}")
          echo "profile $name: ${variants[name - 1]}"
        fi
        python3 -m torchtitan_ext.train --nproc_per_node="$gpus_needed" "${run[@]}" --training.steps "$steps" \
            --training.local_batch_size "${TRAIN_LOCAL_BATCH:-4}" --training.seq_len 2048 \
            --parallelism.expert_parallel_degree "$gpus_needed" --metrics.log_freq 1 --compile.enable \
            --profiler.enable_profiling --profiler.profile_freq "$steps" --dump_folder "$dump" > "$out/profile_$name.log" 2>&1
        grep -E "step: |rror" "$out/profile_$name.log" | tail -n 3
        python3 -m torchtitan_ext.bench trace "$dump"/profiling/traces/*/rank*_trace.json.gz \
            --json "$out/profile_$name.json" 2>&1 | tee "$out/profile_$name.txt"
      done ;;
    scale-out)
      # Every run on all GPUs of the host: 8 or more take the 8-GPU runs, 4 to 7 the 4-GPU ones.
      need_gpus 4 "$task"
      if (( gpus >= 8 )); then
        run_task ep4; run_task ep8; run_task train-scale8
      else
        run_task ep4; run_task train-scale4
      fi ;;
    *) echo "unknown task $task (tests, bench, ep<ranks>, train-tiny, train-full, train-numerics, train-scale4, train-scale8, scale-out, train-step, fp8, memory, profile)"
       exit 2 ;;
  esac
}
for task in "$@"; do
  run_task "$task"
done
