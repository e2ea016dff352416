#!/usr/bin/env bash
# No .c file in src/ over 1,000 lines, unless docs/architecture.md lists it
# with a reason in its "Files over 1,000 lines" section, as table rows
#   | `src/path/file.c` | reason |
# A listed file that is no longer over the limit fails too (stale entry).
# usage: tests/check/file_size.sh SOURCE_DIR
set -u
cd "$1" || exit 1
limit=1000
doc=docs/architecture.md
[ -r "$doc" ] || { echo "cannot read $doc"; exit 1; }
listed=$(awk '/^## /{ on = ($0 ~ /^## Files over 1,000 lines/) ; next }
              on && /^\| *`src\// { split($0, f, "`"); print f[2] }' "$doc")
fail=0; over=0
while IFS= read -r f; do
  lines=$(wc -l < "$f")
  if [ "$lines" -gt "$limit" ]; then
    over=$((over + 1))
    if ! printf '%s\n' "$listed" | grep -qxF "$f"; then
      echo "FAIL: $f has $lines lines (> $limit) and is not listed in $doc"; fail=1
    fi
  fi
done < <(find src -name '*.c' | sort)
while IFS= read -r f; do
  [ -n "$f" ] || continue
  if [ ! -f "$f" ]; then
    echo "FAIL: $doc lists $f, which does not exist"; fail=1
  elif [ "$(wc -l < "$f")" -le "$limit" ]; then
    echo "FAIL: $doc lists $f, which is now $(wc -l < "$f") lines: remove the entry"; fail=1
  fi
done <<< "$listed"
[ "$fail" = 0 ] && echo "file sizes ok: $over file(s) over $limit lines, each listed with a reason"
exit "$fail"
