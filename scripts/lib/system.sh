# shellcheck shell=bash
# Throwaway OpenDsec system for test and benchmark scripts: a temp data dir,
# free loopback ports, the cached base images imported, `opendsec up` in the
# background. Source this file, then:
#
#   start_system BIN DD [IMAGE...] [-- UP_FLAGS...]
#     BIN: dir with opendsec, opendsec-agent and opendsec-init (next to
#     the agent: the node finds it there); DD: an empty data dir;
#     IMAGE: busybox, py or py-sci (imported as root/busybox, root/py:3.11,
#     root/py-sci:3.11).
#     Sets API, NODE, WATCH, E2B (ports), UP_PID; writes $DD/opendsec.json.
#     OPENDSEC_LOG_LEVEL sets the log level (default info).
#     SYSTEM_NETWORK_EXTRA and SYSTEM_NODE_EXTRA are JSON members added to
#     node.network and node (e.g. '"dns_upstream": ["127.0.0.1:5399"]').
#     Sandbox networking (nftables table, DNS proxy address, forwarding) is
#     set up inside a network namespace made for the system, never in the
#     host's; OPENDSEC_HOST_NETWORK=1 uses the host's, as production does.
#   stop_system   SIGTERM to UP_PID, wait, remove the namespace (call from
#     an EXIT trap).
#
# The system's log is $DD/up.log and its admin token $DD/bootstrap.token.

free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

start_system() {
  local bin=$1 dd=$2; shift 2
  local images=() up_flags=()
  while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then shift; up_flags=("$@"); break; fi
    images+=("$1"); shift
  done
  API=$(free_port); NODE=$(free_port); WATCH=$(free_port); E2B=$(free_port)
  # Like the quickstart: an allowed name never opens a private address.
  local nx=${SYSTEM_NETWORK_EXTRA:+, $SYSTEM_NETWORK_EXTRA}
  local network='"network": {"netns_dir": "'"$dd"'/netns", "refuse_private_dns_answers": true'"$nx"'}'
  if [ "${OPENDSEC_HOST_NETWORK:-}" != 1 ]; then
    SYSTEM_NETNS=odsys$$
    ip netns add "$SYSTEM_NETNS"
    ip -n "$SYSTEM_NETNS" link set lo up
    network='"network": {"enabled": true, "node_netns": "/run/netns/'"$SYSTEM_NETNS"'", "netns_dir": "'"$dd"'/netns", "refuse_private_dns_answers": true'"$nx"'}'
  fi
  cat > "$dd/opendsec.json" <<JSON
{
  "version": 1,
  "data_dir": "$dd",
  "log": {"level": "${OPENDSEC_LOG_LEVEL:-info}"},
  "apiserver": {"listen": "127.0.0.1:$API", "watcher_address": "http://127.0.0.1:$WATCH", "placement_sample": 2},
  "watcher": {"listen": "127.0.0.1:$WATCH", "poll_interval_ms": 200},
  "node": {"id": "n001", "listen": "127.0.0.1:$NODE", "agent_path": "$bin/opendsec-agent",
           "image_dir": "$dd/images", "default_backend": "container", "max_sandboxes": 200, "max_upload_mb": 64,
           ${SYSTEM_NODE_EXTRA:+$SYSTEM_NODE_EXTRA,} $network},
  "nodes": [{"id": "n001", "address": "http://127.0.0.1:$NODE"}],
  "e2b": {"listen": "127.0.0.1:$E2B", "domain": "opendsec.local"}
}
JSON
  local cache=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs img name dir
  for img in "${images[@]}"; do
    case "$img" in
      busybox) name=root/busybox dir=$cache/busybox ;;
      py) name=root/py:3.11 dir=$cache/py-3.11 ;;
      py-sci) name=root/py-sci:3.11 dir=$cache/py-sci-3.11 ;;
      *) echo "start_system: unknown image $img (busybox, py or py-sci)" >&2; return 2 ;;
    esac
    "$bin/opendsec" image import-rootfs -q --config "$dd/opendsec.json" --data-dir "$dd" \
      --name "$name" --rootfs "$dir" --user root >/dev/null 2>"$dd/import.log" \
      || { cat "$dd/import.log" >&2; return 1; }
  done
  "$bin/opendsec" up --config "$dd/opendsec.json" --data-dir "$dd" --ready-file "$dd/ready" "${up_flags[@]}" \
    >"$dd/up.log" 2>&1 &
  UP_PID=$!
  local _
  for _ in $(seq 1 600); do
    [ -s "$dd/ready" ] && return 0
    kill -0 "$UP_PID" 2>/dev/null || { tail -n 50 "$dd/up.log" >&2; echo "opendsec up exited" >&2; return 1; }
    sleep 0.1
  done
  tail -n 50 "$dd/up.log" >&2
  echo "opendsec up did not become ready in 60 s" >&2
  return 1
}

stop_system() {
  if [ -n "${UP_PID:-}" ] && kill -0 "$UP_PID" 2>/dev/null; then
    kill -TERM "$UP_PID"
    wait "$UP_PID" || true
  fi
  if [ -n "${SYSTEM_NETNS:-}" ]; then
    ip netns delete "$SYSTEM_NETNS" 2>/dev/null || true
  fi
}
