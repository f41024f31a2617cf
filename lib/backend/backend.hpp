// The interface both backends implement: the device side of the decoding
// verbs. The engine validates arguments and keeps sequences; a backend runs
// the steps over a plan whose sequences, layer and query are already set.
//
// Pre for every call: the plan's stage allows it (checked by the engine).
// The caller's stream is plan.stream.
#pragma once

#include <cstdint>

#include "lib/common/status.hpp"
#include "wavekv/wavekv.h"

namespace wkv {

class Plan;
class Sequence;

class Backend {
 public:
  virtual ~Backend() = default;
  // WKV_DEVICE_CPU or WKV_DEVICE_CUDA.
  virtual uint32_t device() const = 0;
  // Appends rows of a layer (k and v on the engine's device); see
  // Sequence::append. All or nothing.
  virtual Status append(Sequence &seq, uint32_t layer, const uint8_t *k, const uint8_t *v,
                        uint32_t n, int64_t token_stride, int64_t head_stride, void *stream) = 0;
  // Ends the prompt phase of a layer; see Sequence::finish_prompt.
  virtual Status finish_prompt(Sequence &seq, uint32_t layer, void *stream) = 0;
  // A sequence is being destroyed: forget anything cached of it.
  virtual void on_destroy(Sequence &seq) { (void)seq; }
  // Describes the plan's assembled execution buffer (pointers on the device).
  virtual void xbuf(const Plan &plan, wkv_xbuf_view *view) = 0;
  // Adds the backend's own figures (cache) to *out.
  virtual void fill_stats(wkv_stats *out) { (void)out; }
  // Scores clusters, selects the zones and estimates the estimation zone.
  virtual Status lookup(Plan &plan) = 0;
  // Lays out steady and retrieval tokens in the execution buffer.
  virtual Status assemble(Plan &plan) = 0;
  // Exact attention over the execution buffer merged with the estimate.
  virtual Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride,
                        float *lse) = 0;
  // Folds the estimate into a caller's output and lse.
  virtual Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                       int64_t lse_seq_stride) = 0;
  // Hands the access record to the buffer manager.
  virtual Status update(Plan &plan) = 0;
};

}  // namespace wkv
