#!/usr/bin/env bash
# Every name a public header declares carries the header's prefix: the
# functions, types, enum constants and macros of include/apiary/X.h are
# ap_X_* / AP_X_* (and the type ap_X_t). The table below lists the few
# headers that also hold another family of names, with the reason.
# usage: tests/check/prefixes.sh SOURCE_DIR
set -u
cd "$1" || exit 1
extra() {
  case "$1" in
    common) echo "ap_version AP_VERSION AP_EXPORT AP_NODISCARD AP_PRINTF" ;; # the library's own macros
    error) echo "ap_strerror ap_errno ap_err AP_E AP_OK AP__" ;; # error codes: AP_E*
    log) echo "ap_debug ap_info ap_warn ap_error" ;;             # the logging macros
    # the runtime's objects and callback types
    runtime) echo "ap_rt ap_stream ap_rpc ap_peer_event ap_peer_fn ap_timer ap_work ap_after ap_post ap_dial ap_iovec AP_RT AP_STREAM AP_PEER" ;;
    compress) echo "ap_codec ap_tensor AP_CODEC AP_ROLE" ;;      # the codecs the compressor applies
    multiaddr) echo "ap_ma AP_MA ap_uv_loop_t" ;;                # the type's short name; libuv's loop type
    peer) echo "AP_ED25519" ;;                                   # the sizes of a peer's Ed25519 keys
    *) ;;
  esac
}
fail=0; n=0
for h in include/apiary/*.h; do
  x=$(basename "$h" .h)
  [ "$x" = apiary ] && continue
  n=$((n + 1))
  X=$(printf '%s' "$x" | tr a-z A-Z)
  allowed="ap_${x} AP_${X} $(extra "$x")"
  names=$(awk '
    /^#define [A-Z_0-9]+/ { if ($2 !~ /^APIARY_/) { sub(/\(.*/, "", $2); print $2 } }
    /^AP_EXPORT/ { s = $0; sub(/\(.*/, "", s); k = split(s, w, /[^A-Za-z0-9_]+/);
                  for (i = k; i > 0; i--) if (w[i] != "") { print w[i]; break } }
    /^} *[a-z_0-9]+;/ { s = $0; gsub(/[} ;]/, "", s); print s }
    /^typedef [^(]*[a-z_0-9]+;/ { s = $0; sub(/;.*/, "", s); k = split(s, w, /[^A-Za-z0-9_]+/); print w[k] }
    /^typedef .*\(\*[a-z_0-9]+\)/ { s = $0; sub(/^[^(]*\(\*/, "", s); sub(/\).*/, "", s); print s }
    /^ +AP_[A-Z0-9_]+( =|,)/ { s = $1; sub(/,$/, "", s); print s }
  ' "$h" | sort -u)
  for nm in $names; do
    ok=0
    for p in $allowed; do
      case "$nm" in "$p" | "${p}_"* | "${p}"[A-Z0-9]* ) ok=1; break ;; esac
    done
    [ "$ok" = 1 ] || { echo "FAIL: $h declares $nm (expected the prefix ap_${x}_ / AP_${X}_)"; fail=1; }
  done
done
[ "$n" -gt 0 ] || { echo "no headers found under include/apiary"; exit 1; }
[ "$fail" = 0 ] && echo "prefixes ok: $n headers"
exit "$fail"
