#!/usr/bin/env bash
# Fails (listing the files) when a tracked C++/CUDA file differs from what clang-format makes of it
# with the repository's .clang-format (Google base, 4 spaces, 120 columns). `--fix` rewrites them.
set -euo pipefail
cd "$(dirname "$0")/.."
CF=${CLANG_FORMAT:-clang-format}
command -v "$CF" >/dev/null || { echo "check-format: $CF not found (scripts/deps.sh installs clang-format)"; exit 1; }
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.h')
if [ "${1:-}" = "--fix" ]; then
    "$CF" -i "${files[@]}"
    exit 0
fi
bad=()
for f in "${files[@]}"; do
    "$CF" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
    echo "check-format: ${#bad[@]} of ${#files[@]} files are not clang-format clean ($("$CF" --version | head -1)):"
    printf '  %s\n' "${bad[@]}"
    echo "run scripts/check-format.sh --fix"
    exit 1
fi
echo "check-format: ${#files[@]} files clean ($("$CF" --version | head -1))"
