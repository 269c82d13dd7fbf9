#!/usr/bin/env bash
# Regenerates the committed Python stubs under lockstep/v1 and lockstep/wire/v1.
# grpcio-tools is pinned to 1.66.2 on purpose: its output (gencode 5.27) loads under the protobuf
# 5.x, 6.x and 7.x runtimes, while newer grpcio-tools stamp a gencode that refuses older runtimes.
# PROTO_SRC / PROTO_OUT: another proto tree and where its stubs go (tests/integration/
# test_adding_an_op.py adds an op to a copy this way); PROTOC_VENV: a venv to keep grpcio-tools in.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "${PROTO_SRC:-$root/proto}" && pwd)
out=$(mkdir -p "${PROTO_OUT:-$root}" && cd "${PROTO_OUT:-$root}" && pwd)
venv=${PROTOC_VENV:-$(mktemp -d)/protoc}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c "import grpc_tools" 2>/dev/null || "$venv/bin/pip" install -q "grpcio-tools==1.66.2"
cd "$src"
"$venv/bin/python" -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" lockstep/wire/v1/tinker.proto lockstep/v1/scheduler.proto
rm -f "$out/lockstep/wire/v1/tinker_pb2_grpc.py"  # the wire schema has no service
for d in lockstep/v1 lockstep/wire lockstep/wire/v1; do touch "$out/$d/__init__.py"; done
echo "generated stubs in $out/lockstep/v1 and $out/lockstep/wire/v1"
