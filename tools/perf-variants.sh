#!/usr/bin/env bash
# Builds the CUDA backend once and measures every kernel variant side by side on one GPU machine
# (docs/perf/NOTES.md): per variant (ELASTICEP_KERNEL_VARIANT = direct, staged) a quick gpu-test
# subset and `elasticep bench` at DeepSeek-V3 shapes with 8 ranks as threads on GPU 0 and device waits
# (decode T=128 masked + CUDA graph; prefill T=4096 contiguous A=128, one verified run and one timing
# run), then compute-sanitizer on small cases, then a compact table. About 6 minutes on one H200
# (build ~2, tests ~1, benches ~1.5, sanitizer ~1.5). Usage:
#   tools/perf-variants.sh OUT_DIR
# Environment: VARIANTS (default "direct staged"), STEPS (default build,tests,bench,sanitize; add sweep
# for the latency-vs-tokens plot: docs/perf/*.png via tools/plot_perf.py), ROUNDS (default 20),
# ELASTICEP_BUILD_DIR (default build-perf), JOBS. Every step has a timeout; the table comes last.
set -uo pipefail
out=${1:?usage: tools/perf-variants.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ELASTICEP_BUILD_DIR:-$root/build-perf}
jobs=${JOBS:-$(nproc)}
variants=${VARIANTS:-direct staged}
steps=,${STEPS:-build,tests,bench,sanitize},
rounds=${ROUNDS:-20}
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
cmake_bin=$(command -v cmake || python3 -c 'import cmake,os;print(os.path.join(cmake.CMAKE_BIN_DIR,"cmake"))')
has() { [[ $steps == *,$1,* ]]; }
say() { echo "== $(date +%T) $*"; }
status=0
fail() { echo "FAILED: $*"; status=1; }
t0=$(date +%s)

{ nvidia-smi; nvcc --version; git -C "$root" log --oneline -1; } >"$out/machine.txt" 2>&1

if has build; then
    say build
    prefix="$root/.devdeps;$root/.devdeps/root/usr"
    if ! ls /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/cmake/GTest /usr/local/lib/cmake/GTest >/dev/null 2>&1; then
        src=${GTEST_SOURCE:-$root/.devdeps/googletest}
        [ -d "$src" ] || src=$root/.devdeps/root/usr/src/googletest
        if [ -d "$src" ]; then
            "$cmake_bin" -S "$src" -B "$build/_gtest" -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
                -DCMAKE_INSTALL_PREFIX="$build/_gtest/install" >"$out/build.log" 2>&1 &&
                "$cmake_bin" --build "$build/_gtest" -j"$jobs" --target install >>"$out/build.log" 2>&1
            prefix="$prefix;$build/_gtest/install"
        fi
    fi
    # -Xptxas -v: registers, stack and spills of every kernel, in build.log (ptxas.txt below)
    "$cmake_bin" -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DELASTICEP_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90a -DELASTICEP_WITH_MPI=OFF -DELASTICEP_BUILD_PYTHON=OFF \
        -DCMAKE_CUDA_FLAGS="-Xptxas=-v" -DCMAKE_PREFIX_PATH="$prefix" >>"$out/build.log" 2>&1 ||
        { tail -40 "$out/build.log"; exit 1; }
    "$cmake_bin" --build "$build" -j"$jobs" --target elasticep_gpu_tests elasticep_cli >>"$out/build.log" 2>&1 ||
        { grep -E 'error' "$out/build.log" | head -30; exit 1; }
    grep -E "warning" "$out/build.log" | grep -v "ptxas info" | head -5
    grep -A2 -E "Compiling entry function '_ZN9elasticep7kernels(22direct_dispatch|21direct_combine|11send|13expand|14partial|13reduce)" \
        "$out/build.log" | grep -E "entry|registers|spill" >"$out/ptxas.txt" || true
    echo "build $(($(date +%s) - t0)) s"
fi
bin=$build/tests/elasticep_gpu_tests
cli=$build/tools/elasticep

if has tests; then
    # the variant-specific tests once (they choose their variants themselves), then the suite's core
    # per variant (ranks sharing the GPU: host waits; graph capture: device waits)
    say "tests: CudaPaths (both variants)"
    timeout 180 "$bin" --gtest_filter='CudaPaths.*' >"$out/tests_paths.log" 2>&1 || fail "CudaPaths tests (rc $?)"
    grep -E '^\[ *(OK|FAILED|SKIPPED) *\]|Failure' "$out/tests_paths.log" | head -20
    for v in $variants; do
        say "tests: variant $v"
        ELASTICEP_KERNEL_VARIANT=$v timeout 180 "$bin" \
            --gtest_filter='CudaBackendMatrix.*:CudaBackendGraph.*:CudaPeerChecks.*:CudaBackendFaults.HostSync*:CudaBackendFaults.GraphMode*:CudaBackendFaults.ARankThatFails*' \
            --gtest_output=json:"$out/tests_$v.json" >"$out/tests_$v.log" 2>&1 || fail "gpu tests, variant $v (rc $?)"
        grep -E '^\[ *(FAILED|SKIPPED) *\]|Failure|\[elasticep\]' "$out/tests_$v.log" | head -20
        grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$out/tests_$v.log"
    done
fi

bench() {  # variant phase tag extra-args...
    local v=$1 phase=$2 tag=$3
    shift 3
    local shape
    case $phase in
        decode) shape=(--tokens 128 --layout masked --graph) ;;
        prefill) shape=(--tokens 4096 --alignment 128) ;;
    esac
    ELASTICEP_KERNEL_VARIANT=$v ELASTICEP_SHARED_GPU_DEVICE_WAITS=1 timeout 150 "$cli" bench --backend cuda --ranks 8 \
        --gpus 1 --skew 0 --timeout-ms 10000 --no-progress "${shape[@]}" "$@" --json "$out/bench_${v}_$tag.json" \
        >>"$out/bench_$v.log" 2>&1 ||
        fail "bench $v $tag (rc $?)"
}

if has bench; then
    for v in $variants; do
        say "bench: variant $v"
        bench "$v" decode decode --rounds "$rounds" --warmup 3
        bench "$v" prefill prefill_verified --rounds 1 --warmup 1 --no-b2b  # every output against the oracle
        bench "$v" prefill prefill --rounds 10 --warmup 2 --no-verify        # timing (verification: ~5 s a round)
        grep -E "^ +[0-9]+ |^mismatch|^error|FAILED|verified" "$out/bench_$v.log" | tail -8
    done
fi

if has sweep; then
    v=${SWEEP_VARIANT:-${variants%% *}}
    say "sweep: variant $v (latency vs tokens per rank)"
    bench "$v" decode sweep_decode --tokens 1,2,4,8,16,32,64,128,256 --rounds 10 --warmup 2 --no-verify
    bench "$v" prefill sweep_prefill --tokens 512,1024,2048,4096,8192 --rounds 5 --warmup 1 --no-verify --no-b2b
    python3 "$root/tools/plot_perf.py" --out "$out" "$out"/bench_*_sweep_*.json >>"$out/bench_$v.log" 2>&1 ||
        echo "(plot skipped: see bench_$v.log)"
fi

if has sanitize; then
    for v in $variants; do
        say "sanitize: variant $v"
        tools=memcheck
        [ "$v" = direct ] && tools="memcheck racecheck"  # the new kernels' shared memory
        for tool in $tools; do
            filter=${SANITIZE_FILTER:-CudaBackendMatrix.TwoRanksOneGpu}
            [ $tool = racecheck ] && filter=${SANITIZE_FILTER:-CudaBackendMatrix.OneRank}
            echo "### $v $tool $filter" >>"$out/sanitizer.log"
            ELASTICEP_KERNEL_VARIANT=$v timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 "$bin" \
                --gtest_filter="$filter" >>"$out/sanitizer.log" 2>&1 || fail "compute-sanitizer $tool, variant $v (rc $?)"
        done
    done
    grep -E "^###|ERROR SUMMARY" "$out/sanitizer.log"
fi

say "table ($(($(date +%s) - t0)) s in all)"
python3 - "$out" $variants <<'EOF'
import json, os, sys
out, variants = sys.argv[1], sys.argv[2:]

def load(v, tag):
    p = os.path.join(out, f"bench_{v}_{tag}.json")
    try:
        return json.load(open(p))["results"][0], json.load(open(p))
    except Exception:
        return None, None

def med(r, phase, key="latency_us"):
    x = (r or {}).get("phases", {}).get(phase) or {}
    t = x.get(key) or {}
    return t.get("median")

def direct_floor(r, phase):
    # the direct path's bytes: rows written once (the bench's min floor, Traffic::*_min_hbm_bytes)
    return ((r or {}).get("phases", {}).get(phase) or {}).get("hbm_min_floor_us")

f = lambda v: "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")
print(f"{'variant':8} {'phase':8} {'dispatch us':>11} {'combine us':>10} {'graph D+C':>10} | {'staged floor D/C':>17} {'direct floor D/C':>17} | verified")
for v in variants:
    for tag, vtag in (("decode", "decode"), ("prefill", "prefill_verified")):
        r, doc = load(v, tag)
        rv, _ = load(v, vtag)
        if not r:
            print(f"{v:8} {tag:8} (no result)"); continue
        d, c, g = med(r, "dispatch"), med(r, "combine"), med(r, "graph")
        sd, sc = r["phases"]["dispatch"].get("hbm_floor_us"), r["phases"]["combine"].get("hbm_floor_us")
        dd, dc = direct_floor(r, "dispatch"), direct_floor(r, "combine")
        ver = (rv or {}).get("verified")
        print(f"{v:8} {tag:8} {f(d):>11} {f(c):>10} {f(g):>10} | {f(sd):>8}/{f(sc):<8} {f(dd):>8}/{f(dc):<8} | {ver}")
        if d and sd and dd:
            print(f"{'':8} {'ratio':8} {d/sd:10.2f}x {c/sc:9.2f}x {'':>10} | (to the staged floor; to the direct floor {d/dd:.2f}x / {c/dc:.2f}x)")
EOF
exit $status
