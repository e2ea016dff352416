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
check 2 "nn-train --layers negative" "$cli" nn-train --layers -3
check 2 "dht --stats-interval 0" "$cli" dht --stats-interval 0
check 2 "demo --duration not a number" "$cli" demo --duration 1e
check 0 "demo --help" "$cli" demo --help
check 2 "demo too short" "$cli" demo --duration 5
"$cli" --version | grep -q '^apiary [0-9]' || { echo "FAIL: version text"; fail=1; }
rm -f /tmp/apiary-cli-smoke.$$
exit $fail
