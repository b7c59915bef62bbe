"""Export and deployment: torch.export and AOTInductor of models with AttnRes,
run from Python and from C++.

* torch.export.export (non-strict and strict, dynamic batch and sequence
  length) of the example GPT with Full and Block AttnRes: the graph keeps
  every depth read as one ``torch.ops.attnres.depth_attention_fwd`` node (also
  after ``run_decompositions()``), and the exported program matches eager.
* torch.export.save / load in a fresh process: load fails until
  ``import attnres`` has registered the ops, then runs and matches.
* AOTInductor: ``aoti_compile_and_package`` of a Full and a Block GPT (one
  package, one compile), loaded with ``aoti_load_package`` in this process,
  matches eager; the same package run by a C++ program
  (tests/cpp/aoti/aoti_run.cpp, ``torch::inductor::AOTIModelPackageLoader``)
  built out of tree against the *installed* CMake package attnres
  (``find_package(attnres CONFIG)``, ``attnres::attnres``) matches Python;
  the same program linked without attnres fails to load the package with
  the dispatcher's "Could not find schema for attnres::depth_attention_fwd".

The installed package is looked up at build-cmake/install (``make test``
installs it there), or at $ATTNRES_INSTALL_PREFIX. When it is missing the C++
tests skip, unless ATTNRES_REQUIRE_INSTALL=1 (set by ``make test``), where
they fail.

Time on the project's 2-core VM: the AOTInductor compile (~50 s, of which
~20 s is inductor's one-off probe of the CPU's vector ISA, shared with any
other inductor compile of the session) and the CMake configure + build of
the C++ program (~25 s) are shared by the tests marked slow.
"""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attnres  # noqa: F401  (registers torch.ops.attnres.*)
from attnres.models import GPT, GPTConfig
from helpers import randomize_reads

ROOT = Path(__file__).resolve().parents[2]
AOTI_CPP_SOURCE = ROOT / "tests" / "cpp" / "aoti"
DEPTH_FWD = torch.ops.attnres.depth_attention_fwd.default

VOCAB, SEQ, N_LAYERS = 64, 16, 2
# Shapes of the calls after export: the export example, another batch and a
# shorter sequence, and the smallest (one token).
CALL_SHAPES = [(2, SEQ), (3, 7), (1, 1)]

# The exported program runs the same eager kernels: equal up to rounding
# noise. AOTInductor fuses and reorders the rest of the model (layer norms,
# GELU, GEMMs), so float32 roundings differ: measured max abs difference
# ~1.5e-6 on logits up to ~0.7.
EXPORT_TOL = dict(rtol=1e-5, atol=1e-6)
AOTI_TOL = dict(rtol=1e-4, atol=1e-5)
# C++ runs the very same compiled package as Python (same kernels, same
# thread count): expected bit-equal; a little room for GEMM thread splits.
CPP_VS_PYTHON_RTOL, CPP_VS_PYTHON_ATOL = 1e-5, 1e-6


def tiny_gpt(residual: str, seed: int = 0) -> GPT:
    # 2 layers = 4 sublayers; block size 3 does not divide them, so the Block
    # model's reads see completed blocks and a partial one.
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=N_LAYERS,
                          n_heads=2, residual=residual, block_size=3))
    randomize_reads(model)
    return model.eval()


def call_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, shape, generator=g) for shape in CALL_SHAPES]


def dynamic_idx():
    return {0: torch.export.Dim("batch", min=1, max=64),
            1: torch.export.Dim("seq", min=1, max=SEQ)}


def attnres_targets(ep: torch.export.ExportedProgram):
    return [n.target for n in ep.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "attnres"]


def assert_one_op_per_read(ep: torch.export.ExportedProgram) -> None:
    # One read per sublayer plus the final read, each one fused op, nothing
    # decomposed into aten.
    assert attnres_targets(ep) == [DEPTH_FWD] * (2 * N_LAYERS + 1), attnres_targets(ep)


def compiler_missing():
    if not any(c and shutil.which(c) for c in (os.environ.get("CXX"), "c++", "g++", "clang++")):
        return "no C++ compiler found (CXX, c++, g++, clang++)"
    return None


def toolchain_missing():
    if not shutil.which("cmake"):
        return "cmake not found"
    return compiler_missing()


def run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({proc.returncode})\n"
        f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return proc


# ---- torch.export -------------------------------------------------------------------


@pytest.mark.parametrize(
    "residual, strict",
    # Dynamo's strict tracing of DepthStream is covered by the torch.compile
    # tests as well; once here.
    [("full", False), ("block", False), ("block", True)],
    ids=["full", "block", "block-strict"],
)
def test_export_matches_eager(residual, strict):
    model = tiny_gpt(residual)
    example = call_inputs()[0]
    ep = torch.export.export(
        model, (example,), {"return_depth_weights": True},
        dynamic_shapes={"idx": dynamic_idx(), "return_depth_weights": None}, strict=strict,
    )
    assert_one_op_per_read(ep)
    exported = ep.module()
    for idx in call_inputs():
        logits, _, weights = exported(idx, return_depth_weights=True)
        ref_logits, _, ref_weights = model(idx, return_depth_weights=True)
        torch.testing.assert_close(logits, ref_logits, **EXPORT_TOL)
        assert len(weights) == len(ref_weights) == 2 * N_LAYERS + 1
        for w, ref in zip(weights, ref_weights):
            assert w.dtype == torch.float32
            torch.testing.assert_close(w, ref, **EXPORT_TOL)


def test_run_decompositions_keeps_the_op():
    model = tiny_gpt("block")
    idx = call_inputs()[1]
    ep = torch.export.export(model, (idx,)).run_decompositions()
    assert_one_op_per_read(ep)
    torch.testing.assert_close(ep.module()(idx)[0], model(idx)[0], **EXPORT_TOL)


def test_export_save_load_needs_import_attnres(tmp_path):
    """A saved ExportedProgram loads in a fresh process once ``import attnres``
    has registered the ops, and not before."""
    model = tiny_gpt("block")
    inputs = call_inputs()
    ep = torch.export.export(model, (inputs[0],), dynamic_shapes={"idx": dynamic_idx()})
    torch.export.save(ep, tmp_path / "gpt.pt2")
    torch.save({"inputs": inputs, "expected": [model(idx)[0] for idx in inputs]},
               tmp_path / "io.pt")
    script = textwrap.dedent("""
        import sys, torch
        gpt, io_path = sys.argv[1], sys.argv[2]
        try:
            torch.export.load(gpt)
        except Exception as e:
            print("without attnres:", type(e).__name__, e)
        else:
            sys.exit("torch.export.load succeeded before import attnres")
        import attnres
        ep = torch.export.load(gpt)
        data = torch.load(io_path)
        for idx, expected in zip(data["inputs"], data["expected"]):
            torch.testing.assert_close(ep.module()(idx)[0], expected, rtol=1e-5, atol=1e-6)
        print("with attnres: ok")
    """)
    proc = run([sys.executable, "-c", script, tmp_path / "gpt.pt2", tmp_path / "io.pt"],
               cwd=tmp_path)
    # torch logs why the first load failed: the op was not registered.
    assert "without attnres:" in proc.stdout, proc.stdout
    assert "attnres.depth_attention_fwd" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "with attnres: ok" in proc.stdout, proc.stdout


# ---- AOTInductor --------------------------------------------------------------------


class FullAndBlock(torch.nn.Module):
    """Both AttnRes variants in one package (one AOTInductor compile)."""

    def __init__(self):
        super().__init__()
        self.full = tiny_gpt("full", seed=0)
        self.block = tiny_gpt("block", seed=1)

    def forward(self, idx):
        logits_full, _ = self.full(idx)
        logits_block, _, weights = self.block(idx, return_depth_weights=True)
        # Also one depth-weight tensor (float32 [num_sources, B, T]).
        return logits_full, logits_block, weights[-1]


@pytest.fixture(scope="module")
def aoti_package(tmp_path_factory):
    """(eager model, path of its .pt2 package): exported with dynamic batch
    and sequence length, compiled for CPU by AOTInductor."""
    missing = compiler_missing()
    if missing:
        pytest.skip(f"AOTInductor compiles C++: {missing}")
    model = FullAndBlock().eval()
    ep = torch.export.export(model, (call_inputs()[0],), dynamic_shapes={"idx": dynamic_idx()})
    path = tmp_path_factory.mktemp("aoti") / "full_and_block.pt2"
    out = torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return model, Path(out)


@pytest.mark.slow
def test_aoti_python_matches_eager(aoti_package):
    model, path = aoti_package
    runner = torch._inductor.aoti_load_package(str(path))
    for idx in call_inputs():
        outputs = runner(idx)
        expected = model(idx)
        assert len(outputs) == len(expected) == 3
        for out, ref in zip(outputs, expected):
            assert out.shape == ref.shape and out.dtype == ref.dtype
            torch.testing.assert_close(out, ref, **AOTI_TOL)


def install_prefix() -> Path:
    return Path(os.environ.get("ATTNRES_INSTALL_PREFIX") or ROOT / "build-cmake" / "install").resolve()


@pytest.fixture(scope="module")
def aoti_cpp(tmp_path_factory):
    """The C++ runner (tests/cpp/aoti) configured and built out of tree
    against the installed attnres package: directory of the executables."""
    missing = toolchain_missing()
    if missing:
        pytest.skip(f"the C++ AOTInductor runner cannot be built: {missing}")
    prefix = install_prefix()
    # Where `cmake --install` puts it (lib/ or lib64/), and share/ for packagers.
    configs = [c for pattern in ("lib*/cmake/attnres/attnresConfig.cmake",
                                 "share/cmake/attnres/attnresConfig.cmake")
               for c in prefix.glob(pattern)]
    if not configs:
        why = (f"the installed attnres CMake package is missing: no attnresConfig.cmake under "
               f"{prefix} (install it with `cmake --install build-cmake --prefix {prefix}`, "
               f"or set ATTNRES_INSTALL_PREFIX)")
        if os.environ.get("ATTNRES_REQUIRE_INSTALL") == "1":
            pytest.fail(why + "; ATTNRES_REQUIRE_INSTALL=1 (make test) requires it")
        pytest.skip(why)

    build = tmp_path_factory.mktemp("aoti_cpp")
    configure = [
        "cmake", "-S", AOTI_CPP_SOURCE, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
        f"-DCMAKE_PREFIX_PATH={prefix};{torch.utils.cmake_prefix_path}",
        # As on distributions whose compilers link --as-needed by default
        # (Ubuntu): the program calls no attnres function, so libattnres
        # stays loaded only if attnres::attnres says --no-as-needed.
        "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed",
    ]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    proc = run(configure)
    # The package found must be the installed one, not some other attnres.
    assert f"from {prefix}/" in proc.stdout, proc.stdout
    run(["cmake", "--build", build, "-j", os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))])
    return build


def aoti_calls_files(directory: Path, runner):
    """Writes inputs.pt (the calls' inputs) and expected.pt (Python's outputs
    of the AOTInductor package) in the layout aoti_run.cpp reads."""
    calls = [[idx] for idx in call_inputs()]
    torch.save(calls, directory / "inputs.pt")
    expected = [[t.contiguous() for t in runner(*call)] for call in calls]
    torch.save(expected, directory / "expected.pt")
    return calls, expected


@pytest.mark.slow
def test_aoti_cpp_matches_python(aoti_cpp, aoti_package, tmp_path):
    # aoti_cpp first: a missing install skips before the AOTInductor compile.
    model, path = aoti_package
    calls, expected = aoti_calls_files(tmp_path, torch._inductor.aoti_load_package(str(path)))
    proc = run([aoti_cpp / "aoti_run", path, tmp_path / "inputs.pt", tmp_path / "outputs.pt",
                tmp_path / "expected.pt", CPP_VS_PYTHON_RTOL, CPP_VS_PYTHON_ATOL])
    assert "outputs match" in proc.stdout, proc.stdout
    # The outputs C++ wrote (torch::jit::pickle_save; our own file, hence
    # weights_only=False), checked here too: against Python's run of the
    # package, and against the eager model.
    outputs = torch.load(tmp_path / "outputs.pt", weights_only=False)
    assert len(outputs) == len(calls)
    for call, out, want in zip(calls, outputs, expected):
        ref = model(*call)
        assert len(out) == len(want) == len(ref) == 3
        for o, w, r in zip(out, want, ref):
            torch.testing.assert_close(o, w, rtol=CPP_VS_PYTHON_RTOL, atol=CPP_VS_PYTHON_ATOL)
            torch.testing.assert_close(o, r, **AOTI_TOL)


@pytest.mark.slow
def test_aoti_cpp_without_attnres_fails_to_load(aoti_cpp, aoti_package, tmp_path):
    """Why C++ programs must link attnres::attnres: the package's compiled code
    calls the op through the dispatcher, which must know its schema."""
    _, path = aoti_package
    torch.save([[call_inputs()[0]]], tmp_path / "inputs.pt")
    proc = subprocess.run(
        [str(aoti_cpp / "aoti_run_without_attnres"), str(path), str(tmp_path / "inputs.pt"),
         str(tmp_path / "outputs.pt")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "Could not find schema for attnres::depth_attention_fwd" in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs.pt").exists()
