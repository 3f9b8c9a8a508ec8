#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (ctest prints its summary).
# Idempotent; a second run only rebuilds what changed. CI runs this through .ci/run.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${STRATA_BUILD_DIR:-$repo/build}
"$repo/scripts/setup.sh"
cd "$build_dir"
ctest --output-on-failure -j "${STRATA_JOBS:-$(nproc)}" --timeout 900 "$@"
