#!/usr/bin/env bash
# Smoke test of the CLI surface: help, version, error exits.
set -u
cli=$1
fail=0
check() { # expected-exit description command...
  local want=$1 what=$2; shift 2
  "$@" >/tmp/apiary-cli-smoke.$$ 2>&1
  local got=$?
  if [ "$got" != "$want" ]; then
    echo "FAIL: $what: exit $got, want $want"; cat /tmp/apiary-cli-smoke.$$; fail=1
  else
    echo "ok: $what"
  fi
}
# expected-exit description pattern command...: also the output must contain pattern
checkmsg() {
  local want=$1 what=$2 pat=$3; shift 3
  check "$want" "$what" "$@"
  grep -qF -- "$pat" /tmp/apiary-cli-smoke.$$ || { echo "FAIL: $what: no '$pat' in:"; cat /tmp/apiary-cli-smoke.$$; fail=1; }
}
check 0 "--help" "$cli" --help
check 0 "--version" "$cli" --version
check 2 "no arguments" "$cli"
check 2 "unknown command" "$cli" no-such-command
check 0 "bench --help" "$cli" bench --help
check 2 "unknown bench" "$cli" bench no-such-bench
check 0 "dht --help" "$cli" dht --help
check 2 "dht get without --initial-peers" "$cli" dht get somekey
check 2 "dht store without --ttl" "$cli" dht store k v --initial-peers /ip4/127.0.0.1/tcp/1
idtmp=$(mktemp -d)
check 0 "identity (creates the key)" "$cli" identity --identity "$idtmp/k.key"
[ "$(stat -c %a "$idtmp/k.key")" = 600 ] || { echo "FAIL: key file mode"; fail=1; }
[ "$("$cli" identity --identity "$idtmp/k.key")" = "$("$cli" identity --identity "$idtmp/k.key")" ] || { echo "FAIL: identity not stable"; fail=1; }
chmod 644 "$idtmp/k.key"
check 1 "identity refuses a readable key" "$cli" identity --identity "$idtmp/k.key"
check 2 "identity bad --addr" "$cli" identity --identity "$idtmp/k2.key" --addr nonsense
rm -rf "$idtmp"
check 0 "train --help" "$cli" train --help
check 2 "train bad --model" "$cli" train --model nosuch
check 2 "train unknown --compression" "$cli" train --compression zip
check 2 "train --client with --auxiliary" "$cli" train --client --auxiliary
check 2 "train bad --bandwidth" "$cli" train --bandwidth fast
check 2 "train --batch-size not a number" "$cli" train --batch-size 8x
check 2 "train --lr not a number" "$cli" train --lr abc
check 2 "train --target-batch-size negative" "$cli" train --target-batch-size -5
check 2 "train --seed overflowing" "$cli" train --seed 99999999999999999999999
checkmsg 2 "train --model lists the choices" "the choices are gpt" "$cli" train --model nosuch
checkmsg 2 "train --lr nan" "--lr needs a number" "$cli" train --lr nan
checkmsg 2 "train --lr inf" "--lr needs a number" "$cli" train --lr inf
checkmsg 2 "train --initial-peers not a multiaddr" "expected /ip4/ADDRESS/tcp/PORT/p2p/PEERID" "$cli" train --initial-peers nonsense
checkmsg 2 "train --initial-peers without /p2p/" "expected /ip4/ADDRESS/tcp/PORT/p2p/PEERID" "$cli" train --initial-peers /ip4/127.0.0.1/tcp/1
checkmsg 1 "train --listen malformed" "expected /ip4/ADDRESS/tcp/PORT" "$cli" train --model mlp --listen /ip4/300.1.1.1/tcp/5
checkmsg 2 "train --fresh without --checkpoint-dir" "--fresh needs --checkpoint-dir" "$cli" train --fresh
checkmsg 2 "train stray argument" "unexpected argument 'oops'" "$cli" train oops
checkmsg 2 "train --data-shard with gpt" "--data-shard is for --model mlp" "$cli" train --data-shard 0/2
# a port another process listens on: "address already in use"
if command -v python3 >/dev/null; then
  pyout=$(mktemp)
  python3 -c 'import socket,time,sys
s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(1)
print(s.getsockname()[1], flush=True); time.sleep(20)' >"$pyout" &
  pypid=$!
  for _ in $(seq 50); do [ -s "$pyout" ] && break; sleep 0.1; done
  port=$(head -1 "$pyout")
  checkmsg 1 "train --listen on a busy port" "address already in use" "$cli" train --model mlp --listen "/ip4/127.0.0.1/tcp/$port"
  kill "$pypid" 2>/dev/null; wait "$pypid" 2>/dev/null; rm -f "$pyout"
else
  echo "skip: train --listen on a busy port (no python3)"
fi
check 2 "nn-train --layers negative" "$cli" nn-train --layers -3
check 2 "dht --stats-interval 0" "$cli" dht --stats-interval 0
check 2 "demo --duration not a number" "$cli" demo --duration 1e
check 0 "demo --help" "$cli" demo --help
check 2 "demo too short" "$cli" demo --duration 5
"$cli" --version | grep -q '^apiary [0-9]' || { echo "FAIL: version text"; fail=1; }
rm -f /tmp/apiary-cli-smoke.$$
exit $fail
