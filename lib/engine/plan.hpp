// A plan: the reusable state of one decoding step for a batch of sequences at
// one layer. Lookup fills the zones and the estimate, assemble fills the
// execution buffer, attend and merge read both, update closes the step.
// Buffers only grow, so steady-state decoding allocates nothing.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/device_layout.hpp"
#include "lib/engine/binding.hpp"
#include "lib/buffer/buffer_manager.hpp"
#include "lib/common/status.hpp"
#include "lib/index/head.hpp"

namespace wkv {

class Engine;
class Sequence;

// One (sequence, KV head) of the step.
//
//   ret_ids[ret_off .. ret_off + n_ret)    retrieval-zone cluster ids
//   est_ids[est_off .. est_off + n_est)    estimation-zone cluster ids
//   logits[logits_off .. + G * clusters)   [G][clusters] scaled logits
struct RunPlan {
  uint32_t seq = 0, head = 0;
  uint32_t clusters = 0, n_ret = 0, n_est = 0;
  uint32_t n_one = 0;  // of n_ret: clusters of one member
  size_t ret_off = 0, est_off = 0, logits_off = 0;
  uint64_t steady_tokens = 0, ret_tokens = 0;
};

// A plan's device buffers (CUDA backend), in engine memory. Plain data: the
// CUDA backend owns what they mean (lib/backend/cuda/cuda_backend.cpp).
struct PlanDevice {
  Region runs, q, ret_ids, ret_pos, est_ids, run_tokens, est_out, est_lse, offsets, logits, zones;
  Region est_extra;  // cold pages: per run, the retrieval clusters estimated (kernels::DevLookup)
  Region xk, xv, scratch;
  Region counters;  // the kernels' per-plan counters (kernels::StepCounters)
  std::vector<kernels::DevRun> host_runs;
  std::vector<uint64_t> run_heads;  // per run: the head's cache id << 32 | generation
  uint64_t xbuf_tokens = 0;         // capacity of xk / xv in tokens
  uint32_t max_run_tokens = 0;      // bound on any run's tokens
  uint32_t total_ret = 0;
  uint32_t want_units = 0;          // bound on the units the step retrieves
  // A whole step at once (Backend::decode): the step's variables
  // (kernels::StepVars), and the step's kernels as CUDA graphs
  // (cudaGraphExec_t), each for the shape and buffers of its key, the most
  // recently used first; seen_key is the last decode's, so that a graph is
  // made only for a shape seen twice in a row, and refused_key the last
  // whose graph could not be made or launched: tried again once another key
  // has come, or after `retry_in` more of its steps (a backoff that doubles
  // from 64 to 4096 steps at each refusal in a row; a driver's refusal may
  // pass, and a plan whose shape stays must not lose its graph for good).
  Region vars;
  // The bounds a graph's kernels take (grids, splits, the scores' place):
  // raised past what a step needs, never lowered, so that a graph serves
  // while the index grows and its tails fill and empty.
  uint32_t bound_clusters = 0, bound_ret = 0, bound_run = 0;
  size_t bound_logits = 0;
  using GraphKey = std::array<uint64_t, 27>;
  struct Graph {
    GraphKey key{};
    void *exec = nullptr;
  };
  static constexpr size_t kMaxGraphs = 4;  // a batch that alternates between a few shapes
  std::array<Graph, kMaxGraphs> graphs{};
  GraphKey seen_key{}, refused_key{};
  uint32_t retry_in = 0, backoff = 0;
  // The ring a replay stages from (kernels::StageSlot): kStageSlots slots
  // of pinned, mapped host memory, the backend's (recycled, never freed
  // under a reader); the host writes slot stage_next % kStageSlots and
  // launches the graph, whose first kernel reads the slot that the device's
  // count names, the same. A slot is written again once the step that last
  // wrote it (stage_epochs) has ended.
  static constexpr uint32_t kStageSlots = 64;
  uint8_t *stage_host = nullptr, *stage_dev = nullptr;
  size_t stage_bytes = 0, stage_slot_bytes = 0;
  uint32_t stage_next = 0;
  std::array<uint64_t, kStageSlots> stage_epochs{};
  uint32_t stage_retry_in = 0;  // decodes before a ring that could not be had is asked for again
  // Steps a runtime captures (lib/engine/binding.hpp): the binding's words
  // (kernels::BindWords, pinned and mapped) and the calls' counts of slots
  // consumed and their entry kernels' CTA counter (device), kept for the
  // plan's life so that a graph of an earlier binding still reads live
  // memory; the rings of the current binding (one pinned block). Once a
  // plan has been bound, a buffer it outgrows is kept until the plan goes
  // (retired) rather than freed: a captured graph keeps its addresses.
  kernels::BindWords *bind_words = nullptr, *bind_words_dev = nullptr;
  Region bind_counts;
  uint32_t bind_generation = 0;
  uint8_t *bound_rings = nullptr, *bound_rings_dev = nullptr;
  size_t bound_rings_bytes = 0, bound_slot_bytes = 0;
  bool ever_bound = false;
  std::vector<Region> retired;
  void *bind_side = nullptr;  // the captured decodes' estimate stream (cudaStream_t)
  void *bind_fork = nullptr, *bind_join = nullptr;  // cudaEvent_t
};

// wkv_decode's output, for a backend that runs a whole step at once.
struct DecodeOut {
  void *out = nullptr;
  int64_t seq_stride = 0, head_stride = 0;
};

class Plan {
 public:
  enum class Stage { kEmpty, kLookedUp, kAssembled };

  Plan(std::shared_ptr<Engine> engine, std::shared_ptr<StepTracker> tracker)
      : engine_(std::move(engine)), tracker_(std::move(tracker)) {}
  ~Plan();  // its backend buffers go once its steps have ended
  Plan(const Plan &) = delete;
  Plan &operator=(const Plan &) = delete;

  Engine &engine() const { return *engine_; }
  const std::shared_ptr<Engine> &engine_ptr() const { return engine_; }
  StepTracker &tracker() { return *tracker_; }
  const std::shared_ptr<StepTracker> &tracker_ptr() const { return tracker_; }

  Stage stage = Stage::kEmpty;
  // At kAssembled: whether the execution buffer holds the step's rows (an
  // assemble), or only where they live (a decode that attended from frames:
  // Backend::decode_lays_out_rows false).
  bool rows_laid_out = true;
  uint32_t layer = 0;
  uint32_t n_seqs = 0;
  void *stream = nullptr;                       // the caller's stream of the current verb
  std::vector<std::shared_ptr<Sequence>> seqs;  // held until the next lookup
  std::vector<uint64_t> seq_versions;           // layer versions at lookup
  // Cold pages on a CUDA engine: whether the plan's lookup is counted open
  // in each of its sequences (Sequence::open_lookups) until it assembles.
  bool lookups_open = false;

  const void *q_src = nullptr;  // the caller's q of the lookup (valid during it)
  int64_t q_seq_stride = 0, q_head_stride = 0;
  std::vector<RunPlan> runs;    // [n_seqs * n_kv_heads]

  // The CPU backend's step.
  std::vector<float> q;             // [n_seqs][n_q_heads][d]
  std::vector<uint32_t> ret_ids, est_ids;
  std::vector<float> logits;        // concatenated [G][clusters] per run
  std::vector<float> scores;        // concatenated [clusters] per run
  std::vector<uint32_t> scratch;    // concatenated [clusters] per run
  std::vector<float> est_out;       // [n_seqs][n_q_heads][d]
  std::vector<float> est_lse;       // [n_seqs][n_q_heads]
  std::vector<int32_t> offsets;     // the execution buffer (see wkv_xbuf_view): [runs + 1]
  std::vector<uint8_t> xk, xv;      // [tokens][d] in the storage dtype
  std::vector<float> exact_out, exact_lse;

  // The CUDA backend's step.
  PlanDevice dev;

  // Bound to a batch whose steps a runtime captures (wkv_plan_bind).
  std::unique_ptr<Binding> binding;

  // Checks that no sequence changed since the lookup.
  Status check_versions() const;
  // Counts the plan's open lookups out: it assembled, or abandoned them.
  void close_lookups();

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<StepTracker> tracker_;
};

// Grows v to n elements without giving capacity back, geometrically, so that
// repeated steps of similar size reallocate only a few times in all.
template <typename V> void grow_to(V &v, size_t n) {
  if (n > v.capacity()) v.reserve(n + n / 2);
  v.resize(n);
}

}  // namespace wkv
