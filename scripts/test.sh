#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (ctest prints its summary).
# Idempotent; a second run only rebuilds what changed. CI runs this through .ci/run.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${STRATA_BUILD_DIR:-$repo/build}
"$repo/scripts/setup.sh"
cd "$build_dir"
# The 32-rank tests (ctest's test "ranks32": 12 GB of RAM and minutes on 2 cores) stay out, by
# name, unless the arguments include tests themselves (`scripts/test.sh -L ranks32` runs only them)
# or give their own name exclusion (-E), which then replaces this one.
exclusion=(-E '^ranks32$')
for a in "$@"; do
  case "$a" in
    -LE|-LE?*|--label-exclude) ;;  # label exclusions (-LE gpu) combine with the name exclusion
    -L|-L?*|-R|-R?*|-I|-I?*|-U|-E|-E?*|--label-regex|--tests-regex|--tests-information|--union|--exclude-regex) exclusion=() ;;
  esac
done
ctest --output-on-failure -j "${STRATA_JOBS:-$(nproc)}" --timeout 900 ${exclusion[@]+"${exclusion[@]}"} "$@"
