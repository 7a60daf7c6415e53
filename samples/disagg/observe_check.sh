#!/usr/bin/env bash
# ferry's programs seen while they run (docs/operations.md).
#   observe_check.sh FERRY_DISAGG FERRY_TOP   the disaggregated sample, started with --metrics:
#       its decode worker's Prometheus endpoint must show the KV region it serves, its prefill
#       worker's (the next port) the transfers it made into it, and ferry-top must see both
#       workers on the sample's NATS server
#   observe_check.sh --bench FERRY_BENCH      ferry-bench --metrics: the initiator's endpoint
#       and the target's (the next port) must show the benchmark's operations
set -euo pipefail
mode=disagg
if [[ "$1" == --bench ]]; then
  mode=bench
  shift
fi
disagg=$1
top=${2:-}
work=$(mktemp -d)
pid=
cleanup() {
  local rc=$?
  if [[ -n "$pid" ]]; then
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

# Two free ports in a row on 127.0.0.1.
port=$(python3 -c '
import socket
for p in range(20000, 60000, 7):
    s1, s2 = socket.socket(), socket.socket()
    try:
        s1.bind(("127.0.0.1", p)); s2.bind(("127.0.0.1", p + 1)); print(p); break
    except OSError: pass
    finally: s1.close(); s2.close()')

# GET /metrics from 127.0.0.1:$1, the body on stdout ("" when nothing answers).
scrape() {
  { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 0
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  timeout 5 cat <&3 || true
  exec 3<&-
}

if [[ "$mode" == bench ]]; then
  "$disagg" --method tcp --start_block_size 64K --max_block_size 64K --point_seconds 20 \
    --quiet --metrics "127.0.0.1:$port" > "$work/out" 2>&1 &
  pid=$!
  initiator=0 target=0
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || { echo "ferry-bench ended early:"; cat "$work/out"; exit 1; }
    scrape "$port" |
      grep -Eq '^ferry_operations_total\{connector="ferry-bench-initiator",.*outcome="complete".*\} [1-9]' &&
      initiator=1
    scrape $((port + 1)) |
      grep -Eq '^ferry_operations_total\{connector="ferry-bench-target",.*outcome="complete".*\} [1-9]' &&
      target=1
    (( initiator && target )) && break
    sleep 0.2
  done
  echo "initiator metrics: $initiator, target metrics: $target"
  (( initiator && target )) || { cat "$work/out"; exit 1; }
  exit 0
fi

"$disagg" all --prefill 1 --requests 100000 --concurrency 2 --metrics "127.0.0.1:$port" \
  > "$work/out" 2>&1 &
pid=$!

ok_decode=0 ok_prefill=0 ok_top=0
for _ in $(seq 1 100); do
  kill -0 "$pid" 2>/dev/null || { echo "the sample ended early:"; cat "$work/out"; exit 1; }
  if (( ! ok_decode )) &&
     scrape "$port" | grep -Eq '^ferry_regions\{connector="decode-0",[^}]*\} [1-9]'; then
    ok_decode=1
  fi
  if (( ! ok_prefill )) &&
     scrape $((port + 1)) | grep -Eq '^ferry_operations_total\{connector="prefill-0",.*outcome="complete".*\} [1-9]'; then
    ok_prefill=1
  fi
  url=$(sed -n 's/^nats-server  started privately at //p' "$work/out")
  if (( ! ok_top )) && [[ -n "$url" ]] &&
     "$top" --nats "$url" --once --json --interval 0.3 --timeout-ms 200 > "$work/top" 2>&1 &&
     python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
names = {w["name"] for w in j["workers"]}
sys.exit(0 if {"decode-0", "prefill-0"} <= names and j["totals"]["ops_per_s"] > 0 else 1)' "$work/top"; then
    ok_top=1
  fi
  (( ok_decode && ok_prefill && ok_top )) && break
  sleep 0.2
done
echo "decode metrics: $ok_decode, prefill metrics: $ok_prefill, ferry-top: $ok_top"
if ! (( ok_decode && ok_prefill && ok_top )); then
  echo "--- the sample said:"; cat "$work/out"
  echo "--- ferry-top said:"; cat "$work/top" 2>/dev/null || true
  echo "--- decode's metrics:"; scrape "$port" | head -40
  exit 1
fi
