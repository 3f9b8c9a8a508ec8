#!/usr/bin/env bash
# Installs what is missing, builds, and runs Strata's main job. Until the fine-tuning demo lands
# (see docs/ARCHITECTURE.md, "What exists"), that is `strata bench io`: the NVMe tier's engine
# beside fio on $STRATA_BENCH_DIR (default: build/bench-io on the repository's file system).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${STRATA_BUILD_DIR:-$repo/build}
"$repo/scripts/setup.sh"
exec "$build_dir/strata" bench io --dir "${STRATA_BENCH_DIR:-$build_dir/bench-io}" "$@"
