// A sequence: one request's context across all layers and KV heads. It owns
// its layers' state (lib/index/head.hpp) and a step tracker for the device
// work of its appends and growths, so that its memory is freed only once
// that work, and every step in flight that reads it, has ended.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "lib/buffer/buffer_manager.hpp"
#include "lib/engine/cold.hpp"
#include "lib/common/status.hpp"
#include "lib/index/head.hpp"
#include "lib/store/spill.hpp"

namespace wkv {

class Engine;
class Binding;

class Sequence {
 public:
  static Status create(std::shared_ptr<Engine> engine, std::shared_ptr<Sequence> *out);
  ~Sequence();  // gives its memory back once nothing in flight reads it
  Sequence(const Sequence &) = delete;
  Sequence &operator=(const Sequence &) = delete;

  uint64_t id() const { return id_; }
  Engine &engine() const { return *engine_; }
  const std::shared_ptr<Engine> &engine_ptr() const { return engine_; }
  LayerState &layer(uint32_t l) { return layers_[l]; }
  const LayerState &layer(uint32_t l) const { return layers_[l]; }
  uint32_t n_layers() const { return static_cast<uint32_t>(layers_.size()); }
  StepTracker &tracker() { return *tracker_; }

  // Eviction (Engine::evict): while evicted, the pages of head h of layer l
  // are in the spill file's extent spilled(l, h), its map.pages empty.
  bool evicted() const { return evicted_; }
  SpillExtent &spilled(uint32_t l, uint32_t h) { return spilled_[size_t(l) * heads_ + h]; }
  void set_evicted(bool e) { evicted_ = e; }

  // Cold pages (lib/engine/cold.hpp): the lookup stamp, and what the
  // sequence shares with the pager's thread (null without a cold tier).
  uint64_t stamp() const { return stamp_; }
  uint64_t next_stamp() { return ++stamp_; }
  const std::shared_ptr<ColdShared> &cold() const { return cold_; }
  // Cold pages on a CUDA engine: the lookups of layer l that plans hold
  // and have not assembled (a plan may yet gather what their selections
  // chose: lib/engine/cold.hpp, slots). Plans count themselves in and out,
  // from any thread (a plan's destruction is not a verb of the sequence).
  std::atomic<uint32_t> &open_lookups(uint32_t l) { return open_[l]; }
  bool layer_open(uint32_t l) const { return open_[l].load(std::memory_order_acquire) > 0; }

  // The binding whose captured steps alone may append to or read the
  // sequence (wkv_plan_bind), or null.
  Binding *binding() const { return binding_; }
  void set_binding(Binding *b) { binding_ = b; }

 private:
  Sequence(std::shared_ptr<Engine> engine, uint64_t id) : engine_(std::move(engine)), id_(id) {}

  std::shared_ptr<Engine> engine_;
  uint64_t id_;
  std::vector<LayerState> layers_;
  std::shared_ptr<StepTracker> tracker_;
  bool evicted_ = false;
  uint32_t heads_ = 0;
  std::vector<SpillExtent> spilled_;  // [layers][heads]
  uint64_t stamp_ = 0;
  std::shared_ptr<ColdShared> cold_;
  std::unique_ptr<std::atomic<uint32_t>[]> open_;  // [layers]
  Binding *binding_ = nullptr;
};

}  // namespace wkv
