#!/usr/bin/env bash
# Regenerates the committed Python stubs under lockstep/v1 and lockstep/wire/v1.
# grpcio-tools is pinned to 1.66.2 on purpose: its output (gencode 5.27) loads under the protobuf
# 5.x, 6.x and 7.x runtimes, while newer grpcio-tools stamp a gencode that refuses older runtimes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${PROTOC_VENV:-$(mktemp -d)/protoc}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c "import grpc_tools" 2>/dev/null || "$venv/bin/pip" install -q "grpcio-tools==1.66.2"
cd "$root"
"$venv/bin/python" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
  proto/lockstep/wire/v1/tinker.proto proto/lockstep/v1/scheduler.proto
rm -f lockstep/wire/v1/tinker_pb2_grpc.py  # the wire schema has no service
for d in lockstep/v1 lockstep/wire lockstep/wire/v1; do touch "$d/__init__.py"; done
echo "generated stubs in lockstep/v1 and lockstep/wire/v1"
