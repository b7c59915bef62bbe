// CPU registration of every op (depth_attention and the two-phase Block
// reads). Built without the vector ISA flags, so the capability check below
// runs before any AVX2 instruction can: the kernels in kernels_cpu.cpp and
// block_reads_cpu.cpp are reached only through it.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "attnres/block_read_sequence.h"
#include "attnres/op_sequence.h"
#include "block_reads_cpu.h"
#include "kernels_cpu.h"

namespace attnres {
namespace cpu {
namespace {

// The kernels built with AVX2 code (CMake option ATTNRES_CPU_ARCH=avx2):
// refuse to run on a CPU without it rather than die on an illegal instruction.
void check_cpu_capability() {
#if defined(ATTNRES_CPU_KERNELS_AVX2)
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  TORCH_CHECK(ok,
              "attnres was built with AVX2 CPU kernels (ATTNRES_CPU_ARCH="
              "avx2) but this CPU lacks AVX2/FMA; rebuild with "
              "ATTNRES_CPU_ARCH=default");
#endif
}

void check_supported(const DepthProblem&) { check_cpu_capability(); }

constexpr DeviceKernels kCpuKernels{&check_supported, &forward, &backward};
constexpr BlockReadKernels kCpuBlockReadKernels{&check_cpu_capability, &block_reads_forward,
                                                &block_read_merge_forward,
                                                &block_read_merge_backward,
                                                &block_reads_backward};

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CPU, m) {
  register_device_kernels<kCpuKernels>(m);
  register_block_read_kernels<kCpuBlockReadKernels>(m);
}

}  // namespace cpu
}  // namespace attnres
