#!/usr/bin/env bash
# Run nbaccel's tests on Python 3.13 (Debian 13's), in a debootstrap chroot.
#
# What runs: the fast layer (`-m "not slow"`: pure logic, docstring examples) and the real-kernel
# tests of the launcher, containment and persistent ranks. The chroot (Debian 13 "trixie",
# minbase + python3.13) and its virtual environment are kept in $NBACCEL_PY313_ROOT and reused;
# the first run downloads Debian's packages and torch's PyPI wheel for cp313 (a CUDA build with
# its nvidia-* wheels, ~3 GB in the chroot: PyPI serves no CPU build; it runs on the CPU here).
# The repository is bind-mounted at /src, so the chroot tests this checkout as it is.
#
#   sudo scripts/test_python313.sh                      # build if needed, then the default set
#   sudo scripts/test_python313.sh tests/test_units.py  # other pytest arguments instead
#
# Needs root (debootstrap, chroot, mounts) and Debian's package mirror; not part of CI
# (scripts/test.sh), whose time it would double.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
root=${NBACCEL_PY313_ROOT:-/var/cache/nbaccel/py313-trixie}
mirror=${NBACCEL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
venv=/opt/nbaccel-py313  # inside the chroot, apart from the checkout's own .venv

if [ "$(id -u)" != 0 ]; then
    echo "test_python313.sh needs root (debootstrap, chroot, mounts): run it with sudo" >&2
    exit 2
fi

if [ ! -x "$root/usr/bin/python3.13" ]; then
    if ! command -v debootstrap >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    # A half-made chroot from an interrupted run is made again, not patched.
    rm -rf "$root.partial"
    mkdir -p "$(dirname "$root")"
    debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-dev,ca-certificates,libgomp1,procps,gcc,g++,git,iproute2 \
        trixie "$root.partial" "$mirror"
    rm -rf "$root"
    mv "$root.partial" "$root"
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# The host's CA bundle: where HTTPS goes through an intercepting proxy, its CA is in there.
host_ca=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
cp "$host_ca" "$root/etc/ssl/certs/host-ca-certificates.crt"

mounted=()
cleanup() {
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount -l "${mounted[$i]}" 2>/dev/null || true
    done
}
trap cleanup EXIT
mount_in() {  # mount_in TARGET MOUNT-ARGS...
    local target="$root$1"
    shift
    mkdir -p "$target"
    mount "$@" "$target"
    mounted+=("$target")
}
mount_in /proc -t proc proc
mount_in /sys -t sysfs sysfs
mount_in /dev --rbind /dev
mount_in /dev/shm -t tmpfs -o size=2g tmpfs  # ranks return large tensors through /dev/shm
mount_in /src --bind "$repo"

# The default: the fast layer, then every test (slow ones too) of the kernel-level files.
kernel_tests="tests/test_launcher_kernel.py tests/test_launcher_errors_kernel.py"
kernel_tests+=" tests/test_containment.py tests/test_ranks_session.py tests/test_ranks_magics.py"

# `env -i`: the chroot's Python sees none of the host's virtual environment or PYTHON* settings.
chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
    CI="${CI:-}" PIP_CERT=/etc/ssl/certs/host-ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SSL_CERT_FILE=/etc/ssl/certs/host-ca-certificates.crt /bin/bash -s -- "$@" <<EOF
set -euo pipefail
cd /src
if [ ! -x $venv/bin/python ]; then
    python3.13 -m venv $venv
    $venv/bin/python -m pip install -q --upgrade pip
fi
# Installs only what changed; the editable install makes /src's nbaccel the one imported.
$venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
$venv/bin/python - <<'PY'
import sys, torch
assert sys.version_info[:2] == (3, 13), sys.version
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}", file=sys.stderr)
PY
# The kernel tests start ipykernel from this interpreter (jupyter_client puts sys.executable
# for the "python3" kernel's "python").
run() { $venv/bin/python -m pytest -p no:cacheprovider "\$@"; }
if [ \$# -gt 0 ]; then
    run "\$@"
else
    run -m "not slow" tests nbaccel
    run $kernel_tests
fi
EOF
