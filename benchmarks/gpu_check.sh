#!/usr/bin/env bash
# One call on a GPU machine (no network; torch + CUDA toolkit + triton
# installed, python3 without a venv): build the extension in place, run the
# CUDA tests, measure copy bandwidth and time attnres / eager / compile.
# Designed to finish within 8 minutes: each stage has a time cap and the
# benchmark gets what is left (GPU_CHECK_TOTAL_S, default 460 s). Results:
# benchmarks/results/ and, when $OUT is set, copies there (log, CSV, markdown
# table, kernel resource usage).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-460}
RESULTS=benchmarks/results
LOG="$RESULTS/gpu_check.log"
mkdir -p "$RESULTS"
elapsed() { echo $(( $(date +%s) - START )); }

run_all() {
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not available"
  python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
  command -v nvcc >/dev/null && nvcc --version | tail -1

  echo "== build ($(elapsed) s)"
  # CMake directly (CMakeLists.txt is the one build description; setup.py
  # would need a newer setuptools than the machine may have): the op library
  # and the Python module, copied into the package as setup.py does.
  (
    set -e
    TORCH_CUDA_ARCH_LIST=9.0 cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
      -DPython3_EXECUTABLE="$(command -v python3)" -DATTNRES_BUILD_PYTHON=ON
    timeout 240 cmake --build build-gpu -j 16
    cp build-gpu/_C*.so build-gpu/libattnres.so python/attnres/
  ) > "$RESULTS/build.log" 2>&1
  local build_rc=$?
  grep "attnres:" "$RESULTS/build.log"
  if [ $build_rc -ne 0 ]; then
    echo "BUILD FAILED (rc=$build_rc); last lines of the build log:"
    tail -40 "$RESULTS/build.log"
    return 1
  fi
  export PYTHONPATH=python
  local so
  so=python/attnres/libattnres.so
  if command -v cuobjdump >/dev/null; then
    cuobjdump --dump-resource-usage "$so" > "$RESULTS/resource_usage.txt" 2>&1
  fi
  # Fail fast: a build without CUDA kernels would spend the call on nothing.
  if ! python3 -c "import sys, torch, attnres; ok = torch._C._dispatch_has_kernel_for_dispatch_key('attnres::depth_attention_fwd', 'CUDA'); print('attnres CUDA kernels registered:', ok); sys.exit(0 if ok else 1)"; then
    echo "NO CUDA KERNELS in the build: stopping"
    return 1
  fi

  echo "== tests ($(elapsed) s)"
  if python3 -c "import pytest" 2>/dev/null; then
    timeout 180 python3 -m pytest tests/python/test_cuda.py -q -rs --maxfail=25 --durations=8
    echo "test_cuda.py rc=$?"
    if [ -f tests/python/test_ops.py ]; then
      timeout 60 python3 -m pytest tests/python/test_ops.py -q -rs -k cuda --maxfail=25
      echo "test_ops.py -k cuda rc=$?"
    else
      echo "tests/python/test_ops.py not present: skipped"
    fi
  else
    echo "pytest is not installed on this machine: the CUDA tests were NOT run;"
    echo "running a smoke check instead (CUDA vs CPU kernels, forward and backward)"
    timeout 120 python3 - <<'PY'
import torch, attnres
bad = 0
for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
    for n, t, d in ((1, 5, 3), (7, 33, 64), (65, 9, 1000), (3, 4, 7186), (2, 3, 16384)):
        g = torch.Generator().manual_seed(n * d)
        src = [torch.randn(t, d, generator=g).to(dtype) for _ in range(n)]
        pd = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        q, w = (torch.randn(d, generator=g) / d**0.5).to(pd), (1 + 0.2 * torch.randn(d, generator=g)).to(pd)
        dh = torch.randn(t, d, generator=g).to(dtype)
        outs = []
        for dev in ("cpu", "cuda"):
            f = torch.ops.attnres.depth_attention_fwd([s.to(dev) for s in src], q.to(dev), w.to(dev), 1e-6, 0.8)
            b = torch.ops.attnres.depth_attention_bwd(dh.to(dev), [s.to(dev) for s in src], q.to(dev), w.to(dev), f[1], f[2], 0.8)
            outs.append([f[0], f[2], *b[0], b[1], b[2]])
        errs = [((c.double().cpu() - a.double()).norm() / a.double().norm().clamp_min(1e-300)).item() for a, c in zip(*outs)]
        ok = max(errs) <= tol
        bad += not ok
        print(("ok  " if ok else "FAIL"), dtype, n, t, d, f"max rel err {max(errs):.2g}")
print(f"smoke check: {bad} failure(s)")
PY
  fi

  local left=$(( TOTAL_S - $(elapsed) ))
  echo "== benchmark ($(elapsed) s elapsed, ${left} s left)"
  if [ $left -gt 40 ]; then
    timeout $(( left )) python3 benchmarks/bench.py --device cuda --budget-s $(( left - 30 ))
    echo "bench.py rc=$?"
  else
    echo "no time left for the benchmark"
  fi
  echo "== done in $(elapsed) s"
}

run_all 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$LOG" "$OUT/"
  for f in "$RESULTS"/gpu_*.csv "$RESULTS"/gpu_*.md "$RESULTS/resource_usage.txt" "$RESULTS/build.log"; do
    [ -f "$f" ] && cp "$f" "$OUT/"
  done
fi
exit $rc
