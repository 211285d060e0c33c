#!/usr/bin/env bash
# An HTTP replay against its floor, side by side in one run: examples/http.rs
# (MariaDB and Redis) answering one finished Idempotency-Key again and again,
# and benches/http/floor.rs, a plain axum handler answering one Redis HGET's
# JSON. Both built in release, both driven by wrk with the same request (32
# connections, one wrk thread, so the servers keep a core), in alternating
# rounds; prints each round's rates and their ratio (target: >= 0.90).
#
#   benches/http/replay.sh [seconds per run, default 10] [rounds, default 2]
#
# Needs wrk (apt-get install wrk), MariaDB and Redis (IDEM_MYSQL_URL,
# IDEM_REDIS_URL; local defaults).
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-10}
rounds=${2:-2}
command -v wrk >/dev/null || { echo "needs wrk (apt-get install wrk)" >&2; exit 1; }
export IDEM_MYSQL_URL=${IDEM_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
export IDEM_REDIS_URL=${IDEM_REDIS_URL:-redis://127.0.0.1:6379}

cargo build --quiet --release --features axum,mysql,postgres,redis,sqlite --example http --example http_floor
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
IDEM_HTTP_ADDR=127.0.0.1:3100 "$target/release/examples/http" >/dev/null &
pids+=($!)
IDEM_HTTP_ADDR=127.0.0.1:3101 "$target/release/examples/http_floor" >/dev/null &
pids+=($!)
for port in 3100 3101; do
  for _ in $(seq 1 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.1
  done
done

key="bench-replay-$(date +%s%N)"
request=$(mktemp)
cat >"$request" <<LUA
wrk.method = "POST"
wrk.body = '{"amount":1999}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-User-Id"] = "alice"
wrk.headers["Idempotency-Key"] = "$key"
LUA
# The first call pays; every later one is a replay.
first=$(curl -s -o /dev/null -w '%{http_code}' -X POST localhost:3100/orders/42/pay -H 'X-User-Id: alice' \
  -H "Idempotency-Key: $key" -H 'Content-Type: application/json' -d '{"amount":1999}')
[ "$first" = 200 ] || { echo "the first call answered $first" >&2; exit 1; }
replayed=$(curl -s -D - -o /dev/null -X POST localhost:3100/orders/42/pay -H 'X-User-Id: alice' \
  -H "Idempotency-Key: $key" -H 'Content-Type: application/json' -d '{"amount":1999}' | tr -d '\r' | grep -ci '^idempotent-replayed: true' || true)
[ "$replayed" = 1 ] || { echo "the second call was not a replay" >&2; exit 1; }

rate() { wrk -t1 -c32 -d"${seconds}s" -s "$request" "http://127.0.0.1:$1/orders/42/pay" | awk '/Requests\/sec/ {print $2}'; }
printf '%-6s %14s %14s %8s\n' round "replay req/s" "floor req/s" ratio
for round in $(seq 1 "$rounds"); do
  # Each round in the other order, so neither always runs second.
  if [ $((round % 2)) = 1 ]; then replay=$(rate 3100); floor=$(rate 3101); else floor=$(rate 3101); replay=$(rate 3100); fi
  ratio=$(python3 -c "print(f'{$replay / $floor:.2f}')")
  verdict=$(python3 -c "print('met' if $replay / $floor >= 0.9 else 'NOT met')")
  printf '%-6s %14.0f %14.0f %7sx  target >= 0.90x: %s\n' "$round" "$replay" "$floor" "$ratio" "$verdict"
done
rm -f "$request"
