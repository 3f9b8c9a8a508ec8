#!/usr/bin/env bash
# Builds Strata and runs the tests (GPU-labelled ones included), the benchmarks and GPU training
# runs on the GPU machine, which has no network: libtorch comes from python3's torch, liburing,
# nlohmann-json and gloo headers from Debian packages carried in .deps/debs, and a static fio in
# .deps/bin (both made by scripts/fetch-debs.sh on a machine with network).
#
# On the development machine:   scripts/fetch-debs.sh
# As the device command:        scripts/gpu-machine.sh [PHASE...]     (carry: [".deps"])
# Phases, in the order given (default: build test bench train):
#   build   configure (once) and build build-gpu/ for sm_90
#   test    ctest, every label but s3 (its server packages are not carried); log in $OUT/ctest.log
#   gputest ctest -L gpu only, and the tiled head's GPU test
#   (STRATA_BUILD_TARGETS="strata cuda_kernels_tests engine_cuda_tests tiling_tests": build only
#   those, for a lease too short for the whole build)
#   bench   strata bench io / adam / step / ckpt (JSON lines in $OUT/bench-*.jsonl)
#   tiling  strata bench tiling --device cuda alone (head, block and vocabulary tiles; capacity)
#   adam    strata bench adam alone (CPU kernel and, with a GPU, the CUDA kernel)
#   plan    strata train --plan of the largest configs on this machine's real budgets (seconds;
#           nothing allocated): where 10.3B and 14.1B would go before running them
#   planner strata plan --calibrate on the GPU, the planner's published-results tests, and
#           strata bench plan --device cuda: six GPU runs beside their predictions
#   train   strata train on the GPU: GPT 1.4B, host-placed and device-placed state
#           (STRATA_TRAIN_CONFIGS: other configs, e.g. "gpu-gpt-10b-auto-backward" or
#           "gpu-gpt-14b-auto-backward": the largest models, 10 steps each, one per device call;
#           STRATA_TRAIN_TIMEOUT: seconds per run, default 300)
#   ckpttrain  asynchronous saves during GPU training: GPT 1.4B with its optimizer state on the
#           GPU ("device") and split by the planner ("auto"), 12 steps, a save every 4: what each
#           save blocked the step for, what the updates after it waited (timeline.wait_checkpoint)
#   baseline  bench/train_baseline.py: plain PyTorch (and FSDP2 with CPU offload)
#   benchtrain  strata bench train: the 1.4B configs (host, auto, auto with recompute "auto", nvme)
#           beside plain PyTorch and
#           FSDP2 + CPUOffloadPolicy in one run, then the 2.8B ones (host, auto); final JSON lines
#           in $OUT/bench-train-*.jsonl (STRATA_BENCH_SHAPES="1.4b" to run one shape;
#           "1.4b-noclip": host placement without clipping, the update overlapped with the next
#           forward vs with the backward, beside the baselines without clipping)
# Results are written to $OUT (default: build-gpu/out); each phase prints a short summary last.
#
# A session's GPU time is short (15 minutes in all, 10 per command, the machine given back 30 s
# after a call): run scripts/fetch-debs.sh here first, carry .deps, and issue the calls back to
# back. With 15 minutes, build only what the GPU evidence needs:
#   1. STRATA_BUILD_TARGETS="strata cuda_kernels_tests engine_cuda_tests tiling_tests planner_tests"
#      build gputest          (every never-run CUDA path)
#   2. tiling planner         (one-pass vs two-pass head on the GPU; the planner's constants, its
#                             errors and the runs' logs, $OUT/bench-plan-logs)
# With more time, the whole sequence:
#   1. build plan gputest     (the build alone takes minutes; gputest is every never-run CUDA path)
#      then planner           (the planner's constants and its errors on this GPU, ~3 minutes)
#   2. benchtrain             (STRATA_BENCH_SHAPES=1.4b first if time is short)
#   3. STRATA_TRAIN_CONFIGS=gpu-gpt-10b-auto-backward STRATA_TRAIN_TIMEOUT=560 ... train
#   4. the same with gpu-gpt-14b-auto-backward
# A fresh machine (after a gap) rebuilds from scratch: keep the calls together.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${STRATA_BUILD_DIR:-$repo/build-gpu}
out=${OUT:-$build_dir/out}
prefix=$repo/.deps/prefix
mkdir -p "$out" "$prefix"
log() { printf '[gpu-machine %(%T)T] %s\n' -1 "$*" >&2; }
phases=("$@")
((${#phases[@]})) || phases=(build test bench train)

shopt -s nullglob
debs=("$repo"/.deps/debs/*.deb)
((${#debs[@]})) || { log "no .deb files in .deps/debs: run scripts/fetch-debs.sh and carry .deps"; exit 1; }
for d in "${debs[@]}"; do dpkg -x "$d" "$prefix"; done
export PATH=$repo/.deps/bin:$PATH  # the carried static fio
fio_bin=$(command -v fio || echo none)
strata=$build_dir/strata
status=0

# Tiling on the GPU: the head's logits at 8K tokens x 128K vocabulary (a 4 GiB fp32 logits tensor),
# the blocks in 2 attention x 4 MLP tiles and the embedding and head in vocabulary tiles beside
# whole ones, the largest hidden size and logits in 2 GiB, and the longest sequence in 1 GiB.
bench_tiling() {
  "$strata" bench tiling --device cuda --compute bf16 --threads 16 --hidden 1024 --heads 8 --vocab 131072 \
    --seq 2048 --batch 4 --budget 2GiB --capacity-hidden 1024 --capacity-tokens 8192 \
    --sequence-budget 1GiB --sequence-hidden 1024 --sequence-max 131072 \
    >"$out/bench-tiling.jsonl" 2>"$out/bench-tiling.err" || status=1
  tail -5 "$out/bench-tiling.jsonl"
  # (a) again with the head's tiles in one pass (placement.tiling.head_pass "one"): its first line.
  "$strata" bench tiling --device cuda --compute bf16 --threads 16 --hidden 1024 --heads 8 --vocab 131072 \
    --seq 2048 --batch 4 --head-pass one --parts a \
    >"$out/bench-tiling-one-pass.jsonl" 2>"$out/bench-tiling-one-pass.err" || status=1
  head -1 "$out/bench-tiling-one-pass.jsonl"
}

for phase in "${phases[@]}"; do
  log "phase $phase"
  case $phase in
  build)
    torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2; df -h "$repo" | tail -1; } | tee "$out/machine.txt"
    if [ ! -f "$build_dir/build.ninja" ]; then
      cmake -S "$repo" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DSTRATA_PYTHON="$(command -v python3)" >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
    fi
    # -k 0: a target that fails to compile does not stop the others (their tests still run).
    # STRATA_BUILD_TARGETS: only these targets (a short lease: the strata binary and the GPU tests).
    targets=(); for t in ${STRATA_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
    if ! timeout "${STRATA_BUILD_TIMEOUT:-3000}" cmake --build "$build_dir" -j "$(nproc)" "${targets[@]}" -- -k 0 >"$out/build.log" 2>&1; then
      status=1; grep -B2 -A12 -m5 'error' "$out/build.log"
    fi
    log "built"
    ;;
  test)
    # The CPU tests are sized for 2-core machines: many of them at once, each with 16 OpenMP
    # threads, oversubscribe the cores a hundredfold. Two threads each, as in CI.
    (cd "$build_dir" && OMP_NUM_THREADS=2 timeout 480 ctest --output-on-failure -j 8 --timeout 300 -LE s3) >"$out/ctest.log" 2>&1 || status=1
    grep -E "tests passed|tests failed|\*\*\*Failed|Not Run|Timeout|SKIPPED|Skipped" "$out/ctest.log" | tail -25
    ;;
  gputest)
    (cd "$build_dir" && ctest --output-on-failure -L gpu --timeout 300) >"$out/ctest-gpu.log" 2>&1 || status=1
    # The tiled head's GPU case lives with the tiling tests (label tiling).
    if [ -x "$build_dir/tests/tiling_tests" ]; then
      "$build_dir/tests/tiling_tests" --gtest_filter='*Gpu*' >>"$out/ctest-gpu.log" 2>&1 || status=1
    fi
    grep -E "tests passed|tests failed|Failed|Not Run|PASSED|FAILED" "$out/ctest-gpu.log" | tail -30
    ;;
  bench)
    bdir=$build_dir/bench-dir; mkdir -p "$bdir"
    "$strata" bench io --dir "$bdir/io" --size 4G --repeat 2 --fio "$fio_bin" >"$out/bench-io.jsonl" 2>"$out/bench-io.err" || status=1
    "$strata" bench adam --params 200000000 --threads 16 >"$out/bench-adam.jsonl" 2>"$out/bench-adam.err" || status=1
    "$strata" bench ckpt --dir "$bdir/ckpt" --fio "$fio_bin" >"$out/bench-ckpt.jsonl" 2>"$out/bench-ckpt.err" || status=1
    "$strata" bench step --threads 16 --steps 7 >"$out/bench-step.jsonl" 2>"$out/bench-step.err" || status=1
    bench_tiling
    rm -rf "$bdir"
    for f in "$out"/bench-*.jsonl; do echo "== $f"; tail -1 "$f"; done
    ;;
  tiling)
    bench_tiling
    ;;
  adam)
    "$strata" bench adam --params 100000000 --threads 16 >"$out/bench-adam.jsonl" 2>"$out/bench-adam.err" || status=1
    tail -2 "$out/bench-adam.jsonl"
    ;;
  plan)
    mkdir -p "$out/strata-swap"  # the configs' offload.nvme_dirs: its free space is the NVMe budget
    for c in gpu-gpt-10b-auto-backward gpu-gpt-14b-auto-backward; do
      echo "== plan $c"
      (cd "$out" && "$strata" train --config "$repo/bench/configs/$c.json" --plan) 2>&1 | tee -a "$out/plan.txt" || status=1
    done
    rmdir "$out/strata-swap" 2>/dev/null || true
    ;;
  planner)
    # strata plan's models on this GPU: calibrate the GPU (bf16 linear layers, attention, a block,
    # PCIe each way, CPU Adam, the disk), the published-results tests, then six GPU runs beside
    # their predictions (strata bench plan --device cuda; final JSON line last).
    "$strata" plan --calibrate --device cuda --dir "$build_dir" --output "$out/cluster-gpu.json" \
      >"$out/planner.txt" 2>&1 || status=1
    "$build_dir/tests/planner_tests" >>"$out/planner.txt" 2>&1 || status=1
    "$strata" bench plan --device cuda --cluster "$out/cluster-gpu.json" --dir "$build_dir/bench-plan" \
      >"$out/bench-plan.jsonl" 2>"$out/bench-plan.err" || status=1
    # Each run's training log (its step timelines: where the GPU steps wait) for the diagnosis.
    mkdir -p "$out/bench-plan-logs" && cp "$build_dir"/bench-plan/*.jsonl "$out/bench-plan-logs/" 2>/dev/null
    grep -E "^[|]|error" "$out/bench-plan.jsonl" | tail -9
    ;;
  train)
    # One log and one error file for all runs (the device tool returns at most 8 files).
    mkdir -p "$out/strata-swap"
    # Every run prints its per-step timeline (--profile) into train.err; the trace file of the
    # 1.4B host-placement run is kept (trace.json, chrome://tracing or ui.perfetto.dev).
    for c in ${STRATA_TRAIN_CONFIGS:-gpu-gpt-1.4b-host gpu-gpt-1.4b-auto gpu-gpt-1.4b-device gpu-gpt-1.4b-nvme gpu-gpt-2.8b-host gpu-gpt-2.8b-auto}; do
      echo "== $c" >>"$out/train.err"
      trace=$out/trace-discard.json
      [ "$c" = gpu-gpt-1.4b-host ] && trace=$out/trace.json
      (cd "$out" && timeout "${STRATA_TRAIN_TIMEOUT:-300}" "$strata" train --config "$repo/bench/configs/$c.json" --no-progress --profile "$trace") >>"$out/train.err" 2>&1 || status=1
      rm -f "$out/trace-discard.json"
      echo "== $c"; tail -2 "$out/train.err"
      # The run's own log (run.log in the config; the names do not follow one pattern).
      f=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("run", {}).get("log", ""))' "$repo/bench/configs/$c.json")
      [ -n "$f" ] || log "$c: no run.log in its config, no summary"
      case $f in /*) ;; ?*) f=$out/$f ;; esac
      if [ -f "$f" ]; then
        python3 - "$f" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
if rows:
    steady = rows[1:] or rows
    s = sorted(r["seconds"] for r in steady)[len(steady) // 2]
    losses = " ".join("%.2f" % r["loss"] for r in rows)
    print("  steps %d, median s/step after the first %.3f, model TFLOPS %.1f, losses %s, peak RSS %.1f GiB"
          % (len(rows), s, rows[-1]["model_tflops"], losses, rows[-1].get("peak_rss", 0) / 2**30))
PY
        cat "$f" >>"$out/train.jsonl"; rm -f "$f"
      fi
    done
    rm -rf "$out/strata-swap"
    ;;
  ckpttrain)
    for c in gpu-gpt-1.4b-device gpu-gpt-1.4b-auto; do
      cfg=$out/$c-ckpt.json
      python3 - "$repo/bench/configs/$c.json" "$cfg" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
j.setdefault("run", {}).update(steps=12, save_every=4, keep_checkpoints=1, log="ckpt-train.jsonl")
json.dump(j, open(sys.argv[2], "w"), indent=1)
PY
      echo "== $c" >>"$out/ckpttrain.err"
      rm -rf "$build_dir/ckpt-train"  # each config's own checkpoints: a run refuses another run's
      (cd "$out" && timeout 500 "$strata" train --config "$cfg" --no-progress --checkpoint-dir "$build_dir/ckpt-train") \
        >>"$out/ckpttrain.err" 2>&1 || status=1
      echo "== $c"; grep -E "background|committed" "$out/ckpttrain.err" | tail -8
      if [ -f "$out/ckpt-train.jsonl" ]; then
        python3 - "$out/ckpt-train.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
print("  s/step:", " ".join("%.2f" % r["seconds"] for r in rows))
print("  wait_checkpoint s:", " ".join("%.2f" % r["timeline"].get("wait_checkpoint", 0) for r in rows))
print("  peak RSS %.1f GiB" % (rows[-1].get("peak_rss", 0) / 2**30) if rows else "  no steps")
PY
        cat "$out/ckpt-train.jsonl" >>"$out/ckpttrain.jsonl"; rm -f "$out/ckpt-train.jsonl"
      fi
      rm -rf "$build_dir/ckpt-train" "$cfg"
    done
    ;;
  benchtrain)
    for shape in ${STRATA_BENCH_SHAPES:-1.4b 2.8b}; do
      case $shape in
      1.4b) configs="gpu-gpt-1.4b-host gpu-gpt-1.4b-auto gpu-gpt-1.4b-auto-keep gpu-gpt-1.4b-nvme" ;;
      2.8b) configs="gpu-gpt-2.8b-host gpu-gpt-2.8b-auto" ;;
      1.4b-noclip) configs="gpu-gpt-1.4b-host-noclip gpu-gpt-1.4b-host-backward" ;;
      *) log "unknown shape $shape"; status=1; continue ;;
      esac
      list=$(for c in $configs; do printf '%s,' "$repo/bench/configs/$c.json"; done)
      timeout 560 "$strata" bench train --configs "${list%,}" --dir "$build_dir/bench-train" --profile \
        >"$out/bench-train-$shape.jsonl" 2>>"$out/bench-train.err" || status=1
      rm -rf "$build_dir/bench-train"
      echo "== bench train $shape"; tail -1 "$out/bench-train-$shape.jsonl"
    done
    ;;
  baseline)
    # Plain PyTorch and FSDP2 + CPUOffloadPolicy (fused CPU AdamW) on the GPT shapes of the brief.
    for shape in "24 2048" "32 2560"; do
      set -- $shape
      for mode in plain fsdp2; do
        timeout 200 python3 "$repo/bench/train_baseline.py" --mode $mode --layers $1 --hidden $2 --steps 4 \
          >>"$out/baseline.jsonl" 2>>"$out/baseline.err" || status=1
        echo "== $mode L=$1 d=$2"; tail -1 "$out/baseline.jsonl"
      done
    done
    ;;
  *) log "unknown phase $phase"; exit 2 ;;
  esac
done
exit $status
