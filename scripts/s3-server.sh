#!/usr/bin/env bash
# A throw-away S3 server for the tests: Ceph's RADOS Gateway (Debian's radosgw 16.2) on a private
# one-node Ceph cluster (one monitor, one OSD on the in-memory memstore), all on 127.0.0.1.
#
#   scripts/s3-server.sh start DIR PORT   # PORT 0: a free one. Prints one line of variables, also written to DIR/env:
#                                         # AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION,
#                                         # STRATA_S3_HTTPS_ENDPOINT (the same server over https, on a
#                                         # free port, with a self-signed certificate) and STRATA_S3_CA
#                                         # (that certificate, to pass as AWS_CA_BUNDLE), STRATA_S3_DIR
#                                         # (DIR: radosgw-admin -c DIR/ceph.conf -n client.rgw ...)
#   scripts/s3-server.sh stop DIR         # stops exactly what `start DIR` started, removes DIR
#
# Everything (config, keys, data, logs, pids) lives in DIR; nothing else is touched. The daemons
# run detached; `stop` finds them by their pid files and checks /proc/PID/cmdline before it
# signals, so a recycled pid is never hit. Start takes about 3 s here; every wait is bounded
# (STRATA_S3_START_TIMEOUT, default 90 s) and a failed start prints the logs' tails and cleans up.
# PORT must be outside 6800-7300 (the OSD's range). The packages (ceph-mon ceph-osd ceph-common
# radosgw) are installed by scripts/setup.sh.
# The bucket STRATA_S3_BUCKET (default strata-test) is created.
# Environment: STRATA_S3_MEMSTORE_MB (store capacity, default 2048: a full store is one of the
# faults the tests make), STRATA_S3_BUCKET.
set -euo pipefail

usage() { echo "usage: $0 start DIR PORT | stop DIR" >&2; exit 2; }
say() { printf '[s3-server] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# --- stop ------------------------------------------------------------------------------------
is_ours() {  # PID BINARY CONF
  local cmd
  cmd=$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null) || return 1
  [[ $cmd == *"$2"* && $cmd == *"$3"* ]]
}
stop_daemon() {  # DIR NAME BINARY
  local pidfile=$1/run/$2.pid pid i
  [[ -f $pidfile ]] || return 0
  pid=$(cat "$pidfile" 2>/dev/null || true)
  if [[ $pid =~ ^[0-9]+$ ]] && is_ours "$pid" "$3" "$1/ceph.conf"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do is_ours "$pid" "$3" "$1/ceph.conf" || break; sleep 0.1; done
    if is_ours "$pid" "$3" "$1/ceph.conf"; then
      say "$2 (pid $pid) still runs 5 s after SIGTERM: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$pidfile"
}
stop_all() {  # DIR
  [[ -d $1 ]] || return 0
  stop_daemon "$1" client.rgw radosgw
  stop_daemon "$1" osd.0 ceph-osd
  stop_daemon "$1" mon.a ceph-mon
}

[[ $# -ge 2 ]] || usage
cmd=$1
dir=$2
case $cmd in
  stop)
    [[ $# -eq 2 ]] || usage
    [[ -d $dir ]] || exit 0
    dir=$(cd "$dir" && pwd)
    stop_all "$dir"
    rm -rf "$dir"
    exit 0 ;;
  start) [[ $# -eq 3 ]] || usage ;;
  *) usage ;;
esac

# --- start -----------------------------------------------------------------------------------
port=$3
[[ $port =~ ^[0-9]+$ ]] && ((port < 65536)) || die "bad port '$port'"
free_port() {  # a port nobody listens on, outside the OSD's range
  python3 -c 'import socket
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if not 6800 <= p <= 7300: print(p); break'
}
((port != 0)) || port=$(free_port)
((port < 6800 || port > 7300)) || die "port $port is in the OSD's range 6800-7300"
for b in ceph ceph-mon ceph-osd ceph-authtool monmaptool radosgw radosgw-admin; do
  command -v "$b" >/dev/null || die "'$b' is missing: run scripts/setup.sh (it installs ceph-mon ceph-osd ceph-common radosgw)"
done
deadline=$(($(date +%s) + ${STRATA_S3_START_TIMEOUT:-90}))
remaining() { local r=$((deadline - $(date +%s))); ((r > 0)) || r=1; echo $r; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
((${#dir} <= 80)) || die "DIR '$dir' is longer than 80 characters (admin socket paths are limited)"
stop_all "$dir"
rm -rf "$dir"/{ceph.conf,keyring,monmap,env,run,log,mon,osd}
mkdir -p "$dir"/{run,log,mon,osd/0}
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
listening "$port" && die "something already listens on 127.0.0.1:$port"
mon_port=$(free_port)
tls_port=$(free_port)

on_exit() {
  local rc=$?
  ((rc == 0)) && return
  say "start failed; the logs end with:"
  for f in "$dir"/log/*.log; do [[ -s $f ]] && { echo "--- $f" >&2; tail -n 12 "$f" >&2; }; done
  stop_all "$dir"
}
trap on_exit EXIT

# https on a second port, with a self-signed certificate for 127.0.0.1 and localhost.
mkdir -p "$dir/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3 \
  -keyout "$dir/tls/key.pem" -out "$dir/tls/cert.pem" -subj /CN=localhost \
  -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" >"$dir/log/openssl.log" 2>&1 ||
  die "openssl could not make the test certificate (see $dir/log/openssl.log)"

conf=$dir/ceph.conf
fsid=$(cat /proc/sys/kernel/random/uuid)
cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
public addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false
auth allow insecure global id reclaim = false
keyring = $dir/keyring
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
log to stderr = false
err to stderr = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
[mon]
mon data = $dir/mon/\$name
# The monitor commits every change after this pause (default 1 s, which makes a start ~15 s).
paxos propose interval = 0.05
[osd]
osd data = $dir/osd/\$id
keyring = $dir/osd/\$id/keyring
osd objectstore = memstore
memstore device bytes = $((${STRATA_S3_MEMSTORE_MB:-2048} * 1024 * 1024))
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$port ssl_endpoint=127.0.0.1:$tls_port ssl_certificate=$dir/tls/cert.pem ssl_private_key=$dir/tls/key.pem
rgw dns name = localhost
rgw enable usage log = false
# Deleted objects are reclaimed after 30 s instead of 2 h (memstore keeps them in RAM).
rgw gc obj min wait = 30
rgw gc processor period = 30
EOF

ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$dir/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' >/dev/null
ceph-authtool "$dir/keyring" --gen-key -n client.rgw --cap mon 'allow rw' --cap osd 'allow rwx' >/dev/null
monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >/dev/null
ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" >"$dir/log/mkfs.log" 2>&1 || die "ceph-mon --mkfs failed"
ceph-mon -c "$conf" -i a || die "ceph-mon did not start"

osd_uuid=$(cat /proc/sys/kernel/random/uuid)
osd_key=$(ceph-authtool --gen-print-key)
osd_id=$(echo "{\"cephx_secret\": \"$osd_key\"}" |
         timeout "$(remaining)" ceph -c "$conf" --connect-timeout 10 osd new "$osd_uuid" -i -) ||
  die "the monitor on port $mon_port did not answer 'osd new'"
[[ $osd_id == 0 ]] || die "expected osd id 0, got '$osd_id'"
printf '[osd.0]\nkey = %s\n' "$osd_key" >"$dir/osd/0/keyring"
ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$osd_uuid" >>"$dir/log/mkfs.log" 2>&1 || die "ceph-osd --mkfs failed"
# mmap for large buffers, so memory of deleted objects goes back to the system.
MALLOC_MMAP_THRESHOLD_=131072 ceph-osd -c "$conf" -i 0 || die "ceph-osd did not start"
until timeout "$(remaining)" ceph -c "$conf" --connect-timeout 10 osd dump 2>/dev/null | grep -q '^osd.0 up'; do
  (($(date +%s) < deadline)) || die "osd.0 not up in time"
  sleep 0.3
done

key_id=STRATA$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n' | tr a-f A-F)
secret=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
timeout "$(remaining)" radosgw-admin -c "$conf" -n client.rgw user create --uid=strata \
  --display-name=strata --access-key="$key_id" --secret-key="$secret" >"$dir/log/user.json" 2>"$dir/log/user.log" ||
  die "radosgw-admin user create failed"
radosgw -c "$conf" -n client.rgw || die "radosgw did not start"
until [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$port/" 2>/dev/null) == 200 ]]; do
  (($(date +%s) < deadline)) || die "radosgw does not answer on 127.0.0.1:$port"
  sleep 0.2
done
# The tests' bucket (curl signs with SigV4 itself).
curl -sf --aws-sigv4 "aws:amz:us-east-1:s3" --user "$key_id:$secret" -X PUT \
  -H "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" \
  "http://127.0.0.1:$port/${STRATA_S3_BUCKET:-strata-test}" >/dev/null ||
  die "could not create the bucket ${STRATA_S3_BUCKET:-strata-test}"
vars="AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ACCESS_KEY_ID=$key_id AWS_SECRET_ACCESS_KEY=$secret AWS_REGION=us-east-1"
vars+=" STRATA_S3_HTTPS_ENDPOINT=https://127.0.0.1:$tls_port STRATA_S3_CA=$dir/tls/cert.pem STRATA_S3_DIR=$dir"
echo "$vars" >"$dir/env"
echo "$vars"
