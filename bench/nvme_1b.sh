#!/usr/bin/env bash
# Issue #6 on the development machine: a 1.3B-parameter GPT (GPT-3 XL shape) trains with every
# state kind in NVMe swap (bench/configs/cpu-nvme-1b.json) in a process whose resident memory
# stays under 4 GB. Prints each step's loss, time and peak RSS, and a final JSON line: the peak
# RSS beside the bytes of state the run keeps in swap (what an all-in-RAM run would hold at
# least). Needs ~26 GB free under build/ and a few minutes a step on 2 cores.
#   bench/nvme_1b.sh [--steps N] [--profile FILE]   (options go to strata train)
# STRATA_CONFIG=bench/configs/cpu-nvme-1b-backward.json runs the same model without clipping,
# updated during the backward with no gradients stored (optimizer.overlap "backward").
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bin=${STRATA_BIN:-build/strata}
mkdir -p build/strata-swap-1b
log=build/nvme-1b.jsonl
timer=()
[ -x /usr/bin/time ] && timer=(/usr/bin/time -v)  # Debian package "time"; else the log's VmHWM
config=${STRATA_CONFIG:-bench/configs/cpu-nvme-1b.json}
"${timer[@]}" "$bin" train --config "$config" --log "$log" "$@" 2> build/nvme-1b.err || {
  cat build/nvme-1b.err >&2
  exit 1
}
grep -v "^\s" build/nvme-1b.err | grep -v "Command being timed" || true
python3 - "$log" build/nvme-1b.err <<'PY'
import json, re, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
start, steps = lines[0], [l for l in lines if "event" not in l]
for s in steps:
    print(f"step {s['step']}: loss {s['loss']:.4f}, {s['seconds']:.1f} s, peak RSS {s['peak_rss'] / 2**30:.2f} GiB, "
          f"NVMe state {s['nvme_state'] / 2**30:.1f} GiB, swap read {s['timeline']['nvme_read_bytes'] / 1e9:.1f} GB, "
          f"written {s['timeline']['nvme_write_bytes'] / 1e9:.1f} GB")
m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(sys.argv[2]).read())
rss_kb = int(m.group(1)) if m else max(s["peak_rss"] for s in steps) // 1024
state = steps[-1]["nvme_state"]
print(json.dumps({"metric": "peak_rss_bytes", "value": rss_kb * 1024,
                  "baseline": "state bytes kept in NVMe swap", "baseline_value": state,
                  "ratio": rss_kb * 1024 / state, "parameters": start["parameters"],
                  "steps": len(steps), "seconds_per_step": steps[-1]["seconds"],
                  "nvme_read_bytes_per_step": steps[-1]["timeline"]["nvme_read_bytes"],
                  "nvme_write_bytes_per_step": steps[-1]["timeline"]["nvme_write_bytes"],
                  "losses": [s["loss"] for s in steps]}))
PY
