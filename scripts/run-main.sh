#!/usr/bin/env bash
# Installs what is missing, builds the `strata` program (not the tests), and runs Strata's main job: the README's fine-tuning quick
# start without the interruption. A tiny Llama made by transformers stands in for a downloaded
# model (scripts/make-tiny-model.py); its chats (configs/finetune-chats) become supervised
# examples with the loss on the answers (`strata data prepare --chat`); `strata train` on
# configs/finetune.json fine-tunes it with the fp32 master weights and Adam moments in NVMe swap
# files, evaluates held-out examples, checkpoints, and exports the result with its tokenizer to
# build/quickstart/tiny-llama-ft. Starts afresh in build/quickstart each time. Extra arguments go
# to `strata train`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${STRATA_BUILD_DIR:-$repo/build}
"$repo/scripts/setup.sh" --target strata  # the program alone; scripts/test.sh builds the rest
cd "$repo"
py=${STRATA_CACHE:-$HOME/.cache/strata}/venv/bin/python
rm -rf build/quickstart && mkdir -p build/quickstart/swap
"$py" scripts/make-tiny-model.py build/quickstart/tiny-llama
"$build_dir/strata" data prepare --chat --tokenizer build/quickstart/tiny-llama \
  --output build/quickstart/chats.sft configs/finetune-chats
exec "$build_dir/strata" train --config configs/finetune.json "$@"
