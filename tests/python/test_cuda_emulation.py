"""Runs the CUDA kernels on the CPU through tests/cuda_emulation (no GPU needed).

The kernel source csrc/cuda/kernels.cuh is compiled, unchanged, as host C++
against a stand-in cuda_runtime.h (threads, barriers and warp shuffles
emulated), with the parameter blocks and launch shapes of
csrc/cuda/kernel_params.h (the CUDA host code's own set-up), and every output
is checked against a float64 evaluation of the formulas with the tolerances
of tests/tolerances.txt. Each emulated CUDA thread is a fiber on one OS
thread (test_emulated_runtime checks the runtime's barriers, its two thread
orders and its deadlock detection). This covers the parallel decomposition of
the kernels (lanes, masks, reductions, staging, partial sums) wherever a C++20
compiler is available; numerics on a real GPU are covered by test_cuda.py.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EMU_DIR = os.path.join(ROOT, "tests", "cuda_emulation")
DTYPES = ["float64", "float32", "bfloat16", "float16"]


def _compiler():
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(tmp_path_factory, program):
    """Compiles tests/cuda_emulation/<program>.cpp against the stand-in runtime."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler found (set CXX) to build the CUDA kernel emulation")
    build = tmp_path_factory.mktemp("cuda_emulation")
    torch_dir = os.path.dirname(torch.__file__)
    exe = build / program
    cmd = [
        cxx, "-std=c++20", "-O1", "-pthread",
        f"-I{EMU_DIR}", f"-I{os.path.join(ROOT, 'csrc', 'cuda')}",
        f'-DATTNRES_TOLERANCES_FILE="{os.path.join(ROOT, "tests", "tolerances.txt")}"',
        f"-I{os.path.join(ROOT, 'csrc', 'include')}", f"-I{os.path.join(torch_dir, 'include')}",
        os.path.join(EMU_DIR, program + ".cpp"), "-o", str(exe),
        f"-L{os.path.join(torch_dir, 'lib')}", "-lc10", f"-Wl,-rpath,{os.path.join(torch_dir, 'lib')}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"building the CUDA kernel emulation failed:\n{' '.join(cmd)}\n{result.stderr[-4000:]}")
    return exe


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return _build(tmp_path_factory, "emulate_kernels")


@pytest.fixture(scope="module")
def block_emulator(tmp_path_factory):
    return _build(tmp_path_factory, "emulate_block_kernels")


@pytest.fixture(scope="module")
def runtime_selftest(tmp_path_factory):
    return _build(tmp_path_factory, "emulate_runtime_selftest")


@pytest.fixture(scope="module")
def emulation_runs(emulator, tmp_path_factory):
    """The emulation of every dtype, started at once (each process runs its
    emulated threads on one core), so the dtypes share the machine's cores
    while the other tests of this module run. Output goes to files (no pipe
    to fill)."""
    logs = tmp_path_factory.mktemp("emulation_logs")
    runs = {}
    for dtype in DTYPES:
        out = open(logs / f"{dtype}.log", "w+")
        runs[dtype] = (subprocess.Popen([str(emulator), dtype], stdout=out, stderr=subprocess.STDOUT), out)
    yield runs
    for proc, out in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulation build is set up for Linux")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_emulated_on_cpu(emulation_runs, dtype):
    proc, out = emulation_runs[dtype]
    try:
        returncode = proc.wait(timeout=1500)  # all four dtypes share the machine
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the {dtype} emulation did not finish in 1500 s")
    out.seek(0)
    result = subprocess.CompletedProcess(proc.args, returncode, out.read(), "")
    assert result.returncode == 0, f"emulated CUDA kernels disagree with float64:\n{result.stdout}{result.stderr}"
    assert "0 failure(s)" in result.stdout
    assert result.stdout.count("ok ") >= 3, result.stdout  # cases did run
    # The forward's cp.async ring ran (and matched the register pipeline bit
    # for bit) in this dtype's cases.
    ring = [line for line in result.stdout.splitlines() if line.endswith("took the forward ring")]
    assert ring and int(ring[0].split()[0]) >= 10, result.stdout[-2000:]
    # The backward's ring ran too (and matched the backward without it, same
    # tile and grid, bit for bit).
    ring = [line for line in result.stdout.splitlines() if line.endswith("took the backward ring")]
    assert ring and int(ring[0].split()[0]) >= 10, result.stdout[-2000:]
    # The group classes' D sweep ran for both kernels, and every class case
    # was compared bit for bit with its kAnyGroup instantiation.
    for kernel in ("forward", "backward"):
        assert f"{kernel} group classes:" in result.stdout, result.stdout
    assert "any_group_bits=0" in result.stdout, result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulation build is set up for Linux")
def test_block_read_kernels_emulated_on_cpu(block_emulator):
    """The two-phase Block reads' CUDA kernels (csrc/cuda/block_kernels.cuh),
    phase 1 and phase 2, forward and backward, with and without the fused output
    norm (out_weight), in every
    dtype, against long double."""
    result = subprocess.run([str(block_emulator)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"emulated block-read kernels disagree:\n{result.stdout[-6000:]}{result.stderr}"
    assert "0 failure(s)" in result.stdout
    for dtype in DTYPES:
        for what in ("phase1", "merge vec=", "merge in place", " norm", "overflow"):
            assert any(dtype in line and what in line for line in result.stdout.splitlines()), (dtype, what)
    # The range rescue and the wide, clamped sums ran (not in float16, whose
    # range cannot reach them).
    assert " at max " in result.stdout and " range " in result.stdout
    # Phase 2's backward ran in every dtype, with and without out_weight, its partial
    # rows summed (z, dw), and on the rare tokens (not in float16).
    lines = [line for line in result.stdout.splitlines() if "merge backward" in line]
    for dtype in DTYPES:
        for what in (" z:", " norm", " dw:"):
            assert any(dtype in line and what in line for line in lines), (dtype, what)
    assert any("range" in line and "norm" in line for line in lines)
    # Phase 1's backward too: every dtype, reader 0 with out_weight, the lse gradient
    # alone, the source table's overflow, and the rare tokens.
    lines = [line for line in result.stdout.splitlines() if "reads backward" in line]
    for dtype in DTYPES:
        for what in (" dv:", " z:", " norm", "(no dy)", " overflow"):
            assert any(dtype in line and what in line for line in lines), (dtype, what)
    assert any("range" in line and "(no dy)" in line for line in lines)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulation build is set up for Linux")
def test_emulated_runtime(runtime_selftest):
    """The emulated runtime that every kernel case above relies on: exact
    barrier and shuffle reductions, a missing __syncthreads seen as stale
    data, and a barrier that cannot complete failing the launch (no hang)."""
    result = subprocess.run([str(runtime_selftest)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failure(s)" in result.stdout
    assert result.stdout.count("ok ") == 7, result.stdout
