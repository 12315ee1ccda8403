#!/usr/bin/env bash
# CI, after `make test`: the C++ test suite under AddressSanitizer + UndefinedBehaviorSanitizer (the
# CMake preset `asan`, built with clang so that the same build carries the libFuzzer target), then
# the fuzz target for a fixed number of inputs from the corpus kept in tests/fuzz/corpus. CPU only.
# About 8 minutes on 2 cores (build ~3.5, suite ~1, fuzzing ~3); FUZZ_RUNS changes the fuzzing budget.
set -euo pipefail
cd "$(dirname "$0")/.."
CMAKE=$(scripts/find-cmake.sh cmake)
CTEST=$(scripts/find-cmake.sh ctest)
JOBS=${JOBS:-$(nproc)}
bash scripts/deps.sh  # clang-14 and its sanitizer/libFuzzer runtimes among the rest
BUILD=build-asan  # the preset's binaryDir
# Undefined behaviour fails the test that shows it (the preset also compiles with
# -fno-sanitize-recover=undefined); ASan aborts on its first report and checks leaks.
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}

CXX=${SANITIZE_CXX:-clang++-14} CC=${SANITIZE_CC:-clang-14} \
    "$CMAKE" --preset asan -DELASTICEP_BUILD_FUZZ=ON -DELASTICEP_FUZZ_RUNS="${FUZZ_RUNS:-20000}" \
    > "$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log"; exit 1; }
"$CMAKE" --build "$BUILD" -j "$JOBS"

# Left out of the first pass: packaging_install (its find_package consumer is built without
# sanitizers and cannot link a sanitized archive; the plain build runs it), the MPI tests (Open
# MPI's own allocations trip LeakSanitizer: run next without leak checking), and the fuzzing run
# (last).
"$CTEST" --test-dir "$BUILD" --output-on-failure -j "$JOBS" -L cpu \
    -E '^(packaging_install|mpi_.*|fuzz_buffer)$'
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 "$CTEST" --test-dir "$BUILD" --output-on-failure -R '^mpi_'
"$CTEST" --test-dir "$BUILD" --output-on-failure -R '^fuzz_buffer$'
