// The engine: one process-wide instance bound to one device. Owns the
// configuration, the host arena, the thread pool, the backend and the buffer
// manager; sequences and plans hold it alive through shared ownership, so
// closing the engine's handle while they live is safe.
//
// Lock order (outer first): growth_mu_ (one index growth at a time), then
// the arena's and the buffer manager's locks, which are leaves.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "lib/backend/backend.hpp"
#include "lib/buffer/buffer_manager.hpp"
#include "lib/common/config.hpp"
#include "lib/common/counters.hpp"
#include "lib/common/faults.hpp"
#include "lib/common/status.hpp"
#include "lib/common/thread_pool.hpp"
#include "lib/engine/cold.hpp"
#include "lib/engine/stats_publisher.hpp"
#include "lib/index/growth.hpp"
#include "lib/store/host_arena.hpp"
#include "lib/store/io.hpp"
#include "lib/store/seq_file.hpp"
#include "lib/store/spill.hpp"

namespace wkv {

class Plan;
class Sequence;

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // Validates the config and opens an engine on the device it names.
  static Status open(const wkv_config *cfg, std::shared_ptr<Engine> *out);
  ~Engine();

  const Config &config() const { return cfg_; }
  HostArena &arena() { return *arena_; }
  ThreadPool &pool() { return *pool_; }
  Backend &backend() { return *backend_; }
  BufferManager &buffers() { return *buffers_; }
  EngineCounters &counters() { return counters_; }
  // Failures injected by tests (lib/common/faults.hpp).
  FaultInjector &faults() { return faults_; }
  // The index's view of the engine (lib/index/growth.hpp).
  IndexContext index() {
    IndexContext ix{cfg_, *backend_, *arena_, *pool_, counters_, *buffers_, growth_mu_, &faults_};
    ix.growth_lag = growth_lag_;
    return ix;
  }
  // Tests: the tokens between a generated segment's completion and its
  // growth's commit, in place of kGrowthLagTokens (lib/index/growth.hpp).
  void set_growth_lag(uint32_t lag) { growth_lag_ = lag; }

  void fill_stats(wkv_stats *out);
  // wkv_engine_stats_json's object: config, stats, and the time taken.
  std::string stats_json();
  // The I/O layer of the engine's files (POSIX).
  FileIO &io() { return posix_io(); }

  // Sequence files (lib/store/seq_file.hpp), through `io`: the engine's
  // unless a test injects faults. Save waits for the sequence's own device
  // work to end, then exports and writes one layer at a time, copying on
  // the backend's I/O stream; it holds no engine-wide lock, so other
  // sequences keep decoding. Pre: no other thread uses `seq` meanwhile.
  // The fd form writes from offset 0 and truncates; the path form replaces
  // the file whole or not at all (replace_file).
  Status save(Sequence &seq, FileIO &io, int fd, uint32_t flags, const ProgressFn &progress = nullptr);
  Status save(Sequence &seq, FileIO &io, const std::string &path, uint32_t flags,
              const ProgressFn &progress = nullptr);
  // Load builds a new sequence from a file, all or nothing: it exists only
  // once every layer has been read, checked and imported.
  Status load(FileIO &io, int fd, std::shared_ptr<Sequence> *out, const ProgressFn &progress = nullptr);
  Status load(FileIO &io, const std::string &path, std::shared_ptr<Sequence> *out,
              const ProgressFn &progress = nullptr);

  // The spill file (null without a spill_dir). Evict writes a sequence's
  // pages there and gives them back (all or nothing); restore reads them
  // back into new pages, checking every checksum (all or nothing: the
  // sequence stays evicted after a failure). Pre: no other thread uses
  // `seq` meanwhile.
  SpillFile *spill() { return spill_.get(); }
  // The spill tier under live sequences (lib/engine/cold.hpp): CPU engines
  // with a spill file and a host budget; null otherwise.
  ColdTier *cold() { return cold_.get(); }
  Status evict(Sequence &seq);
  Status restore(Sequence &seq);

  // Appends and ends prompts (lib/index/growth.hpp), with the stream and
  // pointers checked first and the sequence's tracker around the work.
  Status append(Sequence &seq, uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                int64_t token_stride, int64_t head_stride, void *stream);
  // n tokens to one layer of each of n_seqs distinct sequences of this
  // engine: sequence i's rows at k + i * seq_stride (elements), one copy for
  // the whole batch. On an error in sequence i's growth, sequences before i
  // keep their tokens, i and after get none (the message names i); any
  // earlier error appends nothing.
  Status append_batch(Sequence *const *seqs, uint32_t n_seqs, uint32_t layer, const uint8_t *k, const uint8_t *v,
                      uint32_t n, int64_t seq_stride, int64_t token_stride, int64_t head_stride, void *stream,
                      const char *verb);
  Status end_prompt(Sequence &seq, uint32_t layer, void *stream);

  // The decoding verbs, in the order of a step. Any failure leaves the plan
  // holding no step. A lookup given `decode` (wkv_decode) may run the whole
  // step where the backend can (Backend::decodes): the plan is then
  // assembled, its output written; else it is looked up, as without.
  Status lookup(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t layer,
                const void *q, int64_t seq_stride, int64_t head_stride, void *stream,
                const DecodeOut *decode = nullptr);
  Status assemble(Plan &plan, void *stream);
  Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                void *stream);
  Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
               int64_t lse_seq_stride, void *stream);
  Status update(Plan &plan, void *stream);

  // Steps a runtime captures (lib/engine/binding.hpp, wkv_plan_bind). Bind
  // restores evicted sequences and ends their layers' prompts (which waits
  // for `stream`), then reserves for max_steps more tokens; from then on
  // the sequences take appends and lookups only through the binding's
  // captured calls, and the plan runs no other step. Prepare writes the
  // next step's slots (before each replay of the runtime's graph, on the
  // stream the graph is launched on). Unbind waits for `stream` (the
  // replays'), takes back the tokens of steps prepared and never run, and
  // frees the sequences and the plan for other use.
  Status bind(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t max_steps, void *stream);
  Status prepare(Plan &plan, void *stream);
  // whole_device: waits for the whole device instead (a bound plan's
  // destruction, which knows no stream that is surely alive).
  Status unbind(Plan &plan, void *stream, bool whole_device = false);

 private:
  Engine() = default;
  // Lookup's sizing of the plan's runs (plan.seqs, layer, runs).
  Status plan_runs(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t layer);
  // The captured calls: an append (append_batch on a stream being
  // captured) and a decode (lookup with decode, likewise).
  Status capture_append(Sequence *const *seqs, uint32_t n, uint32_t layer, const uint8_t *k, const uint8_t *v,
                        uint32_t n_tokens, int64_t seq_stride, int64_t token_stride, int64_t head_stride,
                        void *stream, const char *verb);
  Status capture_decode(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t layer, const void *q,
                        int64_t seq_stride, int64_t head_stride, const DecodeOut &out, void *stream);
  // Prepare's steps: the growths due, each call's host part, and what a
  // step that failed half way gives back.
  Status prepare_calls(Plan &plan, Binding &b, void *stream, uint32_t *done);
  void unprepare_calls(Binding &b, uint32_t done);
  // WKV_ERR_STATE where `seq` is bound to a plan (its steps are captured).
  static Status check_unbound(const Sequence &seq, const char *verb);
  Status end_prompt_locked(Sequence &seq, uint32_t layer, void *stream);
  // index(), with a growth of `seq` that finds the host budget full first
  // writing the sequence's cold pages out (when the engine has a cold tier).
  IndexContext index_for(Sequence &seq);

  Config cfg_;
  // Destroyed in reverse order: the buffer manager first (it waits for the
  // steps in flight and runs the releases left, which need the backend and
  // the arena), the arena last.
  std::unique_ptr<HostArena> arena_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<BufferManager> buffers_;
  EngineCounters counters_;
  FaultInjector faults_;
  std::mutex growth_mu_;
  uint32_t growth_lag_ = kGrowthLagTokens;
  std::string stats_path_;  // the config's stats_path points here
  std::string spill_dir_;   // the config's spill_dir points here
  std::unique_ptr<SpillFile> spill_;
  std::unique_ptr<ColdTier> cold_;  // before the spill file and the arena it uses
  // Last: stopped first, since it reads everything above.
  std::unique_ptr<StatsPublisher> stats_publisher_;
};

// The CPU backend.
std::unique_ptr<Backend> make_cpu_backend(Engine &engine);


}  // namespace wkv
