// A sequence: one request's context across all layers and KV heads.
//
// Per layer, tokens [0, sink) sit in the sink, tokens [tail_begin, tokens)
// in the unclustered tail, and everything between in clustered segments
// (HeadIndex). Sink and tail together are the steady zone.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lib/common/status.hpp"
#include "lib/index/meta_index.hpp"

namespace wkv {

class Engine;

struct HeadState {
  RowQueue sink;  // host rows (CPU backend)
  RowQueue tail;  // host rows (CPU backend)
  HeadIndex index;
  std::shared_ptr<void> dev;  // the backend's device state of this head, if any
};

struct LayerState {
  uint64_t tokens = 0;      // appended to this layer
  uint64_t tail_begin = 0;  // first unclustered token (>= sink tokens held)
  bool generating = false;  // set by the first lookup
  uint64_t version = 0;     // bumped by every change, checked by plans
  std::vector<HeadState> heads;

  // Rows per head in the sink and in the unclustered tail, whichever
  // backend holds them (the host RowQueues are empty on the CUDA backend).
  uint64_t sink_rows(uint32_t sink_tokens) const { return tokens < sink_tokens ? tokens : sink_tokens; }
  uint64_t tail_rows() const { return tokens - tail_begin; }
};

class Sequence {
 public:
  Sequence(std::shared_ptr<Engine> engine, uint64_t id);
  ~Sequence();  // returns its pages to the arena
  Sequence(const Sequence &) = delete;
  Sequence &operator=(const Sequence &) = delete;

  uint64_t id() const { return id_; }
  Engine &engine() const { return *engine_; }
  const std::shared_ptr<Engine> &engine_ptr() const { return engine_; }
  LayerState &layer(uint32_t l) { return layers_[l]; }
  const LayerState &layer(uint32_t l) const { return layers_[l]; }
  uint32_t n_layers() const { return static_cast<uint32_t>(layers_.size()); }

  // Appends n tokens to a layer; k and v point at token 0, head 0, with
  // strides in elements, on the engine's device. All or nothing. Goes
  // through the backend.
  Status append(uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                int64_t token_stride, int64_t head_stride, void *stream);

  // Ends the prompt phase of a layer: clusters what remains of the prompt
  // beyond the window and switches the layer to generated-token segments.
  // No-op once generating. All or nothing. Goes through the backend.
  Status finish_prompt(uint32_t layer, void *stream);

  // The host implementations (CPU backend): rows in host RowQueues, k-means
  // on the CPU, pages written by the CPU.
  Status append_host(uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                     int64_t token_stride, int64_t head_stride);
  Status finish_prompt_host(uint32_t layer);

 private:
  // Clusters `count` segments of `seg_tokens` tokens (the last may be
  // `last_tokens`) from the front of the layer's tail.
  Status cluster_front(uint32_t layer, uint32_t count, uint32_t seg_tokens, uint32_t last_tokens,
                       bool generated);

  std::shared_ptr<Engine> engine_;
  uint64_t id_;
  std::vector<LayerState> layers_;
};

}  // namespace wkv
