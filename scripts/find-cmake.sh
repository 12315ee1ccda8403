#!/usr/bin/env bash
# Prints the path of a cmake >= 3.28 (the system's, or the one pip installed); fails if none.
# `scripts/find-cmake.sh ctest` prints the matching ctest.
tool=${1:-cmake}
ok() { "$1" --version 2>/dev/null | head -1 | awk '{split($3,v,"."); exit !((v[1]>3)||(v[1]==3&&v[2]>=28))}'; }
if command -v cmake >/dev/null && ok "$(command -v cmake)"; then
    echo "$(dirname "$(command -v cmake)")/$tool"; exit 0
fi
PY=${PYTHON:-python3}
dir=$("$PY" -c 'import cmake, os; print(cmake.CMAKE_BIN_DIR)' 2>/dev/null) || exit 1
ok "$dir/cmake" || exit 1
echo "$dir/$tool"
