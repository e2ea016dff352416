#!/usr/bin/env bash
# Nothing in the build, tests, benchmarks, fuzz targets or scripts refers to a
# path outside the checkout. Checks every tracked file except docs/.
# usage: tests/check/self_contained.sh SOURCE_DIR
set -u
cd "$1" || exit 1
self=tests/check/self_contained.sh
if files=$(git ls-files 2>/dev/null) && [ -n "$files" ]; then :; else
  files=$(find . -type f -not -path './.git/*' -not -path './build*' | sed 's#^\./##')
fi
# (bracketed letters: the same regex, without this line spelling the paths it forbids)
pattern='\.\./[s]hared|/work/|APIARY_[S]HARED|\$\{CMAKE_SOURCE_DIR\}/\.\.|testvector[s]'
hits=$(printf '%s\n' "$files" | grep -v -e '^docs/' -e "^$self\$" |
       tr '\n' '\0' | xargs -0 grep -n -I -E "$pattern" 2>/dev/null)
if [ -n "$hits" ]; then
  echo "FAIL: references to paths outside the checkout:"; echo "$hits"; exit 1
fi
echo "self-contained: $(printf '%s\n' "$files" | wc -l) files checked"
