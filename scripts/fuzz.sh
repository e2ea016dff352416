#!/usr/bin/env bash
# Run every fuzz target for N seconds on a copy of its seed corpus.
# usage: scripts/fuzz.sh BUILD_DIR SECONDS [TARGET...]
set -euo pipefail
build=$1; secs=$2; shift 2
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in fuzz/fuzz_*.c; do [ -e "$f" ] && targets+=("$(basename "$f" .c)"); done
fi
mkdir -p fuzz/out
for t in "${targets[@]}"; do
  corpus=fuzz/corpus/${t#fuzz_}
  work=fuzz/out/$t
  mkdir -p "$work"
  [ -d "$corpus" ] && cp -n "$corpus"/* "$work"/ 2>/dev/null || true
  echo "== $t for ${secs}s"
  "$build/$t" -max_total_time="$secs" -print_final_stats=1 "$work" 2>&1 | tail -n 12
done
