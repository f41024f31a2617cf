// Steps a runtime captures (wkv_plan_bind, docs/runtime-capture.md): a plan
// bound to a batch of sequences, whose appends and decodes a runtime
// captures into a CUDA graph of its own and replays token after token.
//
// A captured call (one layer's append, or one layer's decode) enqueues
// kernels that read what changes from one step to the next from a slot of
// the call's ring (pinned, mapped host memory); wkv_plan_prepare writes the
// next slot of every call before each replay, doing on the host what the
// uncaptured verbs do there (growth commits, room for the rows, the run
// tables, epochs and access records) and enqueueing on the caller's stream
// what rare work they need (a growth's commit or begin). The kernels check
// on the device that each replay was prepared and that every call of the
// program ran in each step (kernels::BoundCall); a replay that fails a check
// does no work, writes NaN to its outputs and breaks the binding, which the
// next prepare reports.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lib/index/growth.hpp"

namespace wkv {

class Sequence;

// Slots of a captured call's ring: how many prepared steps the host may run
// ahead of the device (prepare waits beyond).
constexpr uint32_t kBoundSlots = 16;

// A call's ring: slot i at host + i * slot_bytes (the device reads it at
// dev + i * slot_bytes).
struct BoundRing {
  uint8_t *host = nullptr;
  const uint8_t *dev = nullptr;
  size_t slot_bytes = 0;
};

// What a layer's captured decode is sized for: the largest index the
// layer's runs can reach within the binding's max_steps (Engine::bind).
struct BoundReserve {
  uint32_t max_clusters = 0, max_ret = 0, max_run = 0;
  uint64_t xbuf = 0;           // tokens of the execution buffer
  uint64_t clusters = 0;       // of all runs: logits G * clusters, zones clusters
  uint64_t ret = 0, est = 0;   // of all runs
};

struct BoundCallState {
  enum class Kind : uint8_t { kAppend, kDecode };
  Kind kind = Kind::kAppend;
  uint32_t layer = 0;
  BoundRing ring;
  // The slot's last step: free to write again once `epoch` of the call's
  // tracker (a decode's: the plan's; an append's: sequence 0's) has ended.
  std::array<uint64_t, kBoundSlots> slot_epoch{};
  // An append: the caller's device tensors, pitches in bytes (sequence,
  // token, head), and the copy's word (kernels::copy_width).
  const uint8_t *k = nullptr, *v = nullptr;
  uint64_t seq_pitch = 0, token_pitch = 0, head_pitch = 0;
  // A decode: the query and the output, strides in elements.
  const void *q = nullptr;
  int64_t q_seq_stride = 0, q_head_stride = 0;
  void *out = nullptr;
  int64_t out_seq_stride = 0, out_head_stride = 0;
  // Prepare's first pass, for its second: an append's staged rows (per
  // sequence) and the layers' pages before; a decode's runs' cache heads,
  // the units it may retrieve and what it retrieves and estimates.
  std::vector<StagedAppend> staged;
  std::vector<uint64_t> tail_begin;  // before the rows counted
  std::vector<size_t> pages_before;
  std::vector<uint64_t> run_heads;
  uint32_t want_units = 0;
  size_t retrieved = 0, estimated = 0;
};

class Plan;

class Binding {
 public:
  Plan *plan = nullptr;
  std::vector<std::shared_ptr<Sequence>> seqs;
  uint32_t max_steps = 0;
  uint64_t steps = 0;      // prepared
  bool sealed = false;     // prepared once: the program is complete
  uint32_t max_calls = 0;  // an append and a decode per layer
  std::vector<BoundCallState> calls;
  std::vector<BoundReserve> reserve;  // per layer
  void *stream = nullptr;  // the last prepare's (the replays')
};

}  // namespace wkv
