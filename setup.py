"""Builds the attnres Python package: the extension attnres._C and the op
library libattnres beside it, both built by CMake (CMakeLists.txt is the one
build description: CUDA on/off, GPU archs and CPU vector code are decided
there; its status lines say what it chose).

Environment: ATTNRES_NO_CUDA=1 (CPU-only, no CUDA toolkit needed),
ATTNRES_CPU_ARCH=avx2|default, TORCH_CUDA_ARCH_LIST, MAX_JOBS (parallel
compile jobs), ATTNRES_BUILD_DIR (CMake build directory to use, e.g. to share
it with the C++ test build), ATTNRES_BUILD_TESTS=1 (also build the GoogleTest
suite there).
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = "libattnres.so"  # the op library the extension module loads


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch  # the LibTorch the extension is built against

        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.environ.get("ATTNRES_BUILD_DIR") or self.build_temp)
        os.makedirs(build_dir, exist_ok=True)
        _forget_foreign_cache(build_dir, torch.utils.cmake_prefix_path)
        on_off = lambda flag: "ON" if flag else "OFF"  # noqa: E731
        configure = [
            "cmake", "-S", HERE, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DATTNRES_BUILD_PYTHON=ON",
            f"-DATTNRES_BUILD_TESTS={on_off(os.environ.get('ATTNRES_BUILD_TESTS') == '1')}",
            f"-DATTNRES_NO_CUDA={on_off(os.environ.get('ATTNRES_NO_CUDA') == '1')}",
        ]
        ninja = _ninja()
        if ninja and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", build_dir, "-j", jobs], check=True)
        # _C finds libattnres beside it ($ORIGIN), in the build tree and here.
        os.makedirs(out_dir, exist_ok=True)
        module = os.path.basename(self.get_ext_filename(ext.name))
        for name in (module, LIBRARY):
            shutil.copy2(os.path.join(build_dir, name), os.path.join(out_dir, name))

    def copy_extensions_to_source(self):
        # Editable installs copy the extension module into the source tree;
        # the op library it loads (beside it, via $ORIGIN) must come along.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            self.copy_file(os.path.join(os.path.dirname(regular_file), LIBRARY),
                           os.path.join(os.path.dirname(inplace_file), LIBRARY))


def _forget_foreign_cache(build_dir, torch_cmake_prefix):
    """Start a build directory afresh when another environment configured it:
    its CMakeCache.txt names that environment's cmake, ninja, Python and
    LibTorch, and pip's isolated build environments are deleted after each
    build (a second `pip install .` would run a cmake or ninja that is gone)."""
    cache_file = os.path.join(build_dir, "CMakeCache.txt")
    if not os.path.exists(cache_file):
        return
    cache = {}
    with open(cache_file) as f:
        for line in f:
            name, sep, value = line.rstrip("\n").partition("=")
            if sep and not line.startswith(("#", "//")):
                cache[name.split(":", 1)[0]] = value
    torch_prefix = os.path.realpath(torch_cmake_prefix) + os.sep
    same = (
        os.path.realpath(cache.get("ATTNRES_TORCH_CMAKE_DIR", "")).startswith(torch_prefix)
        and cache.get("Python3_EXECUTABLE") == sys.executable
        and all(os.path.exists(cache.get(tool) or os.sep)
                for tool in ("CMAKE_COMMAND", "CMAKE_MAKE_PROGRAM"))
    )
    if not same:
        print(f"attnres: {build_dir} was configured by another environment; reconfiguring")
        os.remove(cache_file)
        shutil.rmtree(os.path.join(build_dir, "CMakeFiles"), ignore_errors=True)


def _ninja():
    """ninja from this Python's environment (pip's ninja package) or PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("ninja", path=path)


def _torch_requirement():
    """torch==<the torch this build compiles against>: _C and libattnres link
    LibTorch's C++ ABI, which changes between torch releases. The local part
    (+cu130, +cpu) is dropped: PyPI's torch has none."""
    try:
        import torch
    except ImportError:
        # Metadata without a build (e.g. an sdist made without torch): the
        # requirement is marked dynamic and a wheel build needs torch anyway.
        return "torch"
    return "torch==" + torch.__version__.split("+")[0]


# The metadata is in pyproject.toml; the version in python/attnres/_version.py.
setup(
    ext_modules=[Extension("attnres._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # numpy: `import torch` warns "Failed to initialize NumPy" without it.
    install_requires=[_torch_requirement(), "numpy"],
)
