#!/usr/bin/env bash
# Builds Strata and runs every test (GPU-labelled ones included) and the benchmarks on the GPU
# machine, which has no network: libtorch comes from python3's torch, and liburing and
# nlohmann-json from Debian packages carried in .deps/debs (made by scripts/fetch-debs.sh) and
# unpacked here with `dpkg -x` into .deps/prefix.
#
# On the development machine:   scripts/fetch-debs.sh
# Then, as the device command:  scripts/gpu-machine.sh      (carry: [".deps/debs"])
# Results (test log, benchmark JSON lines) are written to $OUT (default: build-gpu/out).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${STRATA_BUILD_DIR:-$repo/build-gpu}
out=${OUT:-$build_dir/out}
prefix=$repo/.deps/prefix
mkdir -p "$out" "$prefix"
log() { printf '[gpu-machine] %s\n' "$*" >&2; }

shopt -s nullglob
debs=("$repo"/.deps/debs/*.deb)
((${#debs[@]})) || { log "no .deb files in .deps/debs: run scripts/fetch-debs.sh and carry it"; exit 1; }
for d in "${debs[@]}"; do dpkg -x "$d" "$prefix"; done

torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
if [ ! -f "$build_dir/build.ninja" ]; then
  cmake -S "$repo" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DCMAKE_CUDA_ARCHITECTURES=90
fi
cmake --build "$build_dir" -j "$(nproc)" 2>&1 | tail -5

log "tests"
(cd "$build_dir" && ctest --output-on-failure -j 8 --timeout 900) 2>&1 | tee "$out/ctest.log" | tail -30

log "benchmarks"
fio_bin=$(command -v fio || echo none)
"$build_dir/strata" bench io --dir "${STRATA_BENCH_DIR:-$build_dir/bench-io}" --size 4G \
  --repeat 2 --fio "$fio_bin" | tee "$out/bench-io.jsonl"
"$build_dir/strata" bench adam --params 200000000 --threads 16 | tee "$out/bench-adam.jsonl"
"$build_dir/strata" bench step --threads 16 --steps 9 | tee "$out/bench-step.jsonl"
