// Counters of an engine, updated without locks and read by its statistics.
#pragma once

#include <atomic>
#include <cstdint>

namespace wkv {

struct EngineCounters {
  std::atomic<uint64_t> sequences{0};
  std::atomic<uint64_t> tokens{0};
  std::atomic<uint64_t> segments{0};
  std::atomic<uint64_t> clusters{0};
  std::atomic<uint64_t> steady_rows{0};
  std::atomic<uint64_t> lookups{0};
  std::atomic<uint64_t> retrieved_clusters{0};
  std::atomic<uint64_t> estimated_clusters{0};
  std::atomic<uint64_t> attended_tokens{0};
  std::atomic<uint64_t> evicted_sequences{0};
  std::atomic<uint64_t> cache_hits{0};
  std::atomic<uint64_t> cache_misses{0};
  std::atomic<uint64_t> kmeans_ns{0};
  std::atomic<uint64_t> pin_fallbacks{0};  // host chunks left pageable: pinning failed
  std::atomic<uint64_t> next_seq_id{1};
};

}  // namespace wkv
