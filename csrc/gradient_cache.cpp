// The CPU gradient cache (attnres/gradient_cache.h): a c10::Allocator whose
// freed blocks go to a bounded list of free blocks instead of to free().
#include "attnres/gradient_cache.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace attnres {
namespace {

// Smaller blocks are recycled by malloc itself (they stay in its heap).
constexpr size_t kMinBlockBytes = size_t(1) << 20;
// Sizes are rounded up to this, so near-equal shapes share blocks.
constexpr size_t kGranuleBytes = size_t(64) << 10;
constexpr int64_t kDefaultLimitMiB = 1024;

int64_t limit_from_environment() {
  const char* text = std::getenv("ATTNRES_CPU_GRAD_CACHE_MB");
  if (text == nullptr || *text == '\0') return kDefaultLimitMiB << 20;
  char* end = nullptr;
  errno = 0;
  const long long mib = std::strtoll(text, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && end != text && *end == '\0' && mib >= 0 && mib < (1LL << 40),
                    "attnres: ATTNRES_CPU_GRAD_CACHE_MB must be a whole number of MiB >= 0, got '",
                    text, "'");
  return static_cast<int64_t>(mib) << 20;
}

class GradientCache final : public c10::Allocator {
 public:
  // Never destroyed: a gradient may be freed after static destructors ran.
  static GradientCache& instance() {
    static GradientCache* cache = new GradientCache();
    return *cache;
  }

  int64_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
    const size_t size = (nbytes + kGranuleBytes - 1) / kGranuleBytes * kGranuleBytes;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Newest first: its pages are the likeliest to be in a cache.
      for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
        if (it->first == size) {
          ptr = it->second;
          free_.erase(std::next(it).base());
          cached_bytes_ -= static_cast<int64_t>(size);
          ++hits_;
          mark_in_use_locked(ptr, size);
          break;
        }
      }
      if (ptr == nullptr) ++misses_;
    }
    if (ptr == nullptr) {
      ptr = c10::alloc_cpu(size);  // outside the lock: it may fault pages in
      std::lock_guard<std::mutex> lock(mutex_);
      mark_in_use_locked(ptr, size);
    }
    c10::profiledCPUMemoryReporter().New(ptr, size);
    return {ptr, ptr, &GradientCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &GradientCache::release; }

  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  GradientCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    GradientCacheStats s;
    s.limit_bytes = limit_;
    s.cached_bytes = cached_bytes_;
    s.cached_blocks = static_cast<int64_t>(free_.size());
    s.in_use_bytes = in_use_bytes_;
    s.hits = hits_;
    s.misses = misses_;
    return s;
  }

  void set_limit(int64_t bytes) {
    TORCH_CHECK_VALUE(bytes >= 0, "attnres: the CPU gradient cache limit must be >= 0 bytes, got ",
                      bytes);
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = bytes;
      evict_locked(0, to_free);
    }
    for (void* p : to_free) c10::free_cpu(p);
  }

  void empty() {
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& block : free_) to_free.push_back(block.second);
      free_.clear();
      cached_bytes_ = 0;
    }
    for (void* p : to_free) c10::free_cpu(p);
  }

 private:
  GradientCache() : limit_(limit_from_environment()) {}

  static void release(void* ptr) {
    if (ptr != nullptr) instance().give_back(ptr);
  }

  void give_back(void* ptr) {
    c10::profiledCPUMemoryReporter().Delete(ptr);
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = in_use_.find(ptr);
      TORCH_INTERNAL_ASSERT(it != in_use_.end(), "attnres: gradient cache: unknown block");
      const size_t size = it->second;
      in_use_.erase(it);
      in_use_bytes_ -= static_cast<int64_t>(size);
      if (static_cast<int64_t>(size) > limit_) {
        to_free.push_back(ptr);
      } else {
        evict_locked(static_cast<int64_t>(size), to_free);
        free_.emplace_back(size, ptr);
        cached_bytes_ += static_cast<int64_t>(size);
      }
    }
    for (void* p : to_free) c10::free_cpu(p);
  }

  void mark_in_use_locked(void* ptr, size_t size) {
    in_use_[ptr] = size;
    in_use_bytes_ += static_cast<int64_t>(size);
  }

  // Drops the oldest free blocks until `room` more bytes fit under the limit.
  void evict_locked(int64_t room, std::vector<void*>& to_free) {
    while (!free_.empty() && cached_bytes_ + room > limit_) {
      cached_bytes_ -= static_cast<int64_t>(free_.front().first);
      to_free.push_back(free_.front().second);
      free_.pop_front();
    }
  }

  std::mutex mutex_;
  int64_t limit_;
  std::list<std::pair<size_t, void*>> free_;  // oldest first
  std::unordered_map<void*, size_t> in_use_;
  int64_t cached_bytes_ = 0;
  int64_t in_use_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

}  // namespace

GradientCacheStats cpu_gradient_cache_stats() { return GradientCache::instance().stats(); }

void set_cpu_gradient_cache_limit(int64_t bytes) { GradientCache::instance().set_limit(bytes); }

void empty_cpu_gradient_cache() { GradientCache::instance().empty(); }

namespace detail {

at::Tensor empty_cached(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const auto contiguous = options.memory_format(at::MemoryFormat::Contiguous);
  if (options.device().type() != c10::DeviceType::CPU) return at::empty(sizes, contiguous);
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) *
                        c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  GradientCache& cache = GradientCache::instance();
  if (nbytes < kMinBlockBytes || cache.limit() == 0) return at::empty(sizes, contiguous);
  return at::detail::empty_generic(sizes, &cache, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()),
                                   at::MemoryFormat::Contiguous);
}

}  // namespace detail
}  // namespace attnres
