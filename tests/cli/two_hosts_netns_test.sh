#!/usr/bin/env bash
# Two (then three) "hosts" as Linux network namespaces joined by veth pairs, each running `strata
# launch` for 2 ranks (--nnodes N --node-rank R --master-addr <host 0's address>), each host with
# its own swap directory holding the optimizer state: the 4 ranks must find each other over the
# veth link and train to exactly the losses of the same 4 ranks on one host over loopback. Then
# checkpoints on node-local disks: 2 hosts save, each into its own directory; 3 hosts resume from
# them (the third host's ranks get their slices over the network) to the losses of the same
# resume on one host; with host 1's directory gone the resume fails on every host naming the
# files missing and where each node looked. Then host 1
# is lost twice: its processes killed (host 0 must fail within a second or so, naming host 1's
# address and ranks), and its link cut (both sides must fail at the collective timeout, each naming
# the host that does not answer). Host 2 is joined to host 0 by a second veth pair on its own
# subnet; host 0 forwards between hosts 1 and 2. Addresses exist only inside the namespaces this
# test creates, and all are removed at the end.
# Usage: two_hosts_netns_test.sh STRATA WORKDIR.  Exit 77 (skipped) where namespaces cannot be made.
set -uo pipefail
strata=$1
work=$2
id=$$
ns0=strata-h0-$id ns1=strata-h1-$id ns2=strata-h2-$id
if0=sv0-$id if1=sv1-$id if02=sw0-$id if2=sw2-$id
net=10.213.$((id % 200 + 20))
net2=10.214.$((id % 200 + 20))
. "$(dirname "${BASH_SOURCE[0]}")/../../scripts/netns-hosts.sh"
netns_hosts "$ns0" "$ns1" "$ns2"
setup() {
  netns_link "$ns0" "$if0" "$net.1" "$ns1" "$if1" "$net.2" &&
    netns_link "$ns0" "$if02" "$net2.1" "$ns2" "$if2" "$net2.2" &&
    ip netns exec "$ns0" sysctl -qw net.ipv4.ip_forward=1 &&
    ip -n "$ns1" route add default via "$net.1" && ip -n "$ns2" route add default via "$net2.1"
}
if ! setup; then
  echo "SKIP: cannot join three network namespaces with veth pairs here"
  exit 77
fi
set -e

rm -rf "$work"
mkdir -p "$work/h0" "$work/h1" "$work/h2" "$work/one"
cat >"$work/config.json" <<'JSON'
{
  "model": {"preset": "gpt2", "layers": 2, "hidden": 64, "heads": 4, "vocab_size": 256, "max_positions": 64, "seed": 5},
  "data": {"path": "/usr/share/common-licenses", "format": "bytes", "seq_len": 32, "seed": 1},
  "batch": {"micro_batch": 2, "grad_accum": 2},
  "optimizer": {"type": "adamw", "lr": 0.003, "weight_decay": 0.05, "clip_grad_norm": 1.0},
  "placement": {"params": "host", "grads": "host", "master": "nvme", "moments": "nvme", "activations": "host"},
  "offload": {"nvme_dirs": ["swap"], "optimizer_chunk": "16KiB"},
  "run": {"steps": 4, "progress": false}
}
JSON
set +e
for r in 0 1; do
  ns=$ns0
  [ "$r" = 1 ] && ns=$ns1
  mkdir -p "$work/h$r/swap"
  (cd "$work/h$r" && exec ip netns exec "$ns" "$strata" launch --nnodes 2 --node-rank "$r" --master-addr "$net.1" \
     --master-port 29517 --nproc-per-node 2 -- "$strata" train --config ../config.json --log ../h.jsonl) \
    >"$work/h$r.out" 2>&1 &
  eval "pid$r=\$!"
done
wait "$pid0"; rc0=$?
wait "$pid1"; rc1=$?
if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
  echo "FAIL: host 0 exited $rc0, host 1 exited $rc1"; cat "$work/h0.out" "$work/h1.out"; exit 1
fi
grep -q "node 0 of 2, ranks 0-1 of 4, master $net.1:29517, interface $if0" "$work/h0.out" ||
  { echo "FAIL: host 0 did not report its interface"; cat "$work/h0.out"; exit 1; }
grep -q "node 1 of 2, ranks 2-3 of 4, master $net.1:29517, interface $if1" "$work/h1.out" ||
  { echo "FAIL: host 1 did not report its interface"; cat "$work/h1.out"; exit 1; }
mkdir -p "$work/one/swap"
(cd "$work/one" && "$strata" launch -n 4 -- "$strata" train --config ../config.json --log ../one.jsonl) \
  >"$work/one.out" 2>&1 || { echo "FAIL: the one-host run"; cat "$work/one.out"; exit 1; }
# And one process: the same global batch of 16 as micro_batch 2 x grad_accum 8.
mkdir -p "$work/single/swap"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["batch"]["grad_accum"] = 8; json.dump(c, open(sys.argv[2], "w"))' \
  "$work/config.json" "$work/single.json"
(cd "$work/single" && "$strata" train --config ../single.json --log ../single.jsonl) \
  >"$work/single.out" 2>&1 || { echo "FAIL: the one-process run"; cat "$work/single.out"; exit 1; }
python3 - "$work/h.jsonl" "$work/one.jsonl" "$work/single.jsonl" <<'PY'
import json, sys
def losses(path):
    return [json.loads(l)["loss"] for l in open(path) if '"loss"' in l and '"step"' in l]
two, one, single = losses(sys.argv[1]), losses(sys.argv[2]), losses(sys.argv[3])
print("two hosts:  ", two)
print("one host:   ", one)
print("one process:", single)
assert len(two) == 4 and len(one) == 4 and len(single) == 4, "expected 4 steps each"
for a, b in zip(two, one):
    assert abs(a - b) <= 1e-5 * abs(b), f"{a} != {b}"
for a, b in zip(two, single):  # the gradient sums in another order
    assert abs(a - b) <= 1e-5 * abs(b), f"{a} != {b} (one process)"
print("PASS: 2 hosts x 2 ranks over the veth link train as 4 ranks on one host and as one process")
# Each node's traffic per step: its ranks read their own shards of master and moments from its
# own swap directory (equal shares), and send their collectives' share over the link.
for l in open(sys.argv[1]):
    j = json.loads(l)
    if "timeline" not in j: continue
    nodes = j["timeline"]["nodes"]
    assert len(nodes) == 2, f"step {j['step']}: {nodes}"
    r0, r1 = nodes[0]["nvme_read_bytes"], nodes[1]["nvme_read_bytes"]
    # A step's update is joined in the next one (its reads count there): none in step 1.
    if j["step"] > 1:
        assert r0 > 0 and r1 > 0 and abs(r0 - r1) <= 0.05 * max(r0, r1), f"step {j['step']}: NVMe reads {r0} vs {r1}"
    n0, n1 = nodes[0]["network_bytes"], nodes[1]["network_bytes"]
    assert n0 > 0 and abs(n0 - n1) <= 0.05 * max(n0, n1), f"step {j['step']}: network {n0} vs {n1}"
print("PASS: the log shows each node's NVMe and network traffic per step (node 0: NVMe read %d B, network %d B)" % (r0, n0))
PY
[ $? = 0 ] || exit 1

# Checkpoints on node-local disks: `ckpt` and `swap` resolve in each host's own directory. 4 ranks
# (micro_batch 1 x grad_accum 6) save after step 4; 6 ranks resume (grad_accum 4 keeps the global
# batch of 24) and train to step 8. The oracle: the same save and resume on one host.
python3 - "$work/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["batch"] = {"micro_batch": 1, "grad_accum": 6}
c["run"].update(steps=4, checkpoint_dir="ckpt")
json.dump(c, open(sys.argv[1].replace("config.json", "save.json"), "w"))
c["run"].update(steps=8, resume=True)
json.dump(c, open(sys.argv[1].replace("config.json", "resume.json"), "w"))
PY
on_hosts() {  # $1: hosts, $2: port, $3: config, $4: log, $5: output prefix
  local r ns pids=()
  for r in $(seq 0 $(($1 - 1))); do
    ns=$ns0
    [ "$r" = 1 ] && ns=$ns1
    [ "$r" = 2 ] && ns=$ns2
    mkdir -p "$work/h$r/swap"
    (cd "$work/h$r" && exec ip netns exec "$ns" "$strata" launch --nnodes "$1" --node-rank "$r" --master-addr "$net.1" \
       --master-port "$2" --nproc-per-node 2 -- "$strata" train --config "../$3" --log "../$4") >"$work/$5-h$r.out" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for r in "${pids[@]}"; do wait "$r" || rc=1; done
  return $rc
}
on_hosts 2 29519 save.json save.jsonl save ||
  { echo "FAIL: the 2-host save"; cat "$work/save-h0.out" "$work/save-h1.out"; exit 1; }
[ -f "$work/h0/ckpt/step-00000004/manifest.json" ] && [ -f "$work/h1/ckpt/step-00000004/rank-00002.data" ] &&
  [ ! -e "$work/h1/ckpt/step-00000004/manifest.json" ] && [ ! -e "$work/h0/ckpt/step-00000004/rank-00002.data" ] ||
  { echo "FAIL: each host's directory should hold its own ranks' files, the manifest host 0's"; ls -R "$work/h0/ckpt" "$work/h1/ckpt"; exit 1; }
mv "$work/h1/ckpt" "$work/h1/ckpt-away"
if on_hosts 3 29520 resume.json missing.jsonl missing; then
  echo "FAIL: resuming without host 1's files succeeded"; exit 1
fi
for r in 0 1 2; do
  grep -q "rank-00002.data is missing (saved by rank 2 of 4, needed by ranks .*); rank-00003.data is missing .*; no rank of this run sees them. Where each node looked: node 0 (host [^)]*), ranks 0-1: $work/h0/ckpt/step-00000004; node 1 (host [^)]*), ranks 2-3: $work/h1/ckpt/step-00000004; node 2 (host [^)]*), ranks 4-5: $work/h2/ckpt/step-00000004" "$work/missing-h$r.out" ||
    { echo "FAIL: host $r did not name the missing files and where each node looked"; cat "$work/missing-h$r.out"; exit 1; }
done
echo "PASS: without host 1's directory every host names rank-00002.data and rank-00003.data and where each node looked"
rm -rf "$work/h1/ckpt"  # the failed run made an empty one (a checkpoint directory is created if missing)
mv "$work/h1/ckpt-away" "$work/h1/ckpt"
on_hosts 3 29521 resume.json resume.jsonl resume ||
  { echo "FAIL: the 3-host resume"; cat "$work/resume-h0.out" "$work/resume-h1.out" "$work/resume-h2.out"; exit 1; }
grep -q "resumed from ckpt/step-00000004 after step 4" "$work/resume-h0.out" ||
  { echo "FAIL: the 3-host run did not resume"; cat "$work/resume-h0.out"; exit 1; }
# The one-host oracle runs its ranks as the same nodes on loopback (launchers with --nnodes), so
# that its gradients are summed as the hosts' are: inside each node first (comm_nodes.h).
on_loopback() {  # $1: nodes, $2: port, $3: config, $4: log
  local r pids=()
  for r in $(seq 0 $(($1 - 1))); do
    (cd "$work/one" && exec "$strata" launch --nnodes "$1" --node-rank "$r" --master-addr 127.0.0.1 --master-port "$2" \
       --nproc-per-node 2 -- "$strata" train --config "../$3" --log "../$4") >>"$work/one-resume.out" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for r in "${pids[@]}"; do wait "$r" || rc=1; done
  return $rc
}
{ on_loopback 2 29522 save.json one-save.jsonl && on_loopback 3 29523 resume.json one-resume.jsonl; } ||
  { echo "FAIL: the one-host save and resume"; cat "$work/one-resume.out"; exit 1; }
python3 - "$work/resume.jsonl" "$work/one-resume.jsonl" <<'PY'
import json, sys
def losses(path):
    return [json.loads(l)["loss"] for l in open(path) if '"loss"' in l and '"step"' in l]
three, one = losses(sys.argv[1]), losses(sys.argv[2])
print("3 hosts, resumed:", three)
print("one host, resumed:", one)
assert len(three) == 4 and len(one) == 4, "expected steps 5-8"
for a, b in zip(three, one):  # the same world size: the state that crossed the network is the same bits
    assert a == b, f"{a} != {b}"
print("PASS: 3 hosts resume from 2 hosts' node-local checkpoints to the numbers of the same nodes on one host")
PY
[ $? = 0 ] || exit 1

# A lost host. Each case starts both hosts on a long run, waits for a few logged steps, then
# either kills every process of host 1 (SIGKILL) or cuts the link (host 1's end of the veth pair
# down), and checks that the other side fails on its own, in time, and says what it lost.
# distributed.timeout_s is 10 s here.
python3 - "$work/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["run"]["steps"] = 100000
c["distributed"] = {"timeout_s": 10}
json.dump(c, open(sys.argv[1].replace("config.json", "long.json"), "w"))
PY
lose_host() {  # $1: kill | cut
  rm -f "$work/long.jsonl"
  for r in 0 1; do
    ns=$ns0
    [ "$r" = 1 ] && ns=$ns1
    (cd "$work/h$r" && exec ip netns exec "$ns" "$strata" launch --nnodes 2 --node-rank "$r" --master-addr "$net.1" \
       --master-port 29518 --nproc-per-node 2 -- "$strata" train --config ../long.json --log ../long.jsonl) \
      >"$work/$1-h$r.out" 2>&1 &
    eval "pid$r=\$!"
  done
  for _ in $(seq 300); do
    [ -s "$work/long.jsonl" ] && [ "$(grep -c '"step"' "$work/long.jsonl")" -ge 3 ] && break
    sleep 0.1
  done
  [ "$(grep -c '"step"' "$work/long.jsonl" 2>/dev/null)" -ge 3 ] || { echo "FAIL ($1): the run did not start"; cat "$work/$1-h0.out"; exit 1; }
  start=$(date +%s%N)
  if [ "$1" = kill ]; then ip netns pids "$ns1" | xargs -r kill -9; else ip -n "$ns1" link set "$if1" down; fi
  wait "$pid0"
  rc=$?
  elapsed=$(( ($(date +%s%N) - start) / 1000000 ))
  wait "$pid1" 2>/dev/null
  rc1=$?
  echo "$1: host 0's launcher exited $rc after $elapsed ms, host 1's $rc1"
  [ "$1" = kill ] || [ "$rc1" != 0 ] || { echo "FAIL ($1): host 1 exited 0"; exit 1; }
  [ "$rc" != 0 ] || { echo "FAIL ($1): host 0 exited 0"; exit 1; }
  [ "$elapsed" -lt 25000 ] || { echo "FAIL ($1): host 0 took $elapsed ms (timeout 10 s)"; exit 1; }
}
lose_host kill
grep -q "the connection to $net.2 (host [^:]*: ranks 2, 3) is lost" "$work/kill-h0.out" ||
  { echo "FAIL (kill): host 0 did not name the lost host"; cat "$work/kill-h0.out"; exit 1; }
ip -n "$ns1" link set "$if1" up
lose_host cut
grep -q "host $net.2 ([^:]*: ranks 2, 3) does not answer" "$work/cut-h0.out" ||
  { echo "FAIL (cut): host 0 did not fail by the collective timeout naming host 1"; cat "$work/cut-h0.out"; exit 1; }
grep -q "host $net.1 ([^:]*: ranks 0, 1) does not answer" "$work/cut-h1.out" ||
  { echo "FAIL (cut): host 1 did not fail by the collective timeout naming host 0"; cat "$work/cut-h1.out"; exit 1; }
echo "PASS: a killed host is named within a second; a cut link fails both sides at the timeout, each naming the other"
