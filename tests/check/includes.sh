#!/usr/bin/env bash
# No source file #includes a .c file: shared code is a library (src/ for
# libapiary, testing/ for what tests and benchmarks share).
# usage: tests/check/includes.sh SOURCE_DIR
set -u
cd "$1" || exit 1
hits=$(grep -rn -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"][^>"]*\.c[>"]' \
         --include='*.c' --include='*.h' src include tests testing bench tools fuzz examples 2>/dev/null)
if [ -n "$hits" ]; then
  echo "FAIL: #include of a .c file:"; echo "$hits"; exit 1
fi
echo "includes ok: no .c file is included"
