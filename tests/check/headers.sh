#!/usr/bin/env bash
# Every public header compiles on its own, as C11 and as C++.
# usage: tests/check/headers.sh SOURCE_DIR C_COMPILER [CXX_COMPILER]
set -u
src=$1; cc=$2; cxx=${3:-}
cd "$src" || exit 1
fail=0; n=0
for h in include/apiary/*.h; do
  name=${h#include/}
  n=$((n + 1))
  if ! printf '#include <%s>\nint ap__header_check_%d;\n' "$name" "$n" |
      "$cc" -std=c11 -Wall -Wextra -Werror -Wstrict-prototypes -pedantic -Iinclude \
            -fsyntax-only -x c -; then
    echo "FAIL (C): $name"; fail=1
  fi
  if [ -n "$cxx" ]; then
    if ! printf '#include <%s>\nint ap__header_check_%d;\n' "$name" "$n" |
        "$cxx" -std=c++17 -Wall -Wextra -Werror -Iinclude -fsyntax-only -x c++ -; then
      echo "FAIL (C++): $name"; fail=1
    fi
  fi
done
if [ -z "$cxx" ]; then echo "no C++ compiler found: C++ half skipped"; fi
[ "$n" -gt 0 ] || { echo "no headers found under include/apiary"; exit 1; }
[ "$fail" = 0 ] && echo "headers ok: $n headers, C${cxx:+ and C++}"
exit "$fail"
