# Network namespaces for run_netns_test.sh: one namespace per server, each
# with a veth whose other end is a port of a bridge in the namespace the
# script runs in. The test subnet's addresses exist inside the namespaces
# only; the bridge itself has no address, so nothing is routed in the
# script's own namespace and parallel runs (each with its own bridge) do not
# see each other.
#
#   source tests/e2e/lib.sh; source tests/e2e/netns_lib.sh
#   netns_preflight            # e2e_skip (lib.sh) with the reason when impossible
#   netns_clean_stale          # namespaces / links of earlier runs whose script is gone
#   netns_setup p0 p1 d0 ...   # NETNS_NS[role], NETNS_IP[role], NETNS_VETH[role]
#   netns_teardown             # from e2e_at_exit: every namespace, veth and the bridge
#
# Names: namespaces "gonixl-netns-<pid>-<role>", links "gnx<pid><role>" (the
# host end of each veth) and "gnx<pid>br" (the bridge): <pid> is this
# script's PID, so a stale name is recognised by its PID no longer running.
# shellcheck shell=bash

NETNS_PREFIX=gonixl-netns-
NETNS_LINK_PREFIX=gnx
NETNS_ID=$$
NETNS_BRIDGE="${NETNS_LINK_PREFIX}${NETNS_ID}br"
declare -A NETNS_NS=() NETNS_IP=() NETNS_VETH=()
NETNS_ROLES=()
NETNS_CREATED=0

# A skip recorded for ./build.sh test's check (lib.sh's e2e_skip): no entry
# of tests/declared.toml declares it, so where the suite cannot run (not
# root, no ip command) the step fails, saying why.
netns_skip() { e2e_skip "$@"; }

# netns_preflight: root, the ip command, and a namespace can really be made.
netns_preflight() {
  [ "$(id -u)" = 0 ] || netns_skip "network namespaces need root (uid $(id -u))"
  command -v ip >/dev/null || netns_skip "no ip command (iproute2)"
  command -v nsenter >/dev/null || netns_skip "no nsenter command (util-linux)"
  command -v curl >/dev/null || netns_skip "no curl command"
  local probe="${NETNS_PREFIX}${NETNS_ID}-probe" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    netns_skip "cannot create a network namespace: $err"
  fi
  if ! err=$(ip link add "${NETNS_LINK_PREFIX}${NETNS_ID}pb" type bridge 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    netns_skip "cannot create a bridge: $err"
  fi
  ip link del "${NETNS_LINK_PREFIX}${NETNS_ID}pb" 2>/dev/null || true
  ip netns del "$probe" 2>/dev/null || true
}

# netns_subnet: a /24 of 10.213.0.0/16 that no route of this namespace
# covers (the addresses are used inside the test's namespaces only; this
# merely avoids confusing anyone reading `ip route`). Sets NETNS_NET
# ("10.213.N").
netns_subnet() {
  local n
  for n in $(seq $((NETNS_ID % 200 + 20)) 254) $(seq 20 254); do
    if ! ip route show | grep -q "^10\.213\.$n\."; then
      NETNS_NET="10.213.$n"
      return 0
    fi
  done
  e2e_say "no free 10.213.N.0/24 subnet"
  return 1
}

# netns_pid_alive PID: whether a process PID runs (here: an earlier run's script).
netns_pid_alive() { kill -0 "$1" 2>/dev/null; }

# netns_kill_ns_pids NS: end the processes still inside namespace NS (only
# ever one of this test's namespaces: the servers an earlier, crashed run
# started there).
netns_kill_ns_pids() {
  local pids pid _
  pids=$(ip netns pids "$1" 2>/dev/null) || return 0
  [ -n "$pids" ] || return 0
  for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 25); do
    pids=$(ip netns pids "$1" 2>/dev/null)
    [ -n "$pids" ] || return 0
    sleep 0.2
  done
  for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
}

# netns_clean_stale: namespaces and links named by this test whose script
# (the PID in the name) is no longer running.
netns_clean_stale() {
  local ns pid link n=0
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns =~ ^${NETNS_PREFIX}([0-9]+)- ]] || continue
    pid=${BASH_REMATCH[1]}
    netns_pid_alive "$pid" && continue
    netns_kill_ns_pids "$ns"
    ip netns del "$ns" 2>/dev/null && n=$((n + 1))
  done
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
    [[ $link =~ ^${NETNS_LINK_PREFIX}([0-9]+)[a-z] ]] || continue
    pid=${BASH_REMATCH[1]}
    netns_pid_alive "$pid" && continue
    ip link del "$link" 2>/dev/null && n=$((n + 1))
  done
  ((n == 0)) || e2e_say "removed $n stale namespaces/links of earlier runs"
}

# netns_setup ROLE...: the bridge, then per role (a short word: p0, d1, ...)
# a namespace with lo up and a veth "eth0" holding NETNS_NET.<host> (hosts
# from 11 on, in order), whose other end is a bridge port. Sets NETNS_NS,
# NETNS_IP and NETNS_VETH (the bridge-side end: set it down to cut the
# namespace off) for each role.
netns_setup() {
  netns_subnet
  NETNS_CREATED=1
  ip link add "$NETNS_BRIDGE" type bridge
  ip link set "$NETNS_BRIDGE" up
  local role host=11 ns veth
  for role in "$@"; do
    ns="${NETNS_PREFIX}${NETNS_ID}-$role"
    veth="${NETNS_LINK_PREFIX}${NETNS_ID}$role"
    ((${#veth} <= 13)) || { e2e_say "link name $veth too long"; return 1; }
    NETNS_ROLES+=("$role")
    NETNS_NS[$role]=$ns
    NETNS_VETH[$role]=$veth
    NETNS_IP[$role]="$NETNS_NET.$host"
    host=$((host + 1))
    ip netns add "$ns"
    ip link add "$veth" type veth peer name "${veth}i"
    ip link set "${veth}i" netns "$ns"
    ip -n "$ns" link set "${veth}i" name eth0
    ip -n "$ns" addr add "${NETNS_IP[$role]}/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip link set "$veth" master "$NETNS_BRIDGE"
    ip link set "$veth" up
  done
  e2e_say "namespaces on $NETNS_NET.0/24 (bridge $NETNS_BRIDGE): $(for r in "${NETNS_ROLES[@]}"; do printf '%s=%s ' "$r" "${NETNS_IP[$r]}"; done)"
}

# netns_probe FROM TO: a TCP connection from namespace role FROM to a
# listener in namespace role TO (the bridge forwards; nothing such as a
# bridge firewall drops the test's packets).
netns_probe() {
  local from=$1 to=$2 port=7 lpid rc=0
  ip netns exec "${NETNS_NS[$to]}" "$PY" -c "
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('${NETNS_IP[$to]}', $port)); s.listen(); s.settimeout(15)
c, _ = s.accept(); c.sendall(b'ok'); c.close()" &
  lpid=$!
  ip netns exec "${NETNS_NS[$from]}" "$PY" -c "
import socket, time
for i in range(50):
    try:
        c = socket.create_connection(('${NETNS_IP[$to]}', $port), timeout=5); break
    except ConnectionRefusedError:
        time.sleep(0.1)
assert c.recv(2) == b'ok'" || rc=1
  wait "$lpid" || rc=1
  if ((rc)); then
    e2e_say "no TCP connection from namespace $from to $to (${NETNS_IP[$to]}) across bridge $NETNS_BRIDGE" \
      "(bridge netfilter: net.bridge.bridge-nf-call-iptables=$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo n/a))"
    return 1
  fi
}

# netns_wait_ready NAME ROLE URL: lib.sh's wait_ready, with curl run inside
# namespace ROLE.
netns_wait_ready() {
  local deadline=$((SECONDS + WAIT)) pid
  until ip netns exec "${NETNS_NS[$2]}" curl -sf -o /dev/null --max-time 10 "$3"; do
    if ((SECONDS > deadline)); then e2e_say "$1 not ready after ${WAIT}s"; return 1; fi
    for pid in "${PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || { e2e_say "a server exited early (pid $pid)"; return 1; }
    done
    sleep 2
  done
  e2e_say "$1 ready ($(e2e_elapsed) s)"
}

# netns_teardown: every process left in the namespaces, the namespaces (and
# with them the veths' inner ends), the veths' bridge ends and the bridge.
# Safe to call more than once and after a partial netns_setup.
netns_teardown() {
  ((NETNS_CREATED)) || return 0
  local role ns
  for role in "${NETNS_ROLES[@]}"; do
    ns=${NETNS_NS[$role]}
    netns_kill_ns_pids "$ns"
    ip netns del "$ns" 2>/dev/null || true
    ip link del "${NETNS_VETH[$role]}" 2>/dev/null || true
  done
  ip link del "$NETNS_BRIDGE" 2>/dev/null || true
  # A veth created before its namespace was recorded (setup interrupted).
  local link
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
    [[ $link == "${NETNS_LINK_PREFIX}${NETNS_ID}"[a-z]* ]] && ip link del "$link" 2>/dev/null
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns == "${NETNS_PREFIX}${NETNS_ID}-"* ]] || continue
    netns_kill_ns_pids "$ns"
    ip netns del "$ns" 2>/dev/null || true
  done
  NETNS_CREATED=0
  e2e_say "namespaces, veths and bridge removed"
}
