"""Builds the attnres extension (torch ops in attnres._C).

CUDA kernels are compiled whenever nvcc is found (CUDA_HOME), whether or not
a GPU is visible; TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0". Without nvcc the
CPU-only extension is built. ATTNRES_CPU_ARCH=avx2|default picks the CPU
vector code (default: avx2 when this machine's CPU has AVX2 and FMA).
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_has_avx2():
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def cpu_arch_flags():
    arch = os.environ.get("ATTNRES_CPU_ARCH") or ("avx2" if cpu_has_avx2() else "default")
    if arch == "avx2":
        return arch, ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    if arch == "default":
        return arch, ["-DCPU_CAPABILITY=DEFAULT"]
    raise SystemExit(f"ATTNRES_CPU_ARCH must be 'avx2' or 'default', got {arch!r}")


def extensions():
    arch, arch_flags = cpu_arch_flags()
    sources = [
        "csrc/ops.cpp",
        "csrc/checks.cpp",
        "csrc/python_module.cpp",
        *sorted(glob.glob("csrc/cpu/*.cpp")),
    ]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    if os.environ.get("ATTNRES_NO_CUDA") == "1":
        why_not = "ATTNRES_NO_CUDA=1"
    elif cpp_extension.CUDA_HOME is None:
        why_not = "no nvcc/CUDA_HOME found"
    elif not cuda_sources:
        why_not = "no csrc/cuda/*.cu sources"
    else:
        why_not = None
    with_cuda = why_not is None
    # -fopenmp: at::parallel_for is an inline OpenMP loop in ATen's headers;
    # without the flag it silently runs on one thread.
    cxx = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fopenmp", *arch_flags]
    link = ["-fopenmp"]
    include_dirs = [os.path.join(HERE, "csrc", "include")]
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        nvcc = ["-O3", "-std=c++17", "-lineinfo", "-DATTNRES_WITH_CUDA"]
        print(
            f"attnres build: CUDA kernels ON (nvcc at {cpp_extension.CUDA_HOME}, "
            f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}), CPU vector code {arch}"
        )
        return [
            cpp_extension.CUDAExtension(
                "attnres._C",
                sources + cuda_sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx + ["-DATTNRES_WITH_CUDA"], "nvcc": nvcc},
                extra_link_args=link,
            )
        ]
    print(f"attnres build: CUDA kernels OFF ({why_not}), CPU vector code {arch}")
    return [
        cpp_extension.CppExtension(
            "attnres._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    ]


setup(
    name="attnres",
    version="0.1.0",
    description="Fused Attention Residuals (depth attention) torch ops for CPU and CUDA",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.10",
    install_requires=["torch"],
)
