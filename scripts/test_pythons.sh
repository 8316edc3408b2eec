#!/usr/bin/env bash
# Run nbaccel's tests on the other Pythons the project claims (requires-python >=3.10): 3.10,
# 3.12 (Colab's) and 3.13, each found under pyenv ($(pyenv root)/versions/3.1x.y).
#
#   bash scripts/test_pythons.sh                 # 3.10, 3.12, 3.13: the fast layer + the kernel tests
#   bash scripts/test_pythons.sh 3.12            # one Python
#   bash scripts/test_pythons.sh --ci 3.12       # CI's subset (scripts/test.sh runs it last)
#   bash scripts/test_pythons.sh --if-found ...  # a Python not installed is a note, not a failure
#   bash scripts/test_pythons.sh 3.12 -- tests/test_units.py -q   # other pytest arguments
#
# Each Python gets one virtual environment, OUTSIDE the clone (PyPI's torch for these Pythons is
# a CUDA build, ~6 GB in the venv; it runs on the CPU here): $NBACCEL_VENVS (default
# ~/.cache/nbaccel)/venv-3.12. It is built once and reused by every clone on the machine. Its
# stamp (.nbaccel-built) holds a hash of the pins (the interpreter's version, constraints.txt's
# lines, pyproject.toml's requirements): when they change, pip installs again into it, which
# changes only what the pins changed; a build interrupted half-way (no stamp) is made again from
# scratch, as NBACCEL_REINSTALL=1 makes it. Each run points the venv's editable install at this
# clone (seconds) when another clone had it.
#
# What runs, by default: the fast layer (`-m "not slow"`: pure logic, docstring examples) and
# every test of the real-kernel launcher, debugging, containment, %ranks and shutdown files.
# --ci runs a subset sized for CI's time budget (docs/development.md says what and how long).
set -euo pipefail
shopt -s inherit_errexit  # a failed install inside $(venv_for ...) stops here, unstamped
cd "$(dirname "$0")/.."
repo=$(pwd)

ci=""
if_found=""
pythons=()
while [ $# -gt 0 ]; do
    case "$1" in
        --ci) ci=1; shift ;;
        --if-found) if_found=1; shift ;;  # a Python pyenv lacks is a note, not a failure
        --) shift; break ;;
        3.*) pythons+=("$1"); shift ;;
        *) echo "test_pythons.sh: unknown argument '$1' (Pythons are given as 3.10, 3.12...; pytest's arguments after --)" >&2; exit 2 ;;
    esac
done
[ ${#pythons[@]} -gt 0 ] || pythons=(3.10 3.12 3.13)

# The real-kernel files: the launcher, its errors, debugging, containment, %ranks, shutdown.
kernel_tests=(tests/test_launcher_kernel.py tests/test_launcher_errors_kernel.py
    tests/test_debug_breakpoint.py tests/test_debug_post_mortem.py tests/test_debug_background.py
    tests/test_debug_ranks_cell.py tests/test_containment.py tests/test_ranks_session.py
    tests/test_ranks_magics.py tests/test_kernel_shutdown.py)
# CI's subset: the fast layer, and of the kernel tests one file per concern.
ci_kernel_tests=(tests/test_launcher_kernel.py tests/test_debug_breakpoint.py
    tests/test_containment.py tests/test_ranks_session.py tests/test_kernel_shutdown.py)

venvs=${NBACCEL_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/nbaccel}
pyenv_root=$( (command -v pyenv >/dev/null 2>&1 && pyenv root) || echo "${PYENV_ROOT:-$HOME/.pyenv}")
mkdir -p "$venvs"

# The newest 3.X.Y under pyenv's versions for 3.X, or nothing.
find_python() {
    local found
    found=$(ls -d "$pyenv_root"/versions/"$1".[0-9]* 2>/dev/null | sort -V | tail -1)
    [ -n "$found" ] && [ -x "$found/bin/python" ] && echo "$found/bin/python"
}

# Make (or bring up to date) the venv for one interpreter; prints its path.
venv_for() {
    local python=$1 minor=$2 pins venv
    # The pins: the interpreter, constraints.txt's lines and pyproject.toml's requirements (not
    # comments, nor the rest of pyproject.toml, which change more often than what is installed).
    pins=$( ("$python" -c 'import sys; print(sys.version)'; sed 's/#.*//; /^ *$/d' constraints.txt
        python3 -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(json.dumps([p["dependencies"], p["optional-dependencies"]], sort_keys=True))') \
        | sha256sum | cut -c1-12)
    venv="$venvs/venv-$minor"
    if [ -n "${NBACCEL_REINSTALL:-}" ] || [ ! -x "$venv/bin/python" ] \
        || [ ! -f "$venv/.nbaccel-built" ]; then
        echo "test_pythons.sh: building $venv (the first time downloads torch's CUDA build, several GB)" >&2
        rm -rf "$venv"
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
    elif [ "$(cat "$venv/.nbaccel-built")" = "$pins" ]; then
        echo "$venv"
        return
    else  # pip changes only what the new pins change (not torch's GB again)
        echo "test_pythons.sh: the pins changed: updating $venv" >&2
        rm "$venv/.nbaccel-built"
    fi
    "$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[dev]" >&2
    echo "$pins" >"$venv/.nbaccel-built"
    echo "$venv"
}

status=0
for minor in "${pythons[@]}"; do
    python=$(find_python "$minor" || true)
    if [ -z "$python" ]; then
        echo "test_pythons.sh: no Python $minor under $pyenv_root/versions (pyenv install $minor to test it)" >&2
        [ -n "$if_found" ] || status=1
        continue
    fi
    # One build per Python at a time, machine-wide (several clones may share the venvs).
    exec 9>"$venvs/venv-$minor.lock"
    flock 9
    venv=$(venv_for "$python" "$minor")
    # The editable install points at the clone that last installed it: make it this one.
    if [ "$("$venv/bin/python" -c 'import nbaccel, os; print(os.path.dirname(os.path.dirname(nbaccel.__file__)))')" != "$repo" ]; then
        "$venv/bin/python" -m pip install --quiet --no-deps -e . >&2
    fi
    "$venv/bin/python" -c 'import sys, torch; print(f"test_pythons.sh: Python {sys.version.split()[0]}, torch {torch.__version__}", file=sys.stderr)'
    started=$(date +%s)
    run() { "$venv/bin/python" -m pytest -p no:cacheprovider -n 2 --dist loadfile --max-worker-restart 0 "$@"; }
    if [ $# -gt 0 ]; then
        run "$@" || status=1
    elif [ -n "$ci" ]; then
        run -q -m "not slow" tests nbaccel || status=1
        run -q "${ci_kernel_tests[@]}" || status=1
    else
        run -q -m "not slow" tests nbaccel || status=1
        run -q "${kernel_tests[@]}" || status=1
    fi
    flock -u 9
    took=$(($(date +%s) - started))
    echo "test_pythons.sh: Python $minor took $((took / 60)) min $((took % 60)) s (so far exit status $status)"
done
exit $status
