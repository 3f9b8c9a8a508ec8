#!/usr/bin/env bash
# Downloads the Debian packages the offline GPU machine lacks (liburing, nlohmann-json, gloo headers, libpng) into
# .deps/debs, to be carried with the device call (carry: [".deps/debs"]), and builds a static fio
# into .deps/bin/fio (carry: [".deps/bin"]).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$repo/.deps/debs"
cd "$repo/.deps/debs"
# apt-get download needs package lists; fetch them once on a machine that never updated.
[ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ] || apt-get update -qq
# libpng for `strata plot` (cli/plot.cc); zlib1g-dev for its headers.
# libssl-dev (SigV4 and TLS) and the Boost headers (the S3 driver), new with object storage.
apt-get download liburing-dev liburing2 nlohmann-json3-dev libgloo-dev libpng-dev libpng16-16 zlib1g-dev \
  libssl-dev libssl3 libboost1.74-dev libboost-dev >/dev/null
ls -1 "$repo/.deps/debs"

# The GPU machine has no fio either, and the benchmarks compare against it. Build a static fio
# (only glibc, linked in) from Debian's source package into .deps/bin/fio, carried with .deps.
# Skipped when already built: the build takes a minute and needs apt source access.
fio_bin="$repo/.deps/bin/fio"
if [ ! -x "$fio_bin" ]; then
  # apt-get source needs a deb-src entry; mirror the binary entry (same mirror, suites, key).
  src_list=/etc/apt/sources.list.d/debian-src.sources
  if [ ! -e "$src_list" ]; then
    cat >"$src_list" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  # The Sources index only arrives with an update after the deb-src entry exists.
  ls /var/lib/apt/lists/*_source_Sources* >/dev/null 2>&1 || apt-get update -qq
  # Build outside the repo so the source tree never lands in the working tree.
  work=$(mktemp -d /tmp/fio-build.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  (
    cd "$work"
    # Download as root: the unprivileged _apt sandbox user cannot write here and apt would warn.
    apt-get source -qq -o APT::Sandbox::User=root fio >/dev/null
    cd fio-*/
    # --build-static: no shared libraries needed on the target. --disable-native: no -march=native,
    # the binary must run on another CPU. The other --disable-* drop optional engines whose libraries
    # (and their static archives) we neither need nor have; io_uring and psync are built in.
    ./configure --disable-native --build-static --disable-numa --disable-rdma --disable-rados \
      --disable-rbd --disable-http --disable-gfapi --disable-pmem --disable-libnfs --disable-xnvme \
      --disable-libzbc --disable-tcmalloc --disable-dfs >/dev/null
    # At most two jobs: the build machine is small and usually shares its cores with another build.
    make -j2 fio >/dev/null
    mkdir -p "$(dirname "$fio_bin")"
    # Debug info is not needed and more than doubles the size carried to the device.
    strip -o "$fio_bin" fio
  )
  rm -rf "$work"
  trap - EXIT
fi
"$fio_bin" --version
