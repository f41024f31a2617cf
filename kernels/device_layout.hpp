// Device-side layouts shared by the CUDA kernels and the CUDA backend's host
// code. Plain structs of raw pointers and sizes: no CUDA types, so host C++
// compiled without nvcc can fill them.
//
// A decoding step works on R runs, one per (sequence, KV head), r = s * H + h.
// Everything below lives in device memory unless it says otherwise.
#pragma once

#include <cstdint>

namespace wkv::kernels {

// One (sequence, KV head) as the decoding kernels see it.
//
// Meta index (device, f32):
//   centroid[c * d + i], value_sum[c * d + i], size[c]   for c < clusters
//   spread[c]          mean squared distance of the cluster's keys to its
//                      centroid; null: logits are the centroid's alone
//                      (WKV_METHOD_SPREAD off)
//   value_mean[i]      the head's mean value; null: the clusters of neither
//                      zone are dropped (WKV_METHOD_TAIL off)
//   centroid8          the centroids' 8-bit copy that the logits read (engines
//                      with a 16-bit storage dtype): kMeta16Header bytes, of
//                      which the first word is nonzero once a row was not
//                      finite (then the logits read the f32 centroids), then
//                      [clusters][d] int8, row c scaled by centroid8_scale[c]
//                      (kernels/dtype.hpp's quantize_row). Null: none.
//   centroid16         the centroids' f16 copy, laid out likewise, its word
//                      set once a centroid fell outside f16's range; read
//                      where a run has no centroid8 (a backend told to keep
//                      16-bit logit rows). Null: none.
//   value_sum8         the value sums' 8-bit copy that the estimate reads,
//                      laid out as centroid8, its scales at value_sum8_scale
//                      (its word set: the estimate reads value_sum16, or the
//                      f32 value sums). Null: none.
//   value_sum16        the value sums' f16 copy, laid out as centroid16,
//                      read where a run has no usable value_sum8 (its word
//                      set: the estimate reads the f32 value sums). Null:
//                      none.
// Mapping-table mirror:
//   first_slot[c]      token slot of the cluster's first member in the head's
//                      page list: page first_slot / page_tokens, row
//                      first_slot % page_tokens; members are consecutive slots
//   pages[p]           device-accessible address of page p of the head (a
//                      pinned, mapped host page). A page holds K rows
//                      [page_tokens][d] then V rows [page_tokens][d] in the
//                      storage dtype: V starts at page_tokens * row_bytes;
//                      with 8-bit pages, rows of d bytes and their scales
//                      after them (GatherArgs::int8_dim, kernels/gather_cuda.hpp).
//   unit_begin[c]      the cluster's first unit: unit j of cluster c (members
//                      [j * page_tokens, (j + 1) * page_tokens)) is unit
//                      unit_begin[c] + j of the head, laid out like a page
//   unit_dir[u / kUnitChunk][u % kUnitChunk]
//                      the device cache frame holding unit u, or kNoFrame
//                      (0xffffffff). Written while steps run: by a gather
//                      that admits a unit (compare-and-swap from kNoFrame),
//                      by the buffer manager that evicts one (to kNoFrame).
//                      unit_dir may be null: no unit is cached.
// Steady zone (device rows, [tokens][d] in the storage dtype, contiguous):
//   sink_k/sink_v      sink_tokens rows
//   tail_k/tail_v      tail_tokens rows
// Cold pages (engines with a host budget and a spill file; docs/spill.md):
//   cold_pt            page_tokens where pages may be out (pages[p] null:
//                      page p is in the spill file), 0 where none can be.
//                      A retrieval-zone cluster with a page out is estimated
//                      instead (its ret_ids entry carries kColdCluster, its
//                      members are not gathered) and reported in `wants`.
//   stamps[c]          (device, may be null) set to `stamp` for every
//                      retrieval-zone cluster: the cold tier's recency
//   wants              (mapped host memory, may be null) the retrieval-zone
//                      clusters the step found out: wants[1] their count (all
//                      of them), wants[2 + i], i < min(count, want_cap),
//                      their ids, then wants[0] = stamp once the rest is
//                      visible to the host
struct DevRun {
  const float *centroid;
  const float *value_sum;
  const float *spread;
  const float *value_mean;
  const uint8_t *centroid16;
  const uint8_t *centroid8;
  const float *centroid8_scale;
  const uint8_t *value_sum8;
  const float *value_sum8_scale;
  const uint8_t *value_sum16;
  const uint32_t *size;
  const uint32_t *first_slot;
  const uint32_t *unit_begin;
  const uint8_t *const *pages;
  uint32_t *const *unit_dir;
  const uint8_t *sink_k, *sink_v;
  const uint8_t *tail_k, *tail_v;
  uint32_t *stamps;
  uint32_t *wants;
  uint32_t clusters;
  uint32_t n_ret;        // retrieval-zone clusters to select
  uint32_t n_one;        // of them, clusters of one member (0: not ranked apart)
  uint32_t n_est;        // estimation-zone clusters to select
  uint32_t sink_tokens;
  uint32_t tail_tokens;
  uint32_t ret_off;      // this run's first entry in ret_ids / ret_pos
  uint32_t est_off;      // this run's first entry in est_ids
  uint32_t scratch_off;  // this run's first float in the [G][clusters] logits scratch
  uint32_t cold_pt;
  uint32_t stamp;
  uint32_t want_cap;
};

// The bit a ret_ids entry carries when its cluster had a page out at the
// lookup: estimated, not gathered.
constexpr uint32_t kColdCluster = 0x80000000u;

// Bytes before the f16 centroids of DevRun::centroid16 (an overflow word,
// then padding that keeps the rows 16-byte aligned).
constexpr uint32_t kMeta16Header = 16;

// Entries of a unit map chunk, and the entry of a unit no frame holds (the
// engine's kUnitChunk and kNoFrame, lib/index/head.hpp).
constexpr uint32_t kUnitMapChunk = 4096;
constexpr uint32_t kNoCacheFrame = 0xffffffffu;

// Where a row of a decode's execution buffer lives, when the decode attends
// from frames (GatherArgs::row_src): k, the K row's address (device memory,
// or mapped host memory); x, for a row of the storage dtype (steady zone,
// 16-bit pages) the V row's address, for an 8-bit row the K scale's address
// with bit 0 set (kRowInt8), the V row then at k + page_tokens * head_dim
// bytes and its scale page_tokens floats after the K scale's.
struct RowSource {
  uint64_t k, x;
};
constexpr uint64_t kRowInt8 = 1;

// What a gather did with its i-th miss that could be admitted: took `frame`
// from the pool and mapped unit map entry `entry` (a device address) to it,
// or took it and mapped nothing (entry 0: another step admitted the unit
// first), or found the pool empty (frame kNoCacheFrame). `run` is the run
// of the unit.
struct AdmitEntry {
  uint64_t entry;
  uint32_t frame;
  uint32_t run;
};

// The device cache's free frames, one pool for every step (the buffer
// manager's; lib/buffer/buffer_manager.hpp). The host copies frame ids to
// the next positions of `slots` (device memory; position i at
// slots[i % cap]) and then adds their number to `avail`, in stream order.
// A gather reserves a frame by taking one from `avail` (giving it back
// when there was none) and then takes the next position from `taken`:
// every reservation that succeeded was published, so every position taken
// holds a frame, and no two takers share one. Plain atomic adds and an L2
// read: no retry loop, nothing over PCIe. (Slots in mapped host memory,
// read uncached over PCIe at every miss, made the gather two to three
// times slower on the H100.) The host writes a slot again only once every
// step that could have taken its position has ended. A step's last CTA
// copies `taken` to `seen` (mapped) for the host's count of free frames.
struct FramePool {
  const uint32_t *slots = nullptr;       // [cap], device memory
  unsigned long long *avail = nullptr;   // device word: frames published, not yet reserved (signed)
  unsigned long long *taken = nullptr;   // device word: positions taken
  unsigned long long *seen = nullptr;    // mapped host word
  uint32_t cap = 0;                      // 0: no pool
};

// Where a step's last kernel reports that the step has ended: it writes
// `epoch` to *done (mapped host memory, or device memory) after all its
// writes are visible to the host. Kernels of several CTAs count finished
// CTAs in *ctas (device memory, zero between launches; the last CTA resets
// it). done null: nothing is reported.
struct StepMark {
  unsigned long long *done = nullptr;
  unsigned long long epoch = 0;
  unsigned int *ctas = nullptr;
  // Where set, the epoch is read from this device word when the step ends
  // instead of `epoch` (a decode graph's kernels: StepVars).
  const unsigned long long *epoch_at = nullptr;
};

// What changes from one decoding step to the next while its kernels do not:
// the per-step values of a decode graph (CudaBackend::decode in
// lib/backend/cuda/cuda_backend.cpp),
// written to device memory by the step's staging launch (stage_lookup),
// which every later kernel of the step follows in stream order. A graph's
// kernels take this block's address instead of the values.
struct StepVars {
  unsigned long long epoch = 0;  // the step's: reported by its last kernel (StepMark::epoch_at)
  // The gather's access record (GatherArgs), null where the step has none.
  AdmitEntry *admits = nullptr;
  uint32_t *hits = nullptr;
  uint32_t *record_counts = nullptr;
  uint32_t admit_cap = 0, hit_cap = 0;
  // The attention's output (attend_ragged's out, strides and lse).
  void *out = nullptr;
  int64_t out_seq_stride = 0, out_head_stride = 0;
  float *lse = nullptr;
};

// A decode graph's own staging (stage_from_ring, kernels/table_cuda.hpp):
// the host writes each replayed step's variables, query and run table into
// the next slot of a ring in pinned, mapped host memory, then launches the
// graph; the graph's first kernel reads the slot that a device counter
// names and moves the counter on. A slot is this header, then the run
// table (DevRun[n_runs]), 8-byte aligned.
struct StageSlot {
  StepVars vars;
  const void *q = nullptr;  // [n_seqs][n_q_heads][d] of the engine's dtype
  int64_t q_seq_stride = 0, q_head_stride = 0;  // elements
  uint32_t n_runs = 0, n_seqs = 0;
};

// The ring: slot i at slots + i * slot_bytes (device addresses of mapped
// memory); `taken` counts the slots the graphs have taken (device word,
// slot taken % n_slots next) and `ctas` the staging's finished CTAs
// (device word, zero between launches).
struct StageRing {
  const uint8_t *slots = nullptr;
  uint64_t slot_bytes = 0;
  uint32_t n_slots = 0;
  unsigned int *taken = nullptr;
  unsigned int *ctas = nullptr;
};

// One copy of an append: `rows` rows of row_bytes, row r from byte offset
// src_off + r * src_pitch of the source to dst + r * row_bytes, for K and V
// (kernels/table_cuda.hpp: copy_rows).
struct RowCopyDesc {
  uint8_t *dst_k, *dst_v;
  uint64_t src_off;
  uint32_t rows, pad;
};

// Steps a runtime captures in a CUDA graph of its own (wkv_plan_bind;
// lib/engine/binding.hpp). Each captured call (an append or a decode of one
// layer) has a ring of slots in pinned, mapped host memory that
// wkv_plan_prepare writes before each replay, and a count of the slots its
// kernels have consumed (device memory). A slot begins with this header;
// `stamp` is the step it was written for plus one, written last: a replay
// whose call finds any other stamp in the slot its count names was not
// prepared.
struct BoundSlotHead {
  unsigned long long stamp;
  uint32_t n_copies, n_marks;  // an append's: RowCopyDesc[n_copies], then done[n_marks], epochs[n_marks]
};

// The binding's words both sides see (pinned, mapped; the plan's for its
// life, so that a graph of an earlier binding still reads live memory):
// `generation` is the current binding's (its kernels carry the one they
// were captured under), `n_calls` the program's (set at the first
// prepare), `error` the first fault a kernel found (kBind*), sticky until
// the next binding: from then on every replay does no work, writes NaN to
// its outputs, and the host's next prepare fails.
struct BindWords {
  uint32_t error;
  uint32_t generation;
  uint32_t n_calls;
  uint32_t pad;
};
constexpr uint32_t kBindStale = 1;         // a graph captured under an earlier binding was replayed
constexpr uint32_t kBindUnprepared = 2;    // a replay without wkv_plan_prepare
constexpr uint32_t kBindMissingCall = 3;   // a prepared call did not run in its step, or out of order
constexpr uint32_t kBindEarlyPrepare = 4;  // prepare came before the previous step's replay was launched
// The calls a program holds at most (an append and a decode per layer).
constexpr uint32_t kMaxBoundCalls = 1024;

// A captured call's parameters, by value in its entry kernel: its ring,
// the counts of slots consumed of every call (device memory; at its entry
// in step t, each call before it in the program must have consumed t + 1,
// each after it t), and the CTA counter of its entry kernel.
struct BoundCall {
  const uint8_t *slots = nullptr;
  uint64_t slot_bytes = 0;
  uint32_t n_slots = 0;
  uint32_t index = 0;  // in the program
  uint32_t generation = 0;
  uint32_t pad = 0;
  unsigned int *taken = nullptr;   // [kMaxBoundCalls]: this call's is taken[index]
  unsigned int *worked = nullptr;  // [kMaxBoundCalls]: the slots whose work the call did
  unsigned int *ctas = nullptr;    // zero between launches; its low 16 bits count the entry kernel's CTAs out, the
                                   // bits above those that found the slot prepared (kernels/table.cu, last_cta)
  BindWords *words = nullptr;     // device address of the mapped words
};

// The output of lookup for all runs (device):
//   ret_ids[ret_off + i], i < n_ret     retrieval cluster ids, ascending
//   ret_pos[ret_off + i]                exclusive prefix sum of their sizes:
//                                       where cluster i's rows start in the
//                                       run after the steady zone
//   est_ids[est_off + i], i < n_est     estimation cluster ids, ascending;
//                                       then, where est_extra is not null,
//                                       est_extra[r] retrieval-zone clusters
//                                       found cold (DevRun::cold_pt), which
//                                       the estimate covers too (est_ids
//                                       holds n_est + n_ret entries a run)
//   run_tokens[r]                       steady + retrieval tokens of run r
//   est_out[(r * G + g) * d + i]        estimate of query head g of run r
//   est_lse[r * G + g]                  its log-denominator (-inf if empty)
//   offsets[r], r <= R                  exclusive prefix of run_tokens: the
//                                       execution buffer's ragged offsets
//   zones[scratch_off / G + c]          scratch: the zone of cluster c (0
//                                       neither, 1 retrieval, 2 estimation)
struct DevLookup {
  uint32_t *ret_ids;
  uint32_t *ret_pos;
  uint32_t *est_ids;
  uint32_t *run_tokens;
  float *est_out;
  float *est_lse;
  int32_t *offsets;
  float *logits;  // scratch: [G][clusters] per run at scratch_off
  uint8_t *zones;  // scratch: [clusters] per run at scratch_off / G
  uint32_t *est_extra;  // [R] or null: no run has cold pages
};

}  // namespace wkv::kernels
