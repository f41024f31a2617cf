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
  std::atomic<uint64_t> growths_deferred{0};  // generated segments' growths committed at a later append
  std::atomic<uint64_t> growth_waits{0};      // of them: commits that waited for their k-means
  std::atomic<uint64_t> decode_graphs{0};     // decoding steps run as a replay of their plan's CUDA graph
  std::atomic<uint64_t> pin_fallbacks{0};  // host chunks left pageable: pinning failed
  // The spill tier under live sequences (lib/engine/cold.hpp).
  std::atomic<uint64_t> cold_pages{0};          // pages of live sequences on disk
  std::atomic<uint64_t> cold_pages_written{0};  // pages written out, since open
  std::atomic<uint64_t> cold_pages_read{0};     // pages read back, since open
  std::atomic<uint64_t> cold_estimated{0};      // retrievals estimated: on disk
  std::atomic<uint64_t> spill_read_errors{0};
  std::atomic<uint64_t> spill_write_errors{0};
  std::atomic<uint64_t> next_seq_id{1};
};

}  // namespace wkv
