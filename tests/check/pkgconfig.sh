#!/usr/bin/env bash
# A program compiled against the build tree with nothing but
# `pkg-config --cflags --libs apiary` (PKG_CONFIG_PATH = the build dir, which
# holds apiary-uninstalled.pc) builds and runs without LD_LIBRARY_PATH.
# usage: tests/check/pkgconfig.sh SOURCE_DIR BUILD_DIR C_COMPILER
set -u
src=$1; build=$2; cc=$3
command -v pkg-config >/dev/null || { echo "pkg-config not installed: skipped"; exit 0; }
flags=$(PKG_CONFIG_PATH="$build" pkg-config --cflags --libs apiary) || {
  echo "FAIL: pkg-config cannot find apiary in $build"; exit 1; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror -Wno-unused-parameter -o "$tmp/node" \
  "$src/examples/node.c" $flags || { echo "FAIL: cannot compile examples/node.c with: $flags"; exit 1; }
env -u LD_LIBRARY_PATH "$tmp/node" || { echo "FAIL: the program did not run"; exit 1; }
echo "pkg-config ok: $flags"
