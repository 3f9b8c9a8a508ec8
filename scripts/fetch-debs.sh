#!/usr/bin/env bash
# Downloads the Debian packages the offline GPU machine lacks (liburing, nlohmann-json, gloo headers) into
# .deps/debs, to be carried with the device call (carry: [".deps/debs"]).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$repo/.deps/debs"
cd "$repo/.deps/debs"
# apt-get download needs package lists; fetch them once on a machine that never updated.
[ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ] || apt-get update -qq
apt-get download liburing-dev liburing2 nlohmann-json3-dev libgloo-dev >/dev/null
ls -1 "$repo/.deps/debs"
