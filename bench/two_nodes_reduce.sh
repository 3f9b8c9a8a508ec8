#!/usr/bin/env bash
# What a node sends off it a training step, with the CPU reduce-scatter inside each node first
# (comm_nodes.h) beside the flat one (STRATA_FLAT_REDUCE=1), on two "hosts" joined by a veth pair.
#
# Two Linux network namespaces, each running `strata launch` for --per-node ranks (the host
# device, state in host RAM), train the same configuration with each reduction, for --steps and
# for 2 steps: a step's bytes are the difference of host 0's transmitted bytes on its end of the
# link between the two runs, over the steps between them (start-up, rendezvous and the end of the
# run cancel out). Expected from the arithmetic: a reduce-scatter of B bytes sends G(W-G)/W x B
# off a node flat and (N-1)/N x B in two steps (N nodes of G ranks, W = N x G); the all-gathers
# (Gloo's ring) are the same in both.
#
# --rate MBIT limits the link with a token-bucket filter (tc tbf) on both ends, as
# bench/two_hosts_bandwidth.sh does (default: the veth pair as it is, far faster than the CPUs).
#
# Prints a table (reduction, bytes a step off host 0, median s/step; and the losses' largest relative
# difference from the flat run's) and a final JSON line: metric inter_node_bytes_per_step, value
# (two steps), baseline (flat), baseline_value, ratio.
# Needs root (network namespaces); exits 77 where namespaces cannot be made.
#
# Usage: bench/two_nodes_reduce.sh STRATA [WORKDIR] [--per-node G] [--steps N] [--hidden H] [--layers L]
#        [--rate MBIT]
set -uo pipefail
strata=$(realpath "$1")
shift
work=${1:-/tmp/strata-two-nodes-reduce}
[ $# -gt 0 ] && [ "${1#--}" = "$1" ] && shift
per_node=3
steps=6
hidden=256
layers=4
rate=none
while [ $# -gt 0 ]; do
  case $1 in
  --rate) rate=$2; shift 2 ;;
  --per-node) per_node=$2; shift 2 ;;
  --steps) steps=$2; shift 2 ;;
  --hidden) hidden=$2; shift 2 ;;
  --layers) layers=$2; shift 2 ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$steps" -gt 2 ] || { echo "--steps must be more than 2" >&2; exit 2; }
id=$$
ns0=strata-r0-$id ns1=strata-r1-$id
if0=sr0-$id if1=sr1-$id
net=10.216.$((id % 200 + 20))
. "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../scripts/netns-hosts.sh"
netns_hosts "$ns0" "$ns1"
if ! netns_link "$ns0" "$if0" "$net.1" "$ns1" "$if1" "$net.2"; then
  echo "SKIP: cannot join two network namespaces with a veth pair here"
  exit 77
fi

if [ "$rate" != none ]; then
  for ns_if in "$ns0 $if0" "$ns1 $if1"; do
    set -- $ns_if
    ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "${rate}mbit" burst 256kb latency 200ms ||
      { echo "SKIP: tc tbf is not available here"; exit 77; }
  done
fi

rm -rf "$work"
mkdir -p "$work/h0" "$work/h1"
for n in 2 "$steps"; do
  cat >"$work/config-$n.json" <<JSON
{
  "model": {"preset": "gpt2", "layers": $layers, "hidden": $hidden, "heads": 4, "vocab_size": 4096, "max_positions": 64, "seed": 5},
  "data": {"path": "/usr/share/common-licenses", "format": "bytes", "seq_len": 64, "seed": 1},
  "batch": {"micro_batch": 2, "grad_accum": 1},
  "optimizer": {"type": "adamw", "lr": 0.001, "clip_grad_norm": 1.0},
  "placement": {"params": "host", "grads": "host", "master": "host", "moments": "host", "activations": "host"},
  "run": {"steps": $n, "progress": false}
}
JSON
done

port=29700
# run FLAT STEPS: host 0's transmitted bytes for a run of STEPS steps (its log in run-FLAT-STEPS.jsonl).
run() {
  port=$((port + 1))
  local tag="$1-$2" r ns pids=() ok=1
  local tx0
  tx0=$(ip netns exec "$ns0" cat "/sys/class/net/$if0/statistics/tx_bytes")
  for r in 0 1; do
    ns=$ns0
    [ "$r" = 1 ] && ns=$ns1
    (cd "$work/h$r" && exec env STRATA_FLAT_REDUCE="$1" ip netns exec "$ns" "$strata" launch --nnodes 2 --node-rank "$r" \
       --master-addr "$net.1" --master-port "$port" --nproc-per-node "$per_node" -- "$strata" train \
       --config "../config-$2.json" --log "../run-$tag.jsonl") >"$work/run-$tag-h$r.out" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  [ $ok = 1 ] || { echo "FAIL: the run $tag" >&2; cat "$work/run-$tag-h0.out" "$work/run-$tag-h1.out" >&2; exit 1; }
  echo $(( $(ip netns exec "$ns0" cat "/sys/class/net/$if0/statistics/tx_bytes") - tx0 ))
}
declare -A sent
for flat in 1 0; do
  for n in 2 "$steps"; do
    echo "two nodes x $per_node ranks: STRATA_FLAT_REDUCE=$flat, $n steps" >&2
    sent[$flat-$n]=$(run "$flat" "$n") || exit 1
  done
done
python3 - "$work" "$steps" "$per_node" "$rate" "${sent[1-2]}" "${sent[1-$steps]}" "${sent[0-2]}" "${sent[0-$steps]}" <<'PY'
import json, sys
work, steps, per_node, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
flat2, flatn, two2, twon = (int(v) for v in sys.argv[5:9])
def log(tag):
    return [json.loads(l) for l in open(f"{work}/run-{tag}.jsonl") if '"step"' in l and '"loss"' in l]
def median_seconds(rows):
    s = sorted(r["seconds"] for r in rows[1:])
    return s[len(s) // 2]
flat, two = log(f"1-{steps}"), log(f"0-{steps}")
flat_bytes, two_bytes = (flatn - flat2) / (steps - 2), (twon - two2) / (steps - 2)
worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(two, flat))
print(f"2 nodes x {per_node} ranks, {steps} steps, link {rate if rate == 'none' else rate + ' Mbit/s'} (host 0's end; a step = (run of {steps} - run of 2) / {steps - 2})")
print(f"{'reduction':<28}{'bytes a step off host 0':>26}{'s/step':>10}")
print(f"{'flat (STRATA_FLAT_REDUCE=1)':<28}{flat_bytes:>26,.0f}{median_seconds(flat):>10.3f}")
print(f"{'inside each node first':<28}{two_bytes:>26,.0f}{median_seconds(two):>10.3f}")
print(f"losses: largest relative difference {worst:.2e}")
print(json.dumps({"metric": "inter_node_bytes_per_step", "value": two_bytes,
                  "baseline": "flat reduce-scatter (STRATA_FLAT_REDUCE=1)", "baseline_value": flat_bytes,
                  "ratio": two_bytes / flat_bytes, "per_node": per_node, "nodes": 2, "steps": steps, "rate_mbit": rate,
                  "seconds_per_step": median_seconds(two), "baseline_seconds_per_step": median_seconds(flat),
                  "loss_max_rel_diff": worst}))
PY
