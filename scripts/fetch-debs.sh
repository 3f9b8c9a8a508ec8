#!/usr/bin/env bash
# Downloads the Debian packages the offline GPU machine lacks (liburing, nlohmann-json) into
# .deps/debs, to be carried with the device call (carry: [".deps/debs"]).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$repo/.deps/debs"
cd "$repo/.deps/debs"
apt-get download liburing-dev liburing2 nlohmann-json3-dev >/dev/null
ls -1 "$repo/.deps/debs"
