#!/usr/bin/env bash
# Runs the Python package's pytest tests against this build.
# usage: run.sh SOURCE_DIR LIBAPIARY APIARY_CLI [pytest args...]
# Exits 77 (ctest: skipped) with the reason when Debian's Python lacks pytest
# or msgpack; tests that need torch skip themselves without it.
set -u
src=$(realpath "$1") lib=$(realpath "$2") cli=$(realpath "$3")
shift 3
PY=${APIARY_PYTHON:-/usr/bin/python3}
if ! [ -x "$PY" ]; then echo "SKIP: $PY not found"; exit 77; fi
for m in pytest msgpack; do
  if ! "$PY" -c "import $m" 2>/dev/null; then
    echo "SKIP: $PY has no module $m (install python3-$m: scripts/deps.sh)"; exit 77
  fi
done
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "NOTE: $PY has no torch (python3-torch): the Optimizer and averager tests skip"
fi
export APIARY_LIB=$lib APIARY_BIN=$cli PYTHONPATH="$src/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
cd "$src/tests/python" || exit 1
exec "$PY" -m pytest -q -p no:cacheprovider "$@" .
