#!/usr/bin/env bash
# Every C snippet in README.md and docs/*.md is a file under examples/ (which
# builds and runs as a ctest test), quoted whole after a marker line:
#   <!-- example: examples/NAME.c -->
#   ```c
#   ...the file, verbatim...
#   ```
# Fails on a quote that differs from its file and on a ```c block without a
# marker. With --write, rewrites each quoted block from its file instead.
# usage: tests/check/doc_examples.sh SOURCE_DIR [--write]
set -u
cd "$1" || exit 1
write=${2:-}
fail=0; quoted=0
for doc in README.md docs/*.md; do
  [ -f "$doc" ] || continue
  out=$(mktemp)
  # awk prints the document with every marked block replaced by its file;
  # unmarked C blocks and missing files are reported on stderr as FAIL lines.
  awk -v doc="$doc" '
    function emit_file(path,   line, ok) {
      ok = 0
      while ((getline line < path) > 0) { print line; ok = 1 }
      close(path)
      if (!ok) { print "FAIL: " doc ": " path " is missing or empty" > "/dev/stderr"; bad = 1 }
    }
    state == 0 && /^<!-- example: [^ ]+ -->$/ { print; file = $3; state = 1; next }
    state == 1 {
      if ($0 == "```c") { print; emit_file(file); state = 2; n++; next }
      print "FAIL: " doc ":" NR ": marker for " file " not followed by a ```c block" > "/dev/stderr"
      bad = 1; state = 0
    }
    state == 2 { if ($0 == "```") { print; state = 0 } ; next }
    /^```c[[:space:]]*$/ {
      print "FAIL: " doc ":" NR ": C snippet without an <!-- example: examples/... --> marker" > "/dev/stderr"
      bad = 1
    }
    { print }
    END { if (state == 2) { print "FAIL: " doc ": unterminated quote of " file > "/dev/stderr"; bad = 1 }
          print n + 0 > "/dev/fd/3"; exit bad }
  ' "$doc" > "$out" 3> "$out.n" || fail=1
  quoted=$((quoted + $(cat "$out.n")))
  if ! cmp -s "$doc" "$out"; then
    if [ "$write" = "--write" ]; then
      cp "$out" "$doc"; echo "rewrote $doc"
    else
      echo "FAIL: $doc quotes an example that differs from its file (run $0 . --write):"
      diff -u "$doc" "$out" | head -20
      fail=1
    fi
  fi
  rm -f "$out" "$out.n"
done
[ "$fail" = 0 ] && echo "doc examples ok: $quoted quoted, every C snippet is an example"
exit "$fail"
