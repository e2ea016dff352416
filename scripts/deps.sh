#!/usr/bin/env bash
# Install the Debian packages Apiary needs to build, test and fuzz.
# Idempotent: it runs apt-get only when something is missing.
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config git
  clang llvm libclang-rt-14-dev clang-format
  libuv1-dev            # event loop, TCP, timers, thread wake-ups
  libsodium-dev         # Ed25519, X25519, BLAKE2b, SHA-256, ChaCha20-Poly1305 (fallback)
  libssl-dev            # ChaCha20-Poly1305 for bulk traffic (libcrypto: ~3x libsodium's here)
  libprotobuf-c-dev protobuf-c-compiler  # wire messages
  liblpsolve55-dev      # linear program for bandwidth-aware load balancing
  libopenblas-dev       # sgemm for the model kit
  libcmocka-dev         # unit tests
  libhttp-parser-dev    # HTTP request parsing for the run monitor's dashboard (MIT, Node's old parser)
  iproute2              # network namespaces for shaped-link tests
  nftables              # tests only: the conntrack NAT routers of the NAT traversal tests (testing/natns.c)
  miniupnpd             # tests only: a UPnP IGD / NAT-PMP gateway in a router namespace
  libminiupnpc-dev      # UPnP IGD port mapping on the home router (BSD)
  libnatpmp-dev         # NAT-PMP port mapping on the home router (BSD)
  python3-msgpack       # the apiary Python package: DHT values (hivemind serialises with msgpack)
  python3-pytest        # tests only: the Python package's tests
  python3-torch         # the Python package's Optimizer/averager and examples/pytorch (tests skip without)
  chromium-headless-shell  # tests only: opens the monitor's page (tests skip, saying so, without it)
  nodejs                # tests only: the js-libp2p peer of the libp2p interop tests
)
# npm installs that peer's pinned packages (tests/interop/js); Debian ships it
# apart from nodejs, other nodejs builds include it.
if ! command -v npm >/dev/null 2>&1; then PKGS+=(npm); fi
if [ -n "${APIARY_EXTRA_PKGS:-}" ]; then
  # shellcheck disable=SC2206
  PKGS+=(${APIARY_EXTRA_PKGS})
fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "deps: missing packages (${missing[*]}) and not root; run as root or install them" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
