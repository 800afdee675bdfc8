#!/usr/bin/env bash
# Installs what trainmem needs from Debian packages, and nothing else (no vendored code, no downloads).
# Idempotent: packages already installed are skipped, and apt-get runs only when something is missing.
set -euo pipefail

PACKAGES=(
  cmake make g++ pkg-config      # build
  nlohmann-json3-dev             # config.json parsing (src/config)
  libcli11-dev                   # command line (tools/trainmem)
  libfmt-dev                     # formatting (src/report)
  libgtest-dev libgmock-dev      # unit tests (tests/)
  libbenchmark-dev               # benchmarks (bench/)
  python3 python3-torch          # the CPU oracle (validate/cpu)
  clang libclang-rt-14-dev       # make fuzz: libFuzzer and clang's sanitizer runtimes (fuzz/)
  llvm                           # llvm-symbolizer: file:line in the sanitizers' reports
  pybind11-dev python3-dev       # the Python module trainmem (python/), built for the system python3
  python3-pytest                 # the Python module's tests (python/tests), run by ctest
  emscripten                     # make web: the library compiled to WebAssembly for the web page (web/)
  chromium python3-websocket     # the web page's test: headless Chromium over its DevTools protocol (tests/web)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
