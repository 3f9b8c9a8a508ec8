#!/usr/bin/env bash
# Installs everything Strata needs on a Debian 12 machine, then configures and builds it.
# Idempotent: packages already present are not reinstalled, the Python environment is cached
# under $STRATA_CACHE (default ~/.cache/strata) and rebuilt only when requirements change,
# and the build directory is reused (ccache makes rebuilds cheap).
#
# Usage: scripts/setup.sh [--no-build] [--target NAME]...
#   --target: build only these CMake targets and what they need (scripts/run-main.sh builds the
#             `strata` program alone), without the packages only the tests use (fio, the S3
#             server's, iproute2); default: everything, the test suite's included.
# Environment: STRATA_CACHE, STRATA_BUILD_DIR (default build), STRATA_JOBS (default nproc).
set -euo pipefail
build=1 targets=() names=()
while (($#)); do
  case $1 in
    --no-build) build=0; shift ;;
    --target) [ $# -ge 2 ] || { echo "setup.sh: --target needs a name" >&2; exit 2; }
              targets+=(--target "$2"); names+=("$2"); shift 2 ;;
    *) echo "setup.sh: unknown argument $1 (--no-build, --target NAME)" >&2; exit 2 ;;
  esac
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${STRATA_CACHE:-$HOME/.cache/strata}
build_dir=${STRATA_BUILD_DIR:-$repo/build}
jobs=${STRATA_JOBS:-$(nproc)}
log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------------------------
debs=(build-essential cmake ninja-build ccache pkg-config git
      liburing-dev nlohmann-json3-dev libboost-dev libgtest-dev libgmock-dev libgloo-dev
      libpng-dev zlib1g-dev python3 python3-venv libssl-dev curl openssl)
# What only the test suite and the benchmarks use, installed when everything is built (no
# --target): scripts/run-main.sh, which builds `strata` alone, does not wait for them.
test_debs=(fio                                    # the I/O benchmarks' and tests' baseline
           ceph-mon ceph-osd ceph-common radosgw  # the S3 server the tests start
           iproute2)                              # `ip netns`: the two-host test's namespaces
((${#targets[@]})) || debs+=("${test_debs[@]}")
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- Python environment: libtorch (from the torch wheel) and test oracles ---------------------
# The torch version is pinned to the GPU machine's (2.11.0) so one C++ API serves both.
venv=$cache/venv
req=$repo/scripts/requirements.txt
stamp=$venv/.strata-requirements.sha256
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "creating Python environment in $venv (torch wheel is large: first run takes minutes)"
  mkdir -p "$cache"
  # Debian's interpreter, so the venv does not depend on whatever python3 is first on PATH.
  py=/usr/bin/python3; [ -x "$py" ] || py=python3
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  echo "$want" >"$stamp"
fi

((build)) || exit 0

# --- Configure and build ---------------------------------------------------------------------
# The torch wheel is a CUDA 13 build whose CMake package needs the CUDA toolkit to configure
# (every Strata machine has it at /usr/local/cuda; it compiles there even without a GPU).
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  log "error: no CUDA toolkit (nvcc) found on PATH or in /usr/local/cuda; libtorch's CMake needs it"
  exit 1
fi
torch_prefix=$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
# Configure on first use, and again if the Python environment moved (another STRATA_CACHE).
if [ ! -f "$build_dir/build.ninja" ] ||
   ! grep -qF "CMAKE_PREFIX_PATH:UNINITIALIZED=$torch_prefix" "$build_dir/CMakeCache.txt" 2>/dev/null; then
  log "configuring $build_dir"
  cmake -S "$repo" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DSTRATA_PYTHON="$venv/bin/python" >/dev/null
fi
# ccache keys on paths relative to the checkout (and not on the build directory), so that another
# clone of the same sources on this machine, CI's included, reuses what was compiled here.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$repo} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
log "building ${names[*]:-everything} with $jobs jobs"
cmake --build "$build_dir" -j "$jobs" "${targets[@]}"
