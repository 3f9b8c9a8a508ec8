#!/usr/bin/env bash
# Two strata binaries side by side on this machine: a refactor must not slow the step. Runs, old
# and new alternating, N times each (default 5):
#   strata bench step --steps 9 --placement host   (the engine's step against plain libtorch)
#   bench/nvme_1b.sh --steps 2                      (1.3B, all state in swap; skipped with --no-nvme)
#   strata plan --model gpt-1t --cluster dgx-a100 --nodes 16,32,64 --max-model
#                                                   (the planner's search; skipped with --no-plan)
# and prints each run's figures, then one JSON line per benchmark: the new binary's median
# against the old one's (the baseline), their ratio, and whether the 1.3B losses are bitwise equal
# and its swap traffic (bytes read and written each step) the same, and the plans the same.
#   bench/ab_binaries.sh OLD_BIN NEW_BIN [--runs N] [--no-nvme] [--no-plan]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
old=$1 new=$2
shift 2
runs=5 nvme=1 plan=1
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --no-nvme) nvme=0; shift ;;
    --no-plan) plan=0; shift ;;
    *) echo "ab_binaries: unknown option $1" >&2; exit 2 ;;
  esac
done
for b in "$old" "$new"; do [ -x "$b" ] || { echo "ab_binaries: $b is not an executable" >&2; exit 2; }; done
out=build/ab
mkdir -p "$out"
rm -f "$out"/*.json

for ((i = 1; i <= runs; i++)); do
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    "$bin" bench step --steps 9 --placement host 2>/dev/null | tail -1 > "$out/step-$side-$i.json"
    echo "bench step run $i $side: $(cat "$out/step-$side-$i.json")"
  done
done
if ((nvme)); then
  for ((i = 1; i <= runs; i++)); do
    # Alternate which goes first, so the disk's drift within a pair does not favour one side.
    order="old new"; ((i % 2 == 0)) && order="new old"
    for side in $order; do
      bin=$old; [ $side = new ] && bin=$new
      STRATA_BIN=$bin bench/nvme_1b.sh --steps 2 > "$out/nvme-$side-$i.txt"
      cp build/nvme-1b.jsonl "$out/nvme-$side-$i.jsonl"
      tail -1 "$out/nvme-$side-$i.txt" > "$out/nvme-$side-$i.json"
      echo "nvme_1b run $i $side: $(grep '^step' "$out/nvme-$side-$i.txt" | tr '\n' ' ')"
    done
  done
fi

if ((plan)); then
  for ((i = 1; i <= runs; i++)); do
    for side in old new; do
      bin=$old; [ $side = new ] && bin=$new
      t0=$(date +%s.%N)
      "$bin" plan --model gpt-1t --cluster dgx-a100 --nodes 16,32,64 --max-model > "$out/plan-$side-$i.txt" 2>&1
      python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$t0" "$(date +%s.%N)" > "$out/plan-$side-$i.s"
      echo "plan --max-model run $i $side: $(cat "$out/plan-$side-$i.s") s"
    done
  done
fi

python3 - "$out" "$runs" "$nvme" "$plan" <<'PY'
import json, statistics, sys, glob
out, runs, nvme, plan = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
def load(pattern):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{pattern}"))]
old, new = load("step-old-*.json"), load("step-new-*.json")
mo, mn = statistics.median(r["value"] for r in old), statistics.median(r["value"] for r in new)
print(json.dumps({"metric": "bench_step_engine_seconds_median", "value": mn, "baseline": "the old binary",
                  "baseline_value": mo, "ratio": mn / mo, "runs": runs,
                  "old": [r["value"] for r in old], "new": [r["value"] for r in new],
                  "ratio_to_plain_old": [r["ratio"] for r in old], "ratio_to_plain_new": [r["ratio"] for r in new]}))
if nvme:
    def steps(side):
        res = []
        for f in sorted(glob.glob(f"{out}/nvme-{side}-*.jsonl")):
            lines = [json.loads(l) for l in open(f)]
            res.append([l for l in lines if "event" not in l])
        return res
    so, sn = steps("old"), steps("new")
    total = lambda r: sum(s["seconds"] for s in r)
    losses = lambda r: [s["loss"] for s in r]
    swap = lambda r: [(s["timeline"]["nvme_read_bytes"], s["timeline"]["nvme_write_bytes"]) for s in r]
    to, tn = statistics.median(total(r) for r in so), statistics.median(total(r) for r in sn)
    jo, jn = load("nvme-old-*.json"), load("nvme-new-*.json")
    print(json.dumps({"metric": "nvme_1b_two_step_seconds_median", "value": tn, "baseline": "the old binary",
                      "baseline_value": to, "ratio": tn / to, "runs": runs,
                      "old": [total(r) for r in so], "new": [total(r) for r in sn],
                      "losses_bitwise_equal": all(losses(r) == losses(so[0]) for r in so + sn),
                      "losses": losses(sn[0]),
                      "swap_bytes_equal": all(swap(r) == swap(so[0]) for r in so + sn),
                      "swap_read_write_bytes": swap(sn[0]),
                      "peak_rss_old": [j["value"] for j in jo], "peak_rss_new": [j["value"] for j in jn]}))
if plan:
    def seconds(side):
        return [float(open(f).read()) for f in sorted(glob.glob(f"{out}/plan-{side}-*.s"))]
    texts = [open(f).read() for f in sorted(glob.glob(f"{out}/plan-*-*.txt"))]
    po, pn = statistics.median(seconds("old")), statistics.median(seconds("new"))
    print(json.dumps({"metric": "plan_max_model_search_seconds_median", "value": pn, "baseline": "the old binary",
                      "baseline_value": po, "ratio": pn / po, "runs": runs, "old": seconds("old"),
                      "new": seconds("new"), "plans_equal": all(t == texts[0] for t in texts)}))
PY
