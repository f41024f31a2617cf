// Failures injected on purpose, for tests of the paths that handle them
// (SQLite's *fault.test style): each site fails its next `count` calls after
// `skip` that succeed. One per engine, armed through the internal API; a site
// that is not armed costs one relaxed load.
#pragma once

#include <atomic>
#include <cstdint>

namespace wkv {

class FaultInjector {
 public:
  enum Site : uint32_t {
    kEngineAlloc,  // a region of engine memory (host on the CPU, device on CUDA; pinned host for
                   // the f32 meta rows with WKV_CONFIG_HOST_META_ROWS)
    kPinning,      // pinning a host arena chunk for the device (CUDA)
    kGrowth,       // an index growth, before it changes anything (as if out of memory)
    kGraph,        // making a decode graph, or launching one (CUDA; as if the driver refused)
    kSites
  };

  void arm(Site site, uint32_t count, uint32_t skip = 0) {
    skip_[site].store(skip);
    count_[site].store(count);
  }
  // Whether this call at `site` is to fail.
  bool fail(Site site) {
    if (count_[site].load(std::memory_order_relaxed) == 0) return false;
    uint32_t s = skip_[site].load();
    while (s > 0)
      if (skip_[site].compare_exchange_weak(s, s - 1)) return false;
    uint32_t c = count_[site].load();
    while (c > 0)
      if (count_[site].compare_exchange_weak(c, c - 1)) return true;
    return false;
  }

 private:
  std::atomic<uint32_t> skip_[kSites]{}, count_[kSites]{};
};

}  // namespace wkv
