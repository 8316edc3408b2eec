#!/usr/bin/env bash
# Set up everything the test suite needs and run it: the command the README shows and CI runs.
# Idempotent: a second run reuses the virtual environment in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# constraints.txt pins the CPU build of torch, so no multi-GB CUDA build is pulled.
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"

# The browser test drives Debian's Chromium; install it where we may (root, apt available).
if [ -n "${NBACCEL_BROWSER_DEPS:-1}" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: chromium is not installed and cannot be installed here; the browser test will be skipped"
  fi
fi

# The multi-host tests make hosts as network namespaces (`ip netns`, iproute2; needs root).
if ! command -v ip >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
  else
    echo "note: iproute2 is not installed and cannot be installed here; the multi-host tests will be skipped"
  fi
fi

exec .venv/bin/python -m pytest "$@"
