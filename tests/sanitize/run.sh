#!/usr/bin/env bash
# make sanitize: the C++ tests (GoogleTest, through ctest) and the CPU
# emulation of the CUDA kernels (tests/cuda_emulation), built with
# AddressSanitizer + UndefinedBehaviorSanitizer and run. CPU-only build in its
# own directory (default build-sanitize), configured with flags on the
# command line: CMakeLists.txt is not changed for it.
#
#   tests/sanitize/run.sh            # build + run both
#   ATTNRES_SANITIZE_BUILD=dir  MAX_JOBS=n  PYTHON=python  (defaults below)
#   ATTNRES_SANITIZE_DTYPES="float64 float32 bfloat16 float16"  (make sanitize-full: every case;
#   an entry dtype:k/n runs every n-th case from the k-th)
#
# By default the kernel emulation runs sanitized for float32 and bfloat16
# (every tile family but fp64's: float16 has bfloat16's 2-byte tiles and
# memory accesses), one core each, each dtype on complementary halves of the
# case list (float32 the even cases, bfloat16 the odd ones), for CI's time
# limit (times in benchmarks/results/NOTES.md, "CI time"). Each dtype's
# emulator is compiled with that dtype's kernels alone
# (-DATTNRES_EMULATE_ONLY), the builds side by side. pytest runs every
# case of all four unsanitized (tests/python/test_cuda_emulation.py);
# `make sanitize-full` runs every case of all four here.
#
# A sanitizer report fails the run (halt_on_error). LeakSanitizer is off:
# LibTorch keeps process-lifetime allocations that it reports as leaks.
# -fno-sanitize=vptr: LibTorch is not built with UBSan's type info, and the
# vptr check then reports its polymorphic types falsely.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
BUILD=${ATTNRES_SANITIZE_BUILD:-build-sanitize}
JOBS=${MAX_JOBS:-2}
SAN="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=0:detect_odr_violation=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
START=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - START )) s)"; }

TORCH_CMAKE=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)

stamp "configure $BUILD"
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" -DATTNRES_NO_CUDA=ON -DATTNRES_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" > "$BUILD/configure.log" 2>&1 \
  || { tail -40 "$BUILD/configure.log"; exit 1; }
grep "attnres:" "$BUILD/configure.log" || true

stamp "build (-j$JOBS)"
cmake --build "$BUILD" -j "$JOBS"

stamp "C++ tests under ASan+UBSan"
# The tests' binary links libasan first; the op library inherits it.
ctest --test-dir "$BUILD" --output-on-failure

stamp "CUDA-kernel emulation under ASan+UBSan"
# build_emulator NAME [OUT FLAGS...]: tests/cuda_emulation/NAME.cpp -> $BUILD/OUT
# (default NAME), sanitized.
build_emulator() {
  local src=$1 out=${2:-$1}
  g++ -std=c++20 -O1 -g -pthread $SAN "${@:3}" \
    -I tests/cuda_emulation -I csrc/cuda -I csrc/include -I "$TORCH_DIR/include" \
    -DATTNRES_TOLERANCES_FILE="\"$ROOT/tests/tolerances.txt\"" \
    "tests/cuda_emulation/$src.cpp" -o "$BUILD/$out" \
    -L "$TORCH_DIR/lib" -lc10 -Wl,-rpath,"$TORCH_DIR/lib"
}
fails=0
EMU="$BUILD/emulate_kernels"
BEMU="$BUILD/emulate_block_kernels"
DTYPES=${ATTNRES_SANITIZE_DTYPES:-float32:0/2 bfloat16:1/2}
# The emulators compile side by side (all four dtypes' kernels in one
# program took 6 minutes under the sanitizers), then run side by side.
builds=()
build_emulator emulate_runtime_selftest &
builds+=($!)
build_emulator emulate_block_kernels &
builds+=($!)
for dtype in $(for d in $DTYPES; do echo "${d%%:*}"; done | sort -u); do
  build_emulator emulate_kernels "emulate_kernels_$dtype" -DATTNRES_EMULATE_ONLY="\"$dtype\"" &
  builds+=($!)
done
# Every build finishes (none left running) before a failed one fails the run.
build_fails=0
for pid in "${builds[@]}"; do wait "$pid" || build_fails=$((build_fails + 1)); done
[ $build_fails -eq 0 ] || { echo "$build_fails emulator build(s) FAILED"; exit 1; }
# The emulated runtime itself first: its fiber switches are what ASan must
# follow (annotated in cuda_runtime.h).
if "$BUILD/emulate_runtime_selftest" > "$BUILD/emulate_runtime_selftest.log" 2>&1; then
  echo "emulated runtime: $(tail -1 "$BUILD/emulate_runtime_selftest.log")"
else
  echo "emulated runtime FAILED:"; tail -30 "$BUILD/emulate_runtime_selftest.log"; fails=$((fails + 1))
fi
# The dtypes (and the Block-read kernels) side by side.
declare -A pids
for dtype in $DTYPES; do
  shard=all
  [[ $dtype == *:* ]] && shard=${dtype#*:}
  [ "$shard" = all ] && shard=0/1
  "${EMU}_${dtype%%:*}" "${dtype%%:*}" "$shard" > "$EMU.${dtype//[:\/]/_}.log" 2>&1 &
  pids[$dtype]=$!
done
"$BEMU" > "$BEMU.log" 2>&1 &
block_run=$!
for dtype in $DTYPES; do
  if wait "${pids[$dtype]}"; then
    echo "emulation $dtype: $(tail -1 "$EMU.${dtype//[:\/]/_}.log")"
  else
    echo "emulation $dtype FAILED:"; tail -30 "$EMU.${dtype//[:\/]/_}.log"; fails=$((fails + 1))
  fi
done
if wait $block_run; then
  echo "block-read emulation: $(tail -1 "$BEMU.log")"
else
  echo "block-read emulation FAILED:"; grep -v '^ok' "$BEMU.log" | tail -30; fails=$((fails + 1))
fi
stamp "done"
[ $fails -eq 0 ]
