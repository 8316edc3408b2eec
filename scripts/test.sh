#!/usr/bin/env bash
# Set up everything the test suite needs and run it: the command the README shows and CI runs.
# Idempotent: a second run reuses the virtual environment in .venv, and installs again only when
# what it was installed from changed (NBACCEL_REINSTALL=1 forces it).
set -euo pipefail
cd "$(dirname "$0")/.."

# What .venv was installed from: the package's requirements, the pins and the interpreter. The
# stamp lives inside .venv, so a missing or deleted venv is always installed from scratch.
stamp=.venv/.nbaccel-installed-from
wanted="$(python3 -c 'import sys; print(sys.version)'; sha256sum pyproject.toml constraints.txt)"
if [ -n "${NBACCEL_REINSTALL:-}" ] || [ ! -x .venv/bin/python ] || [ ! -f "$stamp" ] \
   || [ "$(cat "$stamp")" != "$wanted" ]; then
  rm -f "$stamp"  # an install that fails half-way is redone next time
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  # constraints.txt pins torch 2.13.0 (the CPU build where a CPU wheel is what pip finds).
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
  printf '%s\n' "$wanted" >"$stamp"
else
  echo "note: .venv is up to date with pyproject.toml and constraints.txt; not reinstalling (NBACCEL_REINSTALL=1 forces it)"
fi

# The browser test drives Debian's Chromium; install it where we may (root, apt available).
if [ -n "${NBACCEL_BROWSER_DEPS:-1}" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: chromium is not installed and cannot be installed here; the browser test will be skipped"
  fi
fi

# DeepSpeed's NVMe offload swaps through its async_io op, built against Debian's libaio-dev.
# NBACCEL_NVME_DEPS=1 installs it where we may and builds the op, so tests/test_deepspeed_nvme.py
# trains instead of skipping. Off by default: torch builds the op again for every new .venv path
# (its build key holds the venv's include paths), ~3 min of compiling on this 2-core machine,
# which a fresh CI clone would pay on every run.
if [ -n "${NBACCEL_NVME_DEPS:-}" ] && [ ! -e /usr/include/libaio.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null
  else
    echo "note: libaio-dev is not installed and cannot be installed here; the NVMe offload training test will be skipped"
  fi
fi
if [ -n "${NBACCEL_NVME_DEPS:-}" ] && [ -e /usr/include/libaio.h ] && [ ! -e .venv/.nbaccel-aio-ready ]; then
  echo "note: building DeepSpeed's async_io op (once; minutes on a small machine)"
  .venv/bin/python -c "import sys; from nbaccel.training.nvme_offload import aio_op_problem as p; r = p(); print('note:', r) if r else None; sys.exit(1 if r else 0)" 2>/dev/null \
    && touch .venv/.nbaccel-aio-ready
fi

# The multi-host tests make hosts as network namespaces (`ip netns`, iproute2; needs root).
if ! command -v ip >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
  else
    echo "note: iproute2 is not installed and cannot be installed here; the multi-host tests will be skipped"
  fi
fi

# Two workers (pytest-xdist), whole files each (tests/conftest.py groups the files that share
# something machine-wide): about a third off the suite's time on a 2-core machine, where rank
# processes and kernels spend much of a test waiting. NBACCEL_TEST_WORKERS=0 runs it serially.
workers="${NBACCEL_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
  pytest=(.venv/bin/python -m pytest)
else
  # A worker that crashes (a test that kills its own process) fails the run at once: xdist's
  # replacement worker can leave a file-scheduled run waiting for ever.
  pytest=(.venv/bin/python -m pytest -n "$workers" --dist loadfile --max-worker-restart 0)
fi
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"  # the tests asked for, on this Python only
fi

# The whole suite: on this Python (3.11), then CI's subset on Colab's Python, 3.12
# (scripts/test_pythons.sh: its venv lives outside the clone, is built on the first run, ~6 GB
# with PyPI's torch, and reused after). NBACCEL_OTHER_PYTHONS="" leaves it out, "3.10 3.12"
# adds one.
status=0
"${pytest[@]}" || status=$?
others="${NBACCEL_OTHER_PYTHONS-3.12}"
if [ -n "$others" ]; then
  # Where pyenv lacks the Python it is a note, except in CI (CI=true, as CI sets it) or where
  # NBACCEL_REQUIRE_PYTHONS=1: there a missing 3.12 fails the run.
  found=--if-found
  [ "${NBACCEL_REQUIRE_PYTHONS:-}" != 1 ] && [ "${CI:-}" != true ] || found=""
  # shellcheck disable=SC2086 # one word per Python; $found may be empty
  bash scripts/test_pythons.sh --ci $found $others || status=1
fi
exit $status
