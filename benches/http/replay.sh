#!/usr/bin/env bash
# An HTTP replay against its floor, side by side in one run: examples/http.rs
# (MariaDB and Redis) answering one finished Idempotency-Key again and again,
# and benches/http/floor.rs, a plain axum handler answering one Redis HGET's
# JSON. Both built in release, both driven by wrk with the same request (32
# connections, one wrk thread, so the servers keep a core). A round gives
# each server the same time in short slices taken in turn (ABBA...), so a
# drift of the machine's speed during the round (on a shared VM the rates
# move by a tenth within a minute) falls on both alike. Prints one line per
# round, as the overhead bench prints its targets: the server's CPU time per
# request (user + system, from /proc) over the floor's (target: <= 1.25),
# met or not met, then as figures each one's CPU per request, the ratio of
# the rates and both rates. The CPU is what a replay costs the machine; the
# rates follow it only as far as the two cores wrk, Redis and MariaDB share
# with the servers leave them.
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
source benches/http/servers.sh
build_servers

ensure_free 3100
ensure_free 3101
pids=()
request=$(mktemp)
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -f "$request"' EXIT
IDEM_HTTP_ADDR=127.0.0.1:3100 "$example" >/dev/null &
pids+=($!)
IDEM_HTTP_ADDR=127.0.0.1:3101 "$floor" >/dev/null &
pids+=($!)
await_port 3100
await_port 3101
replay_request 3100 "$request"

# Requests answered in one slice of `slice` seconds.
slice=$(( seconds / slices > 0 ? seconds / slices : 1 ))
served() { wrk -t1 -c32 -d"${slice}s" -s "$request" "http://127.0.0.1:$1/orders/42/pay" | awk '/requests in/ {print $1}'; }
# A server's CPU time so far, in clock ticks (user + system).
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# One slice of the server on `port` (process `pid`): adds its requests and ticks.
slice_of() {
  local port=$1 pid=$2 before n
  before=$(ticks "$pid")
  n=$(served "$port")
  echo "$n $(($(ticks "$pid") - before))"
}
hz=$(getconf CLK_TCK)
for round in $(seq 1 "$rounds"); do
  replay=0 floor=0 replay_ticks=0 floor_ticks=0
  for s in $(seq 1 "$slices"); do
    # ABBA: each server first in every other slice.
    for which in $( [ $(((round + s) % 2)) = 0 ] && echo "replay floor" || echo "floor replay"); do
      if [ "$which" = replay ]; then
        read -r n t < <(slice_of 3100 "${pids[0]}"); replay=$((replay + n)) replay_ticks=$((replay_ticks + t))
      else
        read -r n t < <(slice_of 3101 "${pids[1]}"); floor=$((floor + n)) floor_ticks=$((floor_ticks + t))
      fi
    done
  done
  python3 -c "
t = $slices * $slice; r = $replay / $floor
cpu = lambda ticks, n: ticks / $hz / n * 1e6
c = cpu($replay_ticks, $replay) / cpu($floor_ticks, $floor)
print(f'target HTTP replay CPU per request / a plain axum handler with one HGET, mariadb, round $round: {c:.2f}x (<= 1.25x)',
      'met' if c <= 1.25 else 'NOT met',
      f'| CPU per request {cpu($replay_ticks, $replay):.1f} vs {cpu($floor_ticks, $floor):.1f} us',
      f'| rate {r:.2f}x: req/s {$replay / t:.0f} vs {$floor / t:.0f}')"
done
