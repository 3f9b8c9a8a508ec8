# Sourced by the tests and benchmarks that make "hosts" out of Linux network namespaces
# (tests/cli/two_hosts_netns_test.sh, bench/two_hosts_bandwidth.sh). Addresses exist only inside
# the namespaces the caller creates; netns_cleanup removes them.

# netns_hosts NS...: creates the namespaces (loopback up) and an EXIT trap that removes them.
# Exits 77 (skipped) where namespaces cannot be made.
netns_hosts() {
  NETNS_CREATED=()
  trap netns_cleanup EXIT
  local ns
  for ns in "$@"; do
    if ! ip netns add "$ns" 2>/dev/null; then
      echo "SKIP: cannot create a network namespace here (needs root or CAP_SYS_ADMIN, and iproute2)"
      exit 77
    fi
    NETNS_CREATED+=("$ns")
    ip -n "$ns" link set lo up
  done
}

netns_cleanup() {
  local ns
  for ns in "${NETNS_CREATED[@]}"; do ip netns del "$ns" 2>/dev/null; done
}

# netns_link NS_A IF_A ADDR_A NS_B IF_B ADDR_B: a veth pair between two namespaces, each end with
# its address (a /24) and up.
netns_link() {
  ip link add "$2" netns "$1" type veth peer name "$5" netns "$4" &&
    ip -n "$1" addr add "$3/24" dev "$2" && ip -n "$4" addr add "$6/24" dev "$5" &&
    ip -n "$1" link set "$2" up && ip -n "$4" link set "$5" up
}
