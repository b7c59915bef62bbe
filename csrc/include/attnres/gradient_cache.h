// The CPU gradient cache: the ops' large CPU outputs — the backward ops'
// gradients and the forward ops' read outputs (h, y, partial outputs) — come
// from a small cache of freed blocks instead of straight from malloc.
//
// Why: glibc returns a freed block of many MiB to the OS (munmap, or a heap
// trim), so the next call faults its outputs in again page by page — on a
// 2-core VM ~0.3 ms per MiB, more than the kernel's own time for a
// float32 N = 16 [4096, 1024] backward; on a 2-core AMD EPYC VM a float32
// N = 4 [4096, 4096] forward took 17.9 ms with a fresh 64 MiB h (16k
// faults) and 8.3 ms with a kept one (docs/design.md §6). The cache keeps freed blocks (>= 1 MiB) for the next
// call, like PyTorch's CUDA caching allocator does on GPUs. The name says
// "gradient" because the backward's outputs were its first users; the API
// (below, and attnres.cpu_gradient_cache_* in Python) is unchanged.
//
// Bounded: at most `limit` bytes of *free* blocks are kept (default 1 GiB,
// environment variable ATTNRES_CPU_GRAD_CACHE_MB at the first use; 0 turns
// the cache off). Blocks in use are the gradients' own memory, as with malloc.
// When a freed block does not fit, the oldest free blocks are returned to
// the system first. Allocations and frees are reported to the PyTorch
// profiler like the default CPU allocator's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace attnres {

struct GradientCacheStats {
  int64_t limit_bytes = 0;    // most bytes of free blocks kept
  int64_t cached_bytes = 0;   // free blocks kept now
  int64_t cached_blocks = 0;
  int64_t in_use_bytes = 0;   // blocks handed out and not freed yet
  int64_t hits = 0;           // allocations served by a kept block
  int64_t misses = 0;         // allocations that went to the system allocator
};

GradientCacheStats cpu_gradient_cache_stats();
// Sets the limit (bytes >= 0; 0 turns the cache off) and frees kept blocks
// beyond it.
void set_cpu_gradient_cache_limit(int64_t bytes);
// Returns every kept free block to the system (blocks in use stay valid).
void empty_cpu_gradient_cache();

namespace detail {
// at::empty(sizes, options) in the contiguous format; CPU tensors of at least
// 1 MiB come from the cache while it is on. For the ops' row-sized outputs.
at::Tensor empty_cached(at::IntArrayRef sizes, const at::TensorOptions& options);
}  // namespace detail

}  // namespace attnres
