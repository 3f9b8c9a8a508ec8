#!/usr/bin/env bash
# How much of a rate-limited link Gloo's all-gathers use, beside one plain TCP stream on the same
# link: the part of bench/two_hosts_bandwidth.sh's gap between the planner (which takes the link
# as busy all the time) and the engine that is the transport's, not the engine's schedule.
#
# Two Linux network namespaces joined by a veth pair with a token-bucket filter (tc tbf) on both
# ends, as in bench/two_hosts_bandwidth.sh. Baseline: one TCP stream sending 16 MB from one
# namespace to the other (python sockets). Then two ranks of torch.distributed's Gloo, one in
# each namespace, run all_gather_into_tensor back to back (20 times) with each rank sending
# SIZE MB, for each size (the engine's all-gathers send one shard a unit, 1.6-2 MB in that bench).
# Prints a table and a final JSON line: metric gloo_all_gather_link_use (the smallest ratio of an
# all-gather's rate to the stream's), baseline tcp_stream_mbytes_per_s, ratio.
# Needs root (namespaces, tc) and a python with torch (STRATA_PYTHON, default the setup's venv);
# exits 77 where namespaces or tbf cannot be made.
#
# Usage: bench/link_probe.sh [--rate MBIT] [--sizes "0.5 1 2 4"]
set -uo pipefail
rate=100
sizes="0.5 1 2 4"
while [ $# -gt 0 ]; do
  case $1 in
  --rate) rate=$2; shift 2 ;;
  --sizes) sizes=$2; shift 2 ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
py=${STRATA_PYTHON:-$HOME/.cache/strata/venv/bin/python}
"$py" -c 'import torch.distributed' 2>/dev/null || { echo "link probe: no python with torch at $py (STRATA_PYTHON)" >&2; exit 1; }
id=$$
ns0=strata-p0-$id ns1=strata-p1-$id
if0=sp0-$id if1=sp1-$id
net=10.217.$((id % 200 + 20))
. "$(dirname "$(realpath "${BASH_SOURCE[0]}")")/../scripts/netns-hosts.sh"
netns_hosts "$ns0" "$ns1"
if ! netns_link "$ns0" "$if0" "$net.1" "$ns1" "$if1" "$net.2"; then
  echo "SKIP: cannot join two network namespaces with a veth pair here"
  exit 77
fi
for ns_if in "$ns0 $if0" "$ns1 $if1"; do
  set -- $ns_if
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "${rate}mbit" burst "${STRATA_TBF_BURST:-256kb}" \
    latency "${STRATA_TBF_LATENCY:-200ms}" || { echo "SKIP: tc tbf is not available here"; exit 77; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"; netns_cleanup' EXIT

# The baseline: one TCP stream, 16 MB, timed by the receiver from its first byte.
cat >"$work/stream.py" <<'PY'
import socket, sys, time
role, addr = sys.argv[1], sys.argv[2]
n = 16 * 1000 * 1000
if role == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 29871)); s.listen(1)
    c, _ = s.accept()
    got, t0 = 0, None
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        if t0 is None: t0 = time.time()
        got += len(b)
    print(got / (time.time() - t0) / 1e6)
else:
    for _ in range(100):
        try:
            c = socket.create_connection((addr, 29871)); break
        except OSError:
            time.sleep(0.05)
    c.sendall(b"\0" * n)
    c.close()
PY
ip netns exec "$ns0" "$py" "$work/stream.py" recv "$net.1" >"$work/stream.out" &
recv=$!
ip netns exec "$ns1" "$py" "$work/stream.py" send "$net.1"
wait $recv || { echo "link probe: the TCP stream failed"; exit 1; }
stream=$(cat "$work/stream.out")

cat >"$work/gather.py" <<'PY'
import sys, time, datetime, torch, torch.distributed as dist
rank, addr, port, mb = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
n = int(mb * 1e6 / 4)
x, out = torch.ones(n), torch.empty(2 * n)
for _ in range(2):
    dist.all_gather_into_tensor(out, x)
dist.barrier()
reps = 20
t0 = time.time()
for _ in range(reps):
    dist.all_gather_into_tensor(out, x)
if rank == 0:
    print(n * 4 * reps / (time.time() - t0) / 1e6)
dist.destroy_process_group()
PY
port=29880
rows=()
for mb in $sizes; do
  port=$((port + 1))
  GLOO_SOCKET_IFNAME=$if1 ip netns exec "$ns1" "$py" "$work/gather.py" 1 "$net.1" "$port" "$mb" >/dev/null 2>"$work/g1.err" &
  other=$!
  got=$(GLOO_SOCKET_IFNAME=$if0 ip netns exec "$ns0" "$py" "$work/gather.py" 0 "$net.1" "$port" "$mb" 2>"$work/g0.err")
  wait $other || { echo "link probe: the all-gather at $mb MB failed"; cat "$work/g0.err" "$work/g1.err"; exit 1; }
  rows+=("$mb $got")
done
printf '%s\n' "${rows[@]}" | "$py" -c '
import json, sys
rate, stream = float(sys.argv[1]), float(sys.argv[2])
rows = [tuple(map(float, l.split())) for l in sys.stdin if l.strip()]
link = rate / 8
print("| link | sent per all-gather by each rank (MB) | MB/s sent | of the TCP stream | of the link rate |")
print("|---|---|---|---|---|")
print("| %g Mbit/s | one TCP stream, 16 MB | %.2f | 1.00 | %.2f |" % (rate, stream, stream / link))
for mb, got in rows:
    print("| %g Mbit/s | %g | %.2f | %.2f | %.2f |" % (rate, mb, got, got / stream, got / link))
worst = min(got / stream for mb, got in rows)
print(json.dumps({"metric": "gloo_all_gather_link_use", "value": worst, "baseline": "tcp_stream_mbytes_per_s",
                  "baseline_value": stream, "ratio": worst, "rate_mbit": rate,
                  "cases": [{"mbytes_sent": mb, "mbytes_per_s": got} for mb, got in rows]}))
' "$rate" "$stream"
