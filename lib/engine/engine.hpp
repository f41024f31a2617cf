// The engine: one process-wide instance bound to one device. Owns the
// configuration, the host arena, the thread pool and the backend; sequences
// and plans hold it alive through shared ownership, so closing the engine's
// handle while they live is safe.
//
// Lock order (outer first): none is held across a call into another object;
// HostArena::mu_ is the only engine-wide lock and is a leaf.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "lib/backend/backend.hpp"
#include "lib/common/config.hpp"
#include "lib/common/status.hpp"
#include "lib/common/thread_pool.hpp"
#include "lib/store/host_arena.hpp"

namespace wkv {

class Plan;
class Sequence;

// Counters of an engine, updated without locks.
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
  std::atomic<uint64_t> cache_hits{0};
  std::atomic<uint64_t> cache_misses{0};
  std::atomic<uint64_t> kmeans_ns{0};
  std::atomic<uint64_t> next_seq_id{1};
  std::atomic<uint32_t> epoch{0};
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // Validates the config and opens an engine on the device it names.
  static Status open(const wkv_config *cfg, std::shared_ptr<Engine> *out);
  ~Engine();

  const Config &config() const { return cfg_; }
  HostArena &arena() { return *arena_; }
  ThreadPool &pool() { return *pool_; }
  Backend &backend() { return *backend_; }
  EngineCounters &counters() { return counters_; }

  void fill_stats(wkv_stats *out);
  std::string stats_json();

  // The decoding verbs, in the order of a step.
  Status lookup(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t layer,
                const void *q, int64_t seq_stride, int64_t head_stride, void *stream);
  Status assemble(Plan &plan, void *stream);
  Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                void *stream);
  Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
               int64_t lse_seq_stride, void *stream);
  Status update(Plan &plan, void *stream);

 private:
  Engine() = default;

  Config cfg_;
  std::unique_ptr<HostArena> arena_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Backend> backend_;
  EngineCounters counters_;
};

// The CPU backend.
std::unique_ptr<Backend> make_cpu_backend(Engine &engine);

// Zone sizes for a head of `clusters` clusters: retrieval is ceil(r * C),
// estimation round(e * C), never more than C together.
void zone_sizes(const Config &cfg, uint32_t clusters, uint32_t *n_ret, uint32_t *n_est);

}  // namespace wkv
