#!/usr/bin/env bash
# Two hosts over a link of chosen bandwidth, beside the planner's prediction for that network.
#
# Two Linux network namespaces joined by a veth pair, each running `strata launch` for one rank
# (the host device, state in host RAM). A token-bucket filter (tc tbf) on both ends of the pair
# limits the link to each rate in turn ("none": the veth pair as it is); every rate trains the
# same configuration for --steps steps. The prediction is `strata plan --as-given` of that
# configuration on a cluster of 2 nodes of this machine (calibrated in the same run with `strata
# plan --calibrate`), its inter-node bandwidth set to the rate ("none": the calibrated collectives'
# rate), each node given half of this machine's calibrated rates (both "hosts" share its cores).
# This kernel has no netem, so latency is the veth pair's own (tens of microseconds).
#
# Prints a table (rate, measured s/step as the median after the first two steps, planned,
# error, the bytes a step the engine counts its collectives sending beside what host 0's end of
# the link really sent, and the backward's wait on reduce-scatters) and a final JSON line: metric two_hosts_step_time_worst_error, value (worst |error|
# over the rates), baseline (the measured runs), baseline_value (their mean s/step), ratio.
# Needs root (network namespaces, tc); exits 77 where namespaces cannot be made.
# STRATA_TBF_BURST (default 256kb) and STRATA_TBF_LATENCY (default 200ms: how long the filter may
# queue, not a delay it adds) tune the token bucket.
#
# Usage: bench/two_hosts_bandwidth.sh STRATA [WORKDIR] [--rates "none 1000 300 100"] [--steps N]
#        [--hidden H] [--layers L]   (rates in Mbit/s)
set -uo pipefail
strata=$(realpath "$1")
shift
work=${1:-/tmp/strata-two-hosts-bench}
[ $# -gt 0 ] && [ "${1#--}" = "$1" ] && shift
rates="none 1000 300 100"
steps=8
hidden=256
layers=4
while [ $# -gt 0 ]; do
  case $1 in
  --rates) rates=$2; shift 2 ;;
  --steps) steps=$2; shift 2 ;;
  --hidden) hidden=$2; shift 2 ;;
  --layers) layers=$2; shift 2 ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
id=$$
ns0=strata-b0-$id ns1=strata-b1-$id
if0=sb0-$id if1=sb1-$id
net=10.215.$((id % 200 + 20))
. "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../scripts/netns-hosts.sh"
netns_hosts "$ns0" "$ns1"
if ! netns_link "$ns0" "$if0" "$net.1" "$ns1" "$if1" "$net.2"; then
  echo "SKIP: cannot join two network namespaces with a veth pair here"
  exit 77
fi

rm -rf "$work"
mkdir -p "$work/h0" "$work/h1"
cat >"$work/config.json" <<JSON
{
  "model": {"preset": "gpt2", "layers": $layers, "hidden": $hidden, "heads": 4, "vocab_size": 4096, "max_positions": 64, "seed": 5},
  "data": {"path": "/usr/share/common-licenses", "format": "bytes", "seq_len": 64, "seed": 1},
  "batch": {"micro_batch": 4, "grad_accum": 1},
  "optimizer": {"type": "adamw", "lr": 0.001, "clip_grad_norm": 1.0},
  "placement": {"params": "host", "grads": "host", "master": "host", "moments": "host", "activations": "host"},
  "run": {"steps": $steps, "progress": false}
}
JSON
echo "two hosts: calibrating this machine (strata plan --calibrate)" >&2
"$strata" plan --calibrate --dir "$work" --output "$work/cluster.json" >"$work/calibrate.out" 2>&1 ||
  { cat "$work/calibrate.out"; exit 1; }

port=29600
rows=()
for rate in $rates; do
  for ns_if in "$ns0 $if0" "$ns1 $if1"; do
    set -- $ns_if
    ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null
    if [ "$rate" != none ]; then
      ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "${rate}mbit" burst "${STRATA_TBF_BURST:-256kb}" latency "${STRATA_TBF_LATENCY:-200ms}" ||
        { echo "SKIP: tc tbf is not available here"; exit 77; }
    fi
  done
  port=$((port + 1))
  rm -f "$work/run.jsonl"
  # What host 0 really sent over the link (every byte on the wire, start-up included).
  tx0=$(ip netns exec "$ns0" cat "/sys/class/net/$if0/statistics/tx_bytes")
  pids=()
  for r in 0 1; do
    ns=$ns0
    [ "$r" = 1 ] && ns=$ns1
    (cd "$work/h$r" && exec ip netns exec "$ns" "$strata" launch --nnodes 2 --node-rank "$r" \
       --master-addr "$net.1" --master-port "$port" --nproc-per-node 1 -- "$strata" train --config ../config.json \
       --log ../run.jsonl) >"$work/run-$rate-h$r.out" 2>&1 &
    pids+=($!)
  done
  ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  [ $ok = 1 ] || { echo "FAIL: the run at rate $rate"; cat "$work/run-$rate-h0.out" "$work/run-$rate-h1.out"; exit 1; }
  tx=$(( $(ip netns exec "$ns0" cat "/sys/class/net/$if0/statistics/tx_bytes") - tx0 ))
  # The prediction: two nodes of this machine, one rank each, the link at the rate.
  python3 - "$work/cluster.json" "$work/cluster-$rate.json" "$rate" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["nodes"] = 2
c["node"]["gpus"] = 1
# Both "hosts" are this one machine: each node of the plan gets half of its cores and memory
# bandwidth (compute, copies, the CPU optimizer). The collectives' rate was measured between two
# ranks of this machine already, and the disk is not used.
g = c["node"]["gpu"]
for k in ("peak_tflops", "peak_tflops_fp32", "memory_gbps"):
    if k in g: g[k] /= 2
for k in ("pcie_h2d_gbps", "pcie_d2h_gbps", "cpu_adam_gparams"):
    c["node"][k] /= 2
rate = sys.argv[3]
c["node"]["inter_gbps"] = c["node"]["intra_gbps"] if rate == "none" else float(rate) / 8 / 1000
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
  "$strata" plan --config "$work/config.json" --as-given --cluster "$work/cluster-$rate.json" >"$work/plan-$rate.out" 2>&1 ||
    { cat "$work/plan-$rate.out"; exit 1; }
  rows+=("$(python3 - "$work/run.jsonl" "$work/plan-$rate.out" "$rate" "$tx" <<'PY'
import json, re, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and '"loss"' in l]
measured = sorted(s["seconds"] for s in steps[2:])[len(steps[2:]) // 2]
planned = float(re.search(r"step ([0-9.e+-]+) s", open(sys.argv[2]).read()).group(1))
# Bytes a step: what the engine counts its collectives sending, and what the link carried.
counted = sum(s["timeline"]["network_bytes"] for s in steps) / len(steps)
wire = int(sys.argv[4]) / len(steps)
waits = sorted(s["timeline"]["wait_grads"] for s in steps[2:])[len(steps[2:]) // 2]
print(json.dumps({"rate_mbit": sys.argv[3], "measured_s": measured, "planned_s": planned,
                  "error": planned / measured - 1, "counted_bytes_per_step": counted,
                  "wire_bytes_per_step": wire, "wait_grads_s": waits}))
PY
)")
  echo "two hosts: rate ${rate} Mbit/s done" >&2
done
printf '%s\n' "${rows[@]}" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
print("| link (Mbit/s) | measured s/step | planned | error | MB a step: counted / on the wire | backward waiting on reduce-scatters (s) |")
print("|---|---|---|---|---|---|")
for r in rows:
    print("| %s | %.3f | %.3f | %+.1f%% | %.1f / %.1f | %.3f |" % (r["rate_mbit"], r["measured_s"], r["planned_s"], 100 * r["error"],
          r["counted_bytes_per_step"] / 1e6, r["wire_bytes_per_step"] / 1e6, r["wait_grads_s"]))
worst = max(abs(r["error"]) for r in rows)
mean_s = sum(r["measured_s"] for r in rows) / len(rows)
print(json.dumps({"metric": "two_hosts_step_time_worst_error", "value": worst,
                  "baseline": "measured strata train runs, 2 hosts x 1 rank over the limited veth link (mean s/step)",
                  "baseline_value": mean_s, "ratio": worst, "mean_error": sum(abs(r["error"]) for r in rows) / len(rows),
                  "cases": rows}))
'
