// Host helpers shared by the CUDA op files (depth_attention_cuda.cu,
// block_reads_cuda.cu): the sources as the kernels' pointer table, and the
// output norm's weight in 16-byte packs. Included once per translation unit
// (everything here is internal to it).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attnres/row_layout.h"
#include "kernel_params.h"

namespace attnres {
namespace cuda {
namespace {

struct OverflowChunk {
  SourceEntry entries[kTableCapacity];
  int count;
};

__global__ void fill_overflow_table(const __grid_constant__ OverflowChunk chunk,
                                    SourceEntry* dst) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < chunk.count) dst[i] = chunk.entries[i];
}

// The sources as the kernels' pointer table (no stacking: strided rows are
// used in place; layouts that don't collapse to rows are copied once), with
// the entries past kTableCapacity written to device memory.
struct DeviceSources {
  std::vector<at::Tensor> keep;
  SourceTableLayout layout;
  at::Tensor overflow;  // SourceEntry[N - kTableCapacity] on the device

  DeviceSources(at::TensorList sources, const std::vector<at::Tensor>* grads, int64_t T,
                int natural, size_t elem_size, cudaStream_t stream) {
    std::vector<SourceEntry> entries(sources.size());
    keep.reserve(sources.size());
    for (size_t i = 0; i < sources.size(); ++i) {
      Rows r = as_rows(sources[i]);
      entries[i] = {r.tensor.const_data_ptr(), r.row_stride,
                    grads && (*grads)[i].defined() ? (*grads)[i].data_ptr() : nullptr};
      keep.push_back(std::move(r.tensor));
    }
    layout = layout_sources(entries, T, natural, elem_size);
    const int64_t n_overflow = static_cast<int64_t>(layout.overflow.size());
    if (n_overflow == 0) return;
    overflow = at::empty({n_overflow * static_cast<int64_t>(sizeof(SourceEntry))},
                         sources[0].options().dtype(at::kByte));
    auto* dst = reinterpret_cast<SourceEntry*>(overflow.data_ptr());
    for (int64_t first = 0; first < n_overflow; first += kTableCapacity) {
      OverflowChunk chunk{};
      chunk.count = static_cast<int>(std::min<int64_t>(kTableCapacity, n_overflow - first));
      std::copy_n(layout.overflow.begin() + first, chunk.count, chunk.entries);
      fill_overflow_table<<<1, kTableCapacity, 0, stream>>>(chunk, dst + first);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  const SourceEntry* overflow_on_device() const {
    return overflow.defined() ? reinterpret_cast<const SourceEntry*>(overflow.const_data_ptr())
                              : nullptr;
  }
};

// The output norm's weight as the kernels read it: VEC-element packs of the
// accumulation dtype, so 16-byte aligned (the op passes the caller's tensor
// through when it is already contiguous in that dtype, possibly a view at
// any offset): copied when it is not.
at::Tensor pack_aligned(const at::Tensor& weight) {
  if (reinterpret_cast<uintptr_t>(weight.const_data_ptr()) % 16 == 0) return weight;
  at::Tensor copy =
      at::empty_like(weight, weight.options().memory_format(at::MemoryFormat::Contiguous));
  copy.copy_(weight);
  return copy;
}

}  // namespace
}  // namespace cuda
}  // namespace attnres
