#!/usr/bin/env bash
# Host memory of a LoRA run that starts from a Hugging Face base (#45: the base streamed in as the
# engine places each unit, never whole in fp32), beside the same run from a random initialization
# (no file to load: the baseline). transformers saves a random Llama of 426M parameters
# (32 x 1024, GQA 16/4, MLP 2816, vocabulary 32000, untied) in bf16 (853 MB; 1.71 GB in fp32);
# each run trains LoRA r 8 on every linear for one step of 1 x 32 tokens, bf16 compute, the
# frozen base's compute copies in NVMe swap, a 256 MiB device budget on the host device.
# /proc/PID/status is sampled every 0.5 s: peak VmRSS, RssAnon (the process's own memory) and
# RssFile (mapped files: the base's safetensors, reclaimable). Each pair runs twice: as is, and
# with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_=131072), which shows how much of the
# anonymous peak is freed memory glibc's heap keeps. Final JSON line: the streamed load's peak
# anonymous memory against the random initialization's.
#   bench/lora_load_rss.sh   (needs the Python environment scripts/setup.sh makes; ~3 min)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bin=${STRATA_BIN:-build/strata}
py=${STRATA_PYTHON:-${STRATA_CACHE:-$HOME/.cache/strata}/venv/bin/python}
work=build/lora-load-rss
mkdir -p "$work/swap"
if [ ! -f "$work/model/model.safetensors" ]; then
  "$py" - "$work/model" <<'PY' 2>/dev/null
import sys, torch, transformers as tf
torch.manual_seed(0)
c = tf.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=32,
                   num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
                   max_position_embeddings=256)
tf.LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained(sys.argv[1], safe_serialization=True, max_shard_size="10GB")
PY
fi
lora='{"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}'
common='"data": {"path": "/usr/share/common-licenses", "format": "bytes", "seq_len": 32, "seed": 0},
  "batch": {"micro_batch": 1, "grad_accum": 1}, "optimizer": {"type": "adamw", "lr": 0.001},
  "precision": {"compute": "bf16"}, "placement": {"params": "nvme", "grads": "host", "master": "host", "moments": "host"},
  "offload": {"nvme_dirs": ["'$work'/swap"]}, "device": {"type": "cpu", "budget": "256MiB"}'
cat > "$work/loaded.json" <<EOF
{"model": {"init_from": "$work/model", "lora": $lora}, $common,
 "run": {"steps": 1, "progress": false, "log": "$work/loaded.jsonl"}}
EOF
cat > "$work/random.json" <<EOF
{"model": {"preset": "llama-1b", "layers": 32, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2816,
           "vocab_size": 32000, "tie_embeddings": false, "lora": $lora}, $common,
 "run": {"steps": 1, "progress": false, "log": "$work/random.jsonl"}}
EOF

# Runs one config; prints "VmRSS RssAnon RssFile" peaks in KiB.
peaks() {
  rm -rf "$work/swap"/* "$work"/*.jsonl
  "$bin" train --config "$1" > "$work/out.txt" 2>&1 &
  local pid=$! r a f mr=0 ma=0 mf=0
  while kill -0 $pid 2>/dev/null; do
    read -r r a f < <(awk '/VmRSS/{r=$2}/RssAnon/{a=$2}/RssFile/{f=$2}END{print r+0,a+0,f+0}' /proc/$pid/status 2>/dev/null || echo 0 0 0)
    ((r > mr)) && mr=$r; ((a > ma)) && ma=$a; ((f > mf)) && mf=$f
    sleep 0.5
  done
  wait $pid || { cat "$work/out.txt" >&2; exit 1; }
  echo "$mr $ma $mf"
}
read -r lr la lf < <(peaks "$work/loaded.json")
read -r rr ra rf < <(peaks "$work/random.json")
read -r tlr tla tlf < <(MALLOC_MMAP_THRESHOLD_=131072 peaks "$work/loaded.json")
read -r trr tra trf < <(MALLOC_MMAP_THRESHOLD_=131072 peaks "$work/random.json")
mib() { awk -v k="$1" 'BEGIN{printf "%.1f", k/1024}'; }
echo "init_from (streamed):  peak VmRSS $(mib $lr) MiB, anonymous $(mib $la) MiB, files $(mib $lf) MiB"
echo "random init:           peak VmRSS $(mib $rr) MiB, anonymous $(mib $ra) MiB, files $(mib $rf) MiB"
echo "fixed mmap threshold:  init_from anonymous $(mib $tla) MiB (files $(mib $tlf)), random anonymous $(mib $tra) MiB"
echo "the base in fp32: $(awk 'BEGIN{printf "%.1f", 426312704*4/1048576}') MiB"
echo "{\"metric\":\"init_from_peak_anon_mib\",\"value\":$(mib $la),\"baseline\":\"random_init_peak_anon_mib\",\"baseline_value\":$(mib $ra),\"ratio\":$(awk -v a="$la" -v b="$ra" 'BEGIN{printf "%.3f", a/b}'),\"fixed_threshold_value\":$(mib $tla),\"fixed_threshold_baseline_value\":$(mib $tra)}"
