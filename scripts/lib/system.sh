# shellcheck shell=bash
# Throwaway OpenDsec system for test and benchmark scripts: a temp data dir,
# free loopback ports, the cached base images imported, `opendsec up` in the
# background. Source this file, then:
#
#   start_system BIN DD [IMAGE...] [-- UP_FLAGS...]
#     BIN: dir with opendsec, opendsec-agent and opendsec-init (next to
#     the agent: the node finds it there); DD: an empty data dir;
#     IMAGE: busybox, py, py-sci, base or code-interpreter (imported as
#     root/busybox, root/py:3.11, root/py-sci:3.11, root/base,
#     root/code-interpreter).
#     Sets API, NODE, WATCH, E2B (ports), UP_PID; writes $DD/opendsec.json.
#     SYSTEM_E2B_LISTEN replaces the gateway's 127.0.0.1:$E2B and
#     SYSTEM_E2B_EXTRA is JSON members added to e2b (e.g. '"tls": {...}').
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
  "e2b": {"listen": "${SYSTEM_E2B_LISTEN:-127.0.0.1:$E2B}", "domain": "opendsec.local"${SYSTEM_E2B_EXTRA:+, $SYSTEM_E2B_EXTRA}}
}
JSON
  if [ ${#images[@]} -gt 0 ]; then
    cached_store "$bin" "$dd/images" "${images[@]}" || return 1
  fi
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

# image_of IMAGE sets name and dir: the image's name and its cached root
# filesystem (deploy/images/build.sh).
image_of() {
  local cache=${OPENDSEC_CACHE:-/var/cache/opendsec}/rootfs
  case "$1" in
    busybox) name=root/busybox dir=$cache/busybox ;;
    py) name=root/py:3.11 dir=$cache/py-3.11 ;;
    py-sci) name=root/py-sci:3.11 dir=$cache/py-sci-3.11 ;;
    base) name=root/base dir=$cache/base ;;
    code-interpreter) name=root/code-interpreter dir=$cache/code-interpreter ;;
    *) echo "start_system: unknown image $1 (busybox, py, py-sci, base or code-interpreter)" >&2; return 2 ;;
  esac
  [ -f "$dir.stamp" ] || { echo "start_system: $dir is not built; run deploy/images/build.sh --no-import" >&2; return 1; }
}

# cached_store BIN DEST IMAGE... makes DEST an image store holding the
# images. Importing a root filesystem costs seconds to minutes (root/base:
# ~400 MB, 37k files), so the imported store is kept under
# $OPENDSEC_CACHE/test/stores/<key>, keyed by the images' builds and the
# store's code (internal/image), and DEST is a hard-linked copy of it: the
# store never changes a layer or manifest file once written and replaces
# refs by rename, so a system's writes never reach the cache.
cached_store() {
  local bin=$1 dest=$2; shift 2
  local name dir img src=""
  for img in "$@"; do
    image_of "$img" || return
    src+="$name $(cat "$dir.stamp") $(stat -c %i.%Y "$dir")"$'\n'
  done
  local code
  code=$(git -C "$(dirname "${BASH_SOURCE[0]}")/../.." rev-parse HEAD:internal/image 2>/dev/null) ||
    code=$(sha256sum "$bin/opendsec" | cut -c1-64)
  local key stores=${OPENDSEC_CACHE:-/var/cache/opendsec}/test/stores
  key=$(printf '%s\n%s' "$code" "$src" | sha256sum | cut -c1-16)
  mkdir -p "$stores"
  (
    flock 9
    local st=$stores/$key
    if [ ! -e "$st/done" ]; then
      rm -rf "$st.tmp" "$st"
      mkdir -p "$st.tmp"
      printf '{"version": 1, "data_dir": "%s", "node": {"image_dir": "%s/images"}}\n' "$st.tmp" "$st.tmp" >"$st.tmp/opendsec.json"
      for img in "$@"; do
        image_of "$img" || exit 1
        "$bin/opendsec" image import-rootfs -q --config "$st.tmp/opendsec.json" --data-dir "$st.tmp" \
          --name "$name" --rootfs "$dir" --user root >/dev/null 2>"$st.tmp/import.log" \
          || { cat "$st.tmp/import.log" >&2; rm -rf "$st.tmp"; exit 1; }
      done
      printf '%s' "$src" >"$st.tmp/done"
      mv "$st.tmp" "$st"
      # Keep the three newest stores.
      ls -1dt "$stores"/*/ 2>/dev/null | tail -n +4 | xargs -r rm -rf
    fi
    touch "$st"
    cp -al "$st/images" "$dest" 2>/dev/null || { rm -rf "$dest"; cp -a "$st/images" "$dest"; }
    rm -f "$dest/lock" # the store's own, made again on use
  ) 9>"$stores/.lock"
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
