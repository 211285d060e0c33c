#!/usr/bin/env bash
# An HTTP replay against its floor, side by side in one run: examples/http.rs
# (MariaDB and Redis) answering one finished Idempotency-Key again and again,
# and benches/http/floor.rs, a plain axum handler answering one Redis HGET's
# JSON. Both built in release, both driven by wrk with the same request (32
# connections, one wrk thread, so the servers keep a core). A round gives
# each server the same time in short slices taken in turn (ABBA...), so a
# drift of the machine's speed during the round (on a shared VM the rates
# move by a tenth within a minute) falls on both alike; prints each round's
# rates and their ratio (target: >= 0.90).
#
#   benches/http/replay.sh [seconds per server per round, default 10] [rounds, default 2] [slices, default 4]
#
# Needs wrk (apt-get install wrk), MariaDB and Redis (IDEM_MYSQL_URL,
# IDEM_REDIS_URL; local defaults).
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-10}
rounds=${2:-2}
slices=${3:-4}
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

# Requests answered in one slice of `slice` seconds.
slice=$(( seconds / slices > 0 ? seconds / slices : 1 ))
served() { wrk -t1 -c32 -d"${slice}s" -s "$request" "http://127.0.0.1:$1/orders/42/pay" | awk '/requests in/ {print $1}'; }
printf '%-6s %14s %14s %8s\n' round "replay req/s" "floor req/s" ratio
for round in $(seq 1 "$rounds"); do
  replay=0 floor=0
  for s in $(seq 1 "$slices"); do
    # ABBA: each server first in every other slice.
    if [ $(((round + s) % 2)) = 0 ]; then
      replay=$((replay + $(served 3100))); floor=$((floor + $(served 3101)))
    else
      floor=$((floor + $(served 3101))); replay=$((replay + $(served 3100)))
    fi
  done
  read -r replay_rate floor_rate ratio verdict < <(python3 -c "
t = $slices * $slice; r = $replay / $floor
print(f'{$replay / t:.0f} {$floor / t:.0f} {r:.3f}', 'met' if r >= 0.9 else 'NOT_met')")
  printf '%-6s %14s %14s %7sx  target >= 0.90x: %s\n' "$round" "$replay_rate" "$floor_rate" "$ratio" "${verdict/_/ }"
done
rm -f "$request"
