#!/usr/bin/env bash
# Installs what is missing, builds, and runs Strata's main job: `strata train` on
# configs/main.json (a small GPT-2-shaped model on /usr/share/common-licenses, fp32 master weights
# and Adam moments in NVMe swap files under build/strata-swap, gradients and compute copies on the
# host, a device budget smaller than the model). Extra arguments go to `strata train`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${STRATA_BUILD_DIR:-$repo/build}
"$repo/scripts/setup.sh"
cd "$repo"
mkdir -p "$build_dir/strata-swap"  # configs/main.json's offload.nvme_dirs
exec "$build_dir/strata" train --config "$repo/configs/main.json" \
  --log "$build_dir/strata-main.jsonl" --export "$build_dir/strata-main-model" --export-overwrite "$@"
