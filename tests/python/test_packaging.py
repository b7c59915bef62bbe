"""Packaging: the sdist builds, and the wheel built from it installs and runs.

One test, three steps, every one from scratch (nothing is cached between
runs, so a file missing from MANIFEST.in fails here and not for a user):

1. sdist: the PEP 517 hook ``setuptools.build_meta.build_sdist`` (what
   ``python -m build --sdist --no-isolation`` calls) on a copy of the source
   tree without build outputs (.venv, build dirs, *.so, *.egg-info: a stale
   egg-info SOURCES.txt would add files that MANIFEST.in forgot);
2. wheel from the unpacked sdist: ``pip wheel --no-build-isolation`` with this
   interpreter (its torch, setuptools, cmake, ninja), CPU-only
   (ATTNRES_NO_CUDA=1) to bound the time, and without ATTNRES_BUILD_DIR, so
   CMake builds in a fresh directory inside the unpacked sdist;
3. a clean venv: the wheel installed with ``--no-deps``, torch made visible
   by a .pth file naming this interpreter's torch directory (no reinstall),
   then run isolated (``python -I``, a temporary cwd) so that attnres can only
   come from the wheel: import, a CPU forward + backward against the eager
   reference.

The wheel must hold _C*.so, libattnres.so, py.typed and metadata with the
license, the version of python/attnres/_version.py, ``torch==<the torch it
was built against>`` and the ``demo`` extra.
"""
import email.parser
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Never copied into the sdist's source tree (build outputs and environments;
# see .gitignore).
_NOT_SOURCES = [".git", ".venv", "venv", "build", "build-*", "dist", "*.egg-info", "__pycache__",
                ".pytest_cache", "demo_out", ".whl", "*.so", "*.o", "*.py[cod]", ".stamp-*"]


def _which(name):
    """Like shutil.which, also looking beside this interpreter (pip's cmake/ninja)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which(name, path=path)


def _build_tools_missing():
    if not _which("cmake"):
        return "cmake not found (install it or `pip install cmake`)"
    compilers = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if not any(c and _which(c) for c in compilers):
        return "no C++ compiler found (CXX, c++, g++, clang++)"
    return None


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({proc.returncode})\n"
        f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return proc


def _build_env():
    env = dict(os.environ)
    for var in ("ATTNRES_BUILD_DIR", "ATTNRES_BUILD_TESTS", "PYTHONPATH", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(var, None)
    env["ATTNRES_NO_CUDA"] = "1"
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    env["PIP_NO_CACHE_DIR"] = "1"  # never a wheel cached by an earlier run
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _expected_version():
    text = (ROOT / "python" / "attnres" / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert match, "python/attnres/_version.py has no __version__ line"
    return match.group(1)


SMOKE = textwrap.dedent(
    """
    import os, sys, sysconfig
    import importlib.metadata as md
    import torch
    import attnres
    from attnres import reference

    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    here = os.path.realpath(attnres.__file__)
    assert here.startswith(site + os.sep), f"attnres imported from {here}, not the venv ({site})"
    others = [p for p in sys.path if p and os.path.isfile(os.path.join(p, "attnres", "__init__.py"))
              and os.path.realpath(p) != site]
    assert not others, f"another attnres on sys.path: {others}"
    assert attnres.__version__ == md.version("attnres"), (attnres.__version__, md.version("attnres"))

    torch.manual_seed(0)
    sources = [torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    query = torch.randn(16, dtype=torch.float64, requires_grad=True)
    gain = torch.rand(16, dtype=torch.float64, requires_grad=True)
    h = attnres.depth_attention(sources, query, gain)
    h.backward(torch.ones_like(h))
    grads = [s.grad for s in sources] + [query.grad, gain.grad]
    for t in sources + [query, gain]:
        t.grad = None
    ref = reference.depth_attention(sources, query, gain)
    ref.backward(torch.ones_like(ref))
    ref_grads = [s.grad for s in sources] + [query.grad, gain.grad]
    torch.testing.assert_close(h, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    print("attnres", attnres.__version__, "from", here)
    """
)


@pytest.mark.slow
def test_sdist_builds_a_wheel_that_installs_and_runs(tmp_path):
    missing = _build_tools_missing()
    if missing:
        pytest.skip(missing)
    env = _build_env()
    version = _expected_version()
    torch_pin = "torch==" + torch.__version__.split("+")[0]

    # 1. sdist from a clean copy of the source tree
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCES), symlinks=True)
    sdist_dir = tmp_path / "sdist"
    sdist_dir.mkdir()
    _run([sys.executable, "-c",
          "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))",
          str(sdist_dir)], cwd=src, env=env)
    (sdist,) = sdist_dir.glob("attnres-*.tar.gz")
    assert sdist.name == f"attnres-{version}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ["CMakeLists.txt", "setup.py", "pyproject.toml", "README.md", "LICENSE",
                   "csrc/ops.cpp", "csrc/python_module.cpp", "csrc/include/attnres/ops.h",
                   "python/attnres/__init__.py", "python/attnres/_version.py",
                   "python/attnres/py.typed", "tests/tolerances.txt"]:
        assert needed in names, f"{needed} missing from the sdist"
    # every source, header and CUDA file (a CPU-only build would not notice a missing .cu/.cuh)
    sources = {p.relative_to(src).as_posix() for p in (src / "csrc").rglob("*") if p.is_file()}
    assert sources <= names, f"missing from the sdist: {sorted(sources - names)}"
    assert not [n for n in names if fnmatch.fnmatch(n, "*.so")], "built libraries in the sdist"

    # 2. wheel from the sdist (pip unpacks it into its own temporary directory)
    wheel_dir = tmp_path / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--wheel-dir", str(wheel_dir), str(sdist)], cwd=tmp_path, env=env)
    (wheel,) = wheel_dir.glob("attnres-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
        meta = email.parser.Parser().parsestr(zf.read(f"attnres-{version}.dist-info/METADATA").decode())
    assert [f for f in files if fnmatch.fnmatch(f, "attnres/_C*.so")], files
    for needed in ["attnres/libattnres.so", "attnres/py.typed", "attnres/_version.py",
                   f"attnres-{version}.dist-info/licenses/LICENSE"]:
        assert needed in files, f"{needed} missing from the wheel: {files}"
    assert meta["Name"] == "attnres"
    assert meta["Version"] == version
    assert meta["License-Expression"] == "MIT"
    assert "LICENSE" in meta.get_all("License-File", [])
    assert meta["Requires-Python"] == ">=3.10"
    requires = meta.get_all("Requires-Dist", [])
    assert torch_pin in requires, requires
    assert "demo" in meta.get_all("Provides-Extra", [])
    assert {'matplotlib; extra == "demo"', 'tqdm; extra == "demo"'} <= set(requires), requires

    # 3. clean venv: the wheel, this interpreter's torch, nothing from the source tree
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env=env)
    vpy = venv / "bin" / "python"
    _run([str(vpy), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], env=env)
    purelib = _run([str(vpy), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   env=env).stdout.strip()
    # Added after the install, so pip never saw this interpreter's packages;
    # a path line in a .pth file does not run that directory's .pth files
    # (so an editable attnres installed there stays invisible).
    torch_site = os.path.dirname(os.path.dirname(torch.__file__))
    Path(purelib, "_test_torch.pth").write_text(torch_site + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = _run([str(vpy), "-I", "-c", SMOKE], cwd=run_dir, env=env).stdout
    assert f"attnres {version} from " in out, out


# Symbols only a libstdc++ defines: an extension that exports them carries a
# static copy of it whose locale state mixes with the process's shared one
# (formatting a double into an error message then crashed).
LIBSTDCXX_SYMBOLS = ("_ZNSo9_M_insertIdEERSoT_", "_ZNSt6locale7classicEv")


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils) to list exported symbols")
def test_libraries_export_no_libstdcxx_symbols():
    import attnres

    libs = sorted(Path(attnres.__file__).parent.glob("*.so"))
    assert any(p.name.startswith("libattnres") for p in libs), libs
    for lib in libs:
        out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout
        exported = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
        assert not exported & set(LIBSTDCXX_SYMBOLS), (lib, exported & set(LIBSTDCXX_SYMBOLS))


def test_libraries_link_static_archives_locally():
    """With a shared libstdc++ (this machine's) the test above passes either
    way; the link line of `make build`'s tree shows the flag that keeps a
    static one's symbols local."""
    ninja = ROOT / "build-cmake" / "build.ninja"
    if not ninja.exists():
        pytest.skip("no build-cmake/build.ninja (the tree `make build` configures)")
    text = ninja.read_text()
    for target in ("libattnres.so", "_C."):
        links = [block for block in text.split("\nbuild ") if block.startswith(target) and "LINK_FLAGS" in block]
        assert links and all("--exclude-libs,ALL" in b for b in links), target
