#!/usr/bin/env bash
# Regenerates the committed protobuf code: Go (api/gen) and Python
# (sdk/python/src/opendsec/_gen). OUT_GO / OUT_PY override the targets so a
# test can regenerate into a temp dir and diff against the committed files.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_GO=${OUT_GO:-api/gen}
OUT_PY=${OUT_PY:-sdk/python/src/opendsec/_gen}
export PATH="$(go env GOPATH)/bin:$PATH"
PROTO=api/proto
INC=/usr/include
mod=github.com/kernflux/opendsec/api/gen
e2bopts=(
  --go_opt=Mprocess/process.proto=$mod/process\;process
  --go_opt=Mfilesystem/filesystem.proto=$mod/filesystem\;filesystem
  --connect-go_opt=Mprocess/process.proto=$mod/process\;process
  --connect-go_opt=Mfilesystem/filesystem.proto=$mod/filesystem\;filesystem
)
files=(process/process.proto filesystem/filesystem.proto opendsec/v1/sandbox.proto opendsec/v1/image.proto opendsec/v1/snapshot.proto opendsec/node/v1/node.proto opendsec/node/v1/image.proto opendsec/node/v1/snapshot.proto opendsec/watcher/v1/watcher.proto)
rm -rf "$OUT_GO"; mkdir -p "$OUT_GO"
protoc -I "$PROTO" -I "$INC" \
  --go_out="$OUT_GO" --go_opt=module=$mod \
  --connect-go_out="$OUT_GO" --connect-go_opt=module=$mod \
  "${e2bopts[@]}" "${files[@]}"
if [ "${SKIP_PY:-}" != 1 ]; then
  PY=${PYTHON:-python3}
  rm -rf "$OUT_PY"; mkdir -p "$OUT_PY"
  "$PY" -m grpc_tools.protoc -I "$PROTO" \
    --python_out="$OUT_PY" --pyi_out="$OUT_PY" --grpc_python_out="$OUT_PY" \
    opendsec/v1/sandbox.proto opendsec/v1/image.proto opendsec/v1/snapshot.proto
  # grpc_tools emits absolute imports ("from opendsec.v1 import ..."); make them
  # package-relative so the generated code lives under opendsec._gen.
  find "$OUT_PY" -name '*.py' -exec sed -i -E 's/^from opendsec\.v1 import/from opendsec._gen.opendsec.v1 import/' {} +
  for d in "$OUT_PY" "$OUT_PY/opendsec" "$OUT_PY/opendsec/v1"; do touch "$d/__init__.py"; done
fi
