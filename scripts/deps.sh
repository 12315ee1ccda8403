#!/usr/bin/env bash
# Installs what building and testing ElasticEP needs, when it is missing: Debian packages through
# apt-get (when run as root), and a CMake >= 3.28 from PyPI when the system's is older.
# Safe to run repeatedly; prints what it installs.
set -euo pipefail

need_pkgs=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# clang-14 + libclang-rt-14-dev: scripts/ci-sanitize.sh (ASan/UBSan runtimes and libFuzzer).
for p in g++ make cmake git python3 python3-pip clang-format libgtest-dev libcli11-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin \
    clang-14 libclang-rt-14-dev; do
    have_pkg "$p" || need_pkgs+=("$p")
done
if ((${#need_pkgs[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "deps: installing Debian packages: ${need_pkgs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
    else
        echo "deps: missing Debian packages (${need_pkgs[*]}); install them (as root: apt-get install ${need_pkgs[*]})" >&2
        exit 1
    fi
fi

# Python packages for the Python bindings and their tests (skipped gracefully by the tests if absent).
PY=${PYTHON:-python3}
py_need=()
for mod in numpy pytest nanobind scikit_build_core ml_dtypes; do
    "$PY" -c "import $mod" 2>/dev/null || py_need+=("${mod//_/-}")
done
if ! "$(dirname "$0")/find-cmake.sh" >/dev/null 2>&1; then py_need+=("cmake>=3.28"); fi
if ((${#py_need[@]})); then
    echo "deps: installing Python packages: ${py_need[*]}"
    "$PY" -m pip install -q --disable-pip-version-check "${py_need[@]}" 2>&1 | grep -v -i "running pip as the 'root' user" || true
fi
"$(dirname "$0")/find-cmake.sh" >/dev/null
