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
            b = torch.ops.attnres.depth_attention_bwd(dh.to(dev), None, [s.to(dev) for s in src], q.to(dev), w.to(dev), *f, 0.8, [True] * (n + 2))
            outs.append([f[0], f[2], *b[0], b[1], b[2]])
        errs = [((c.double().cpu() - a.double()).norm() / a.double().norm().clamp_min(1e-300)).item() for a, c in zip(*outs)]
        ok = max(errs) <= tol
        bad += not ok
        print(("ok  " if ok else "FAIL"), dtype, n, t, d, f"max rel err {max(errs):.2g}")
print(f"smoke check: {bad} failure(s)")
PY
  fi

  # The compute-sanitizer stage after it keeps its SANITIZE_S (60 s).
  local left=$(( TOTAL_S - ${SANITIZE_S:-60} - $(elapsed) ))
  echo "== benchmark ($(elapsed) s elapsed, ${left} s left)"
  if [ $left -gt 40 ]; then
    timeout $(( left )) python3 benchmarks/bench.py --device cuda --budget-s $(( left - 30 ))
    echo "bench.py rc=$?"
  else
    echo "no time left for the benchmark"
  fi
  sanitize_stage
  echo "== done in $(elapsed) s"
}

# compute-sanitizer (memcheck, racecheck) on small shapes of every kernel
# path: sub-warp / warp / block groups, staged and unstaged backward, > 64
# sources (overflow table), strided and misaligned rows (scalar path),
# fp32/bf16/fp16/fp64, the rare range paths (rows near the dtype's maximum).
# After the priority stages; at most SANITIZE_S (default 60) seconds, less
# when the budget is spent. Outcome in the log and in
# $RESULTS/sanitize.txt ("compute-sanitizer memcheck: ok|FAILED|...").
sanitize_stage() {
  local budget=${SANITIZE_S:-60}
  local left=$(( TOTAL_S - $(elapsed) ))
  [ $left -lt $budget ] && budget=$left
  echo "== compute-sanitizer ($(elapsed) s elapsed, ${budget} s)"
  local summary="$RESULTS/sanitize.txt"
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer: not installed (skipped)" | tee "$summary"
    return 0
  fi
  if [ "$budget" -lt 15 ]; then
    echo "compute-sanitizer: no time left (skipped)" | tee "$summary"
    return 0
  fi
  local script="$RESULTS/sanitize_shapes.py"
  cat > "$script" <<'PY'
import torch, attnres
dev = "cuda"
cases = [  # dtype, N, T, D, layout
    (torch.float32, 3, 33, 64, "contiguous"),    # sub-warp groups, staged backward
    (torch.float32, 5, 9, 1000, "contiguous"),   # warp per token
    (torch.float32, 3, 5, 2052, "contiguous"),   # block mode, 2 tokens per CTA
    (torch.float32, 2, 3, 16384, "contiguous"),  # widest rows
    (torch.float32, 3, 7, 100, "strided"),       # scalar path (odd row stride)
    (torch.float32, 3, 7, 64, "misaligned"),
    (torch.float32, 70, 5, 16, "contiguous"),    # > 64 sources: overflow table
    (torch.bfloat16, 9, 20, 1024, "contiguous"), # staged, several tokens per CTA
    (torch.bfloat16, 65, 3, 1000, "contiguous"), # not staged
    (torch.bfloat16, 3, 5, 7186, "contiguous"),  # scalar path, block mode
    (torch.float16, 17, 6, 64, "contiguous"),
    (torch.float64, 3, 5, 70, "contiguous"),
]
for dtype, n, t, d, layout in cases:
    g = torch.Generator(device="cpu").manual_seed(n * d)
    pd = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    def src(i):
        big = 3e38 if (dtype in (torch.float32, torch.bfloat16) and i == 0) else 1.0  # rare range paths
        x = ((torch.rand(t, d + 1, generator=g, dtype=torch.float64) * 2 - 1) * big).to(dtype).to(dev)
        if layout == "strided":
            return x[:, :d]
        if layout == "misaligned":
            return x.flatten()[1 : 1 + t * d].view(t, d)
        return x[:, :d].contiguous()
    srcs = [src(i).requires_grad_(True) for i in range(n)]
    q = (torch.randn(d, generator=g) / d**0.5).to(pd).to(dev).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(pd).to(dev).requires_grad_(True)
    for partial in (False, True):  # all gradients / the query and one source only
        h, wt = attnres.depth_attention(srcs, q, w, return_weights=True)
        wanted = [srcs[-1], q] if partial else [*srcs, q, w]
        torch.autograd.grad((h.float().sum(), wt.sum()), wanted, allow_unused=True)
    torch.cuda.synchronize()
    print("ran", dtype, n, t, d, layout, flush=True)
print("sanitize shapes: done")
PY
  local status=ok tool rc
  : > "$summary"
  for tool in memcheck racecheck; do
    local each=$(( budget / 2 ))
    timeout "$each" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      --log-file "$RESULTS/sanitize_$tool.log" python3 "$script" > "$RESULTS/sanitize_$tool.out" 2>&1
    rc=$?
    local outcome
    case $rc in
      0) outcome=ok ;;
      99) outcome="FAILED (errors reported; see sanitize_$tool.log)"; status=failed ;;
      124) outcome="TIMED OUT after ${each} s ($(grep -c '^ran' "$RESULTS/sanitize_$tool.out") shapes done)" ;;
      *) outcome="rc=$rc (see sanitize_$tool.out)"; status=failed ;;
    esac
    echo "compute-sanitizer $tool: $outcome" | tee -a "$summary"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$RESULTS/sanitize_$tool.log" 2>/dev/null | tail -2
  done
  [ "$status" = ok ]
}

run_all 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$LOG" "$OUT/"
  for f in "$RESULTS"/gpu_*.csv "$RESULTS"/gpu_*.md "$RESULTS/resource_usage.txt" "$RESULTS/build.log" \
           "$RESULTS/sanitize.txt" "$RESULTS"/sanitize_*.log "$RESULTS"/sanitize_*.out; do
    [ -f "$f" ] && cp "$f" "$OUT/"
  done
fi
exit $rc
