#include "lib/engine/sequence.hpp"

#include <new>

#include "lib/engine/engine.hpp"

namespace wkv {

Status Sequence::create(std::shared_ptr<Engine> engine, std::shared_ptr<Sequence> *out) {
  Engine &e = *engine;
  std::shared_ptr<Sequence> s;
  try {
    const uint64_t id = e.counters().next_seq_id.fetch_add(1);
    s.reset(new Sequence(std::move(engine), id));
    e.counters().sequences.fetch_add(1);  // the destructor takes it back
    WKV_RETURN_IF_ERROR(e.buffers().new_tracker(&s->tracker_));
    s->layers_.resize(e.config().c.n_layers);
    s->open_.reset(new std::atomic<uint32_t>[s->layers_.size()]());
    s->heads_ = e.config().c.n_kv_heads;
    s->spilled_.resize(size_t(s->layers_.size()) * s->heads_);
    if (e.cold()) s->cold_ = std::make_shared<ColdShared>();
    const IndexContext ix = e.index();
    for (LayerState &L : s->layers_) init_layer(ix, &L);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory creating a sequence");
  }
  *out = std::move(s);
  return Status::ok();
}

Sequence::~Sequence() {
  if (cold_) {
    engine_->cold()->settle(*this);
    engine_->cold()->release(*this);
  }
  if (evicted_) {
    // Its pages are in the spill file (map.pages are empty): give the
    // extents back.
    for (SpillExtent &x : spilled_) engine_->spill()->release(x);
    engine_->counters().evicted_sequences.fetch_sub(1);
  }
  const IndexContext ix = engine_->index();
  for (LayerState &L : layers_) release_layer(ix, L);
  engine_->counters().sequences.fetch_sub(1);
}

}  // namespace wkv
