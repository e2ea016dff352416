#!/usr/bin/env bash
# Fails if any tracked C file differs from the repo's .clang-format style.
set -u
cd "$1" || exit 1
if ! command -v clang-format >/dev/null 2>&1; then
  echo "clang-format not installed; skipping"; exit 0
fi
files=$(git ls-files '*.c' '*.h' 2>/dev/null)
[ -n "$files" ] || { echo "not a git checkout; skipping"; exit 0; }
# shellcheck disable=SC2086
clang-format --dry-run --Werror $files && echo "format ok: $(echo "$files" | wc -l) files"
