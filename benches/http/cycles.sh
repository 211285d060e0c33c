#!/usr/bin/env bash
# An HTTP replay beside its floor, counted instead of timed: the two servers
# replay.sh compares (benches/http/servers.sh), each run under callgrind with
# its cache and branch simulation (32 KiB L1 caches), counted from after a
# warm-up while `wrk -c4` replays one finished key for a few seconds. Prints,
# per request, for the example, the floor and their difference: the
# instructions, the L1 instruction misses, the L1 data misses (read / write)
# and the mispredicted branches (conditional / indirect); then the engine's
# functions that hold most of the example's instructions (inclusive).
#
# Counts, not seconds: they repeat on a busy machine, where the rates of
# replay.sh move. What they cannot show: valgrind hides the CPU's SHA
# extensions, so SHA-256 runs in software here (about 10 000 of a replay's
# instructions, a few hundred cycles on the machine), and one simulated CPU
# sees no cache line moving between cores. docs/performance.md, "An HTTP
# replay's cycles", weighs these counts.
#
#   benches/http/cycles.sh [seconds counted per server, default 5]
#
# Needs valgrind and wrk (apt-get install valgrind wrk), MariaDB and Redis.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-5}
for tool in valgrind callgrind_control callgrind_annotate wrk; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install valgrind wrk)" >&2; exit 1; }
done
source benches/http/servers.sh
build_servers

out=$(mktemp -d)
pid=
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi; rm -rf "$out"' EXIT

# Counts `name`'s server (`binary`, on `port`) per request into $out/name.
count() {
  local name=$1 binary=$2 port=$3 request=$out/replay.lua
  ensure_free "$port"
  IDEM_HTTP_ADDR=127.0.0.1:$port valgrind --tool=callgrind --instr-atstart=no --cache-sim=yes --branch-sim=yes \
    --callgrind-out-file="$out/$name.cg" "$binary" >/dev/null 2>"$out/$name.log" &
  pid=$!
  await_port "$port" 600 || { cat "$out/$name.log" >&2; return 1; }
  # The key is paid on the example; the floor reads the same request.
  if [ "$name" = example ]; then replay_request "$port" "$request"; fi
  # Warm-up uncounted: connections, pools and caches settle first.
  wrk -t1 -c4 -d2s -s "$request" "http://127.0.0.1:$port/orders/42/pay" >/dev/null
  callgrind_control -i on "$pid" >/dev/null 2>&1
  wrk -t1 -c4 -d"${seconds}s" -s "$request" "http://127.0.0.1:$port/orders/42/pay" | awk '/requests in/ {print $1}' >"$out/$name.n"
  callgrind_control -d "$pid" >/dev/null 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  pid=
}
count example "$example" 3110
count floor "$floor" 3111

python3 - "$out" <<'PY'
import glob, re, subprocess, sys
out = sys.argv[1]

def per_request(name):
    n = int(open(f"{out}/{name}.n").read())
    (dump,) = glob.glob(f"{out}/{name}.cg.*")
    lines = open(dump).read().splitlines()
    events = next(l for l in lines if l.startswith("events:")).split()[1:]
    summary = next(l for l in lines if l.startswith("summary:")).split()[1:]
    return n, dump, {e: int(v) / n for e, v in zip(events, summary)}

(ne, dump, e), (nf, _, f) = per_request("example"), per_request("floor")
print(f"per HTTP replay (callgrind: {ne} requests of the example, {nf} of the floor)")
rows = [("instructions", ("Ir",)), ("L1i misses", ("I1mr",)), ("L1d misses (read / write)", ("D1mr", "D1mw")),
        ("mispredicted branches (cond / ind)", ("Bcm", "Bim"))]
print(f"  {'':36} {'example':>15} {'floor':>15} {'difference':>15}")
for label, keys in rows:
    cell = lambda d: " / ".join(f"{d[k]:.0f}" for k in keys)
    diff = " / ".join(f"{e[k] - f[k]:+.0f}" for k in keys)
    print(f"  {label:36} {cell(e):>15} {cell(f):>15} {diff:>15}")

print("the engine's functions in the example, inclusive instructions per request:")
shown = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--show=Ir", dump],
                       capture_output=True, text=True).stdout.splitlines()
# The replay marker's future and `poll_observed` wrap the whole router: left out.
wrappers = ("ReplayHeaderFuture", "poll_observed")
picked = 0
for line in shown:
    m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(?:\?\?\?:)?(.*?)(?: \[.*)?$", line)
    if not m or "idempotency" not in m[2] or any(w in m[2] for w in wrappers):
        continue
    print(f"  {int(m[1].replace(',', '')) / ne:8.0f}  {m[2][:110]}")
    picked += 1
    if picked == 12:
        break
PY
