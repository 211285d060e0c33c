# Sourced by replay.sh and cycles.sh: the two servers they compare, built
# and started alike, and the request that replays one finished key.
#
# examples/http.rs answers it with the engine (MariaDB and Redis);
# benches/http/floor.rs is the floor, a plain axum handler with one HGET.

export IDEM_MYSQL_URL=${IDEM_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
export IDEM_REDIS_URL=${IDEM_REDIS_URL:-redis://127.0.0.1:6379}

# Builds both in release and sets `example` and `floor` to their binaries.
build_servers() {
  cargo build --quiet --release --features axum,mysql,postgres,redis,sqlite --example http --example http_floor
  local target
  target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  example="$target/release/examples/http"
  floor="$target/release/examples/http_floor"
}

# Fails when something answers on `port` already: an earlier run's server
# would be measured in place of the one about to start.
ensure_free() {
  if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
    echo "port $1 is taken (a server of an earlier run?)" >&2
    return 1
  fi
}

# Waits until something answers on `port` (tries, 0.1 s apart: $2, default 200).
await_port() {
  local port=$1 tries=${2:-200}
  for _ in $(seq 1 "$tries"); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing answers on port $port" >&2
  return 1
}

# Pays order 42 on the example at `port` under a fresh key, checks that the
# same call again is a replay, and writes to `file` the wrk script that
# sends that call: every request it sends is a replay.
replay_request() {
  local port=$1 file=$2 key first replayed
  key="bench-replay-$(date +%s%N)"
  cat >"$file" <<LUA
wrk.method = "POST"
wrk.body = '{"amount":1999}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-User-Id"] = "alice"
wrk.headers["Idempotency-Key"] = "$key"
LUA
  local call=(curl -s -X POST "localhost:$port/orders/42/pay" -H 'X-User-Id: alice'
    -H "Idempotency-Key: $key" -H 'Content-Type: application/json' -d '{"amount":1999}')
  first=$("${call[@]}" -o /dev/null -w '%{http_code}')
  [ "$first" = 200 ] || { echo "the first call answered $first" >&2; return 1; }
  replayed=$("${call[@]}" -D - -o /dev/null | tr -d '\r' | grep -ci '^idempotent-replayed: true' || true)
  [ "$replayed" = 1 ] || { echo "the second call was not a replay" >&2; return 1; }
}
