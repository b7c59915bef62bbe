// CPU registration of both ops. Built without the vector ISA flags, so the
// capability check below runs before any AVX2 instruction can: the kernels
// in kernels_cpu.cpp are reached only through it.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "attnres/op_sequence.h"
#include "kernels_cpu.h"

namespace attnres {
namespace cpu {
namespace {

// kernels_cpu.cpp built with AVX2 code (CMake option ATTNRES_CPU_ARCH=avx2):
// refuse to run on a CPU without it rather than die on an illegal instruction.
void check_cpu_capability(const DepthProblem&) {
#if defined(ATTNRES_CPU_KERNELS_AVX2)
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  TORCH_CHECK(ok,
              "attnres was built with AVX2 CPU kernels (ATTNRES_CPU_ARCH="
              "avx2) but this CPU lacks AVX2/FMA; rebuild with "
              "ATTNRES_CPU_ARCH=default");
#endif
}

constexpr DeviceKernels kCpuKernels{&check_cpu_capability, &forward, &backward};

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CPU, m) { register_device_kernels<kCpuKernels>(m); }

}  // namespace cpu
}  // namespace attnres
