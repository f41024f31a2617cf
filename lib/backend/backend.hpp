// The interface both backends implement, in three parts:
//
//   engine memory  where a head's bulk arrays live (lib/index/head.hpp):
//                  host memory on the CPU backend, device memory on a CUDA
//                  backend; allocated, copied and freed in stream order
//   index growth   the two steps of a growth that depend on the device: the
//                  k-means of a batch of segments and the write of clustered
//                  rows into host pages (everything else of a growth is
//                  lib/index/growth.cpp, the same for both)
//   the step       lookup, assemble, attend, merge over a plan whose
//                  sequences, layer and query the engine has set and checked
//
// Streams are the caller's (cudaStream_t as void*; ignored on the CPU).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kmeans_types.hpp"
#include "lib/buffer/buffer_manager.hpp"
#include "lib/common/status.hpp"
#include "lib/index/head.hpp"
#include "wavekv/wavekv.h"

namespace wkv {

class Plan;
struct DecodeOut;
class Binding;
struct BoundCallState;
struct BoundRing;

// A k-means batch begun and not yet ended (the backend's own type).
class ClusterBatch {
 public:
  virtual ~ClusterBatch() = default;
};

// One segment of a growth's k-means batch (engine memory).
using ClusterJob = kernels::KMeansSegmentDesc;

// What a k-means batch gives back, packed by segment as KMeansBatchOut
// describes (kernels/kmeans_types.hpp). Host arrays: n_clusters,
// n_outliers, begin, size, tok_off, clu_off, value_total; engine memory:
// order, centroid, value_sum, spread. Valid until cluster_end().
struct ClusterOut {
  const uint32_t *n_clusters = nullptr;  // [S]
  const uint32_t *n_outliers = nullptr;  // [S] of them, the last ones: outliers split off
  const uint32_t *begin = nullptr;       // [sum k + S]
  const uint32_t *begin_engine = nullptr;  // the same in engine memory (where page writes read it)
  const uint32_t *size = nullptr;        // [sum k]
  const uint64_t *tok_off = nullptr;     // [S]
  const uint64_t *clu_off = nullptr;     // [S]
  const uint32_t *order = nullptr;       // engine memory [sum T]
  const float *centroid = nullptr;       // engine memory [sum k][d]
  const float *value_sum = nullptr;      // engine memory [sum k][d]
  const float *spread = nullptr;         // engine memory [sum k]
  const double *value_total = nullptr;   // [S][d]: sum of the segment's value sums
};

// Clustered rows of one segment into its pages: token slot j of the segment
// gets row order[j] of rows k and v (engine memory). Slot j lives in page
// j / page_tokens of `pages` (host ids) or `dev_pages` (their device
// addresses, engine memory; CUDA only), at row j % page_tokens.
struct PageWriteJob {
  const uint32_t *order = nullptr;
  const uint8_t *k = nullptr, *v = nullptr;
  const PageId *pages = nullptr;
  uint8_t *const *dev_pages = nullptr;
  uint32_t tokens = 0;
  // Centered keys (Config::centered_keys): the segment's clusters, cluster
  // c's tokens at positions [begin[c], begin[c] + size[c]) of `order`, its
  // centroid at centroid[c * head_dim] (f32, engine memory). begin_engine
  // is begin in engine memory (CUDA's page writes read it; size is host
  // memory, read by the CPU's).
  uint32_t clusters = 0;
  const uint32_t *begin = nullptr, *size = nullptr, *begin_engine = nullptr;
  const float *centroid = nullptr;
};

// One write of Backend::write_spans: n bytes from src to dst; where
// `narrow_overflow` is set, n f32 values from src narrowed to f16 at dst
// (as narrow_f16, flagging *narrow_overflow); where `quant_row` is set too,
// n f32 values, rows of quant_row, quantized to 8 bits at dst with their
// scales at quant_scales (as quantize_rows8). All are engine memory or
// memory the backend gave out as such (a k-means batch's scratch).
struct SpanWrite {
  void *dst = nullptr;
  const void *src = nullptr;
  size_t n = 0;
  uint32_t *narrow_overflow = nullptr;
  float *quant_scales = nullptr;
  uint32_t quant_row = 0;
};

// One copy of an append: `rows` rows of a head's K and V from the caller's
// tensors, row r at byte offset src_off + r * src_pitch of k (and of v), to
// dst_k + r * row_bytes and dst_v + r * row_bytes (engine memory).
struct RowCopy {
  uint8_t *dst_k = nullptr, *dst_v = nullptr;
  uint64_t src_off = 0;
  uint32_t rows = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // WKV_DEVICE_CPU or WKV_DEVICE_CUDA.
  virtual uint32_t device() const = 0;

  // Checks a caller's stream before `verb` enqueues anything on it: of the
  // engine's device, and not being captured into a CUDA graph (a captured
  // step would replay its run table as it was: refused until whole-step
  // graphs exist).
  virtual Status check_stream(void *stream, const char *verb) = 0;
  // Checks that a caller's tensor pointer is usable by the engine's device
  // and aligned to `align` bytes; *device (if given) is the address the
  // device reads it at (CUDA: mapped host memory's device pointer).
  virtual Status check_pointer(const void *p, const char *what, size_t align, const void **device = nullptr) = 0;

  // Engine memory ---------------------------------------------------------
  // True on the CPU backend: engine memory is host memory and nothing is
  // mirrored.
  virtual bool host_memory() const = 0;
  // The bits of a component of the meta rows a device engine's steps read
  // (MetaIndex::centroid8 and value_sum8, or centroid16 and value_sum16):
  // 8, or 16 where the backend is told so (CUDA: WKV_META_ROWS=16, for
  // A/Bs). Fixed for the backend's life.
  virtual uint32_t meta_row_bits() const { return 8; }
  // Where a region's memory comes from: engine memory, or, for the meta
  // index's f32 rows (MetaIndex::centroid and value_sum), wherever the
  // engine keeps them: pinned host memory that the device maps on a CUDA
  // engine opened with WKV_CONFIG_HOST_META_ROWS (the same address on
  // both), engine memory elsewhere.
  enum class MemUse : uint8_t { kEngine, kMetaRows };
  // A region of at least `bytes` bytes, 256-byte aligned, in stream order.
  virtual Status mem_alloc(size_t bytes, void *stream, Region *out, MemUse use) = 0;
  Status mem_alloc(size_t bytes, void *stream, Region *out) { return mem_alloc(bytes, stream, out, MemUse::kEngine); }
  // Whether regions of `use` are host memory on a backend whose engine
  // memory is not: a copy between two of them is a kernel's (write_spans),
  // since the driver would make it synchronous.
  virtual bool mem_mapped_host(MemUse use) const {
    (void)use;
    return false;
  }
  // Frees a region after the work already enqueued on `stream`; leaves it
  // empty. Pre: no work on another stream still uses it.
  virtual void mem_free(Region *r, void *stream) = 0;
  // Frees a region once every step begun so far has ended (whatever its
  // stream): for memory that plans in flight may still read.
  virtual void mem_free_deferred(Region *r) = 0;
  // Frees a region once every step begun so far has ended and the work
  // enqueued on `stream` so far has run: for memory that a growth's copies
  // and kernels, still queued on the caller's stream, may read as well.
  virtual void mem_free_after(Region *r, void *stream) = 0;
  // Copies between engine memory and host memory, either way, in stream
  // order. A copy from host memory has read it when the call returns.
  virtual Status mem_copy(void *dst, const void *src, size_t bytes, void *stream) = 0;
  // Copies `rows` rows of `width` bytes, pitches in bytes.
  virtual Status mem_copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                               size_t width, size_t rows, void *stream) = 0;
  virtual Status mem_fill(void *dst, uint8_t byte, size_t bytes, void *stream) = 0;
  // *dst = value (engine memory, 8-byte aligned), in stream order, without
  // waiting for the stream (CUDA: the value travels as a kernel parameter).
  virtual Status mem_store64(void *dst, uint64_t value, void *stream) = 0;
  // dst[i] = f16(src[i]) for i < n, engine memory both, in stream order;
  // sets *overflow (engine memory) to nonzero if a value lies outside f16's
  // range. Backends whose kernels read no f16 meta index need not have it.
  virtual Status narrow_f16(const float *src, size_t n, void *dst, uint32_t *overflow, void *stream) {
    (void)src, (void)n, (void)dst, (void)overflow, (void)stream;
    return WKV_ERROR(WKV_ERR_INTERNAL, "narrow_f16: not on this backend");
  }
  // Each of `rows` f32 rows of d values at src quantized to 8 bits at dst
  // ([rows][d]) with its scale at scales[row], engine memory all, in stream
  // order: kernels/dtype.hpp's quantize_row, the same bytes; sets *overflow
  // to nonzero where a row is not finite. Backends whose kernels read no
  // 8-bit meta rows need not have it.
  virtual Status quantize_rows8(const float *src, size_t rows, uint32_t d, int8_t *dst, float *scales,
                                uint32_t *overflow, void *stream) {
    (void)src, (void)rows, (void)d, (void)dst, (void)scales, (void)overflow, (void)stream;
    return WKV_ERROR(WKV_ERR_INTERNAL, "quantize_rows8: not on this backend");
  }
  // The spans, after the stream's work so far, the way a growth's commit
  // writes its meta rows and mirror entries. They may run in any order
  // among themselves: no span may overlap another's destination or read
  // it. CUDA: one launch per 80 spans, where mem_copy, narrow_f16 and
  // quantize_rows8 would take a driver call each; every span is checked
  // before the first launch and no host memory is allocated, so a refusal
  // enqueues nothing.
  virtual Status write_spans(const SpanWrite *spans, uint32_t n, void *stream) {
    for (uint32_t i = 0; i < n; ++i) {
      const SpanWrite &w = spans[i];
      if (w.quant_row > 0)
        WKV_RETURN_IF_ERROR(quantize_rows8(static_cast<const float *>(w.src), w.n / w.quant_row, w.quant_row,
                                           static_cast<int8_t *>(w.dst), w.quant_scales, w.narrow_overflow, stream));
      else
        WKV_RETURN_IF_ERROR(w.narrow_overflow
                                ? narrow_f16(static_cast<const float *>(w.src), w.n, w.dst, w.narrow_overflow, stream)
                                : mem_copy(w.dst, w.src, w.n, stream));
    }
    return Status::ok();
  }
  // The copies of an append (of one sequence or of a batch), in stream
  // order: k and v are device addresses (check_pointer's), every row
  // `width` bytes. CUDA: one launch per 96 copies, no driver copy calls.
  virtual Status copy_rows(const RowCopy *copies, uint32_t n, const uint8_t *k, const uint8_t *v, size_t src_pitch,
                           size_t width, void *stream) {
    for (uint32_t i = 0; i < n; ++i) {
      const RowCopy &c = copies[i];
      WKV_RETURN_IF_ERROR(mem_copy_rows(c.dst_k, width, k + c.src_off, src_pitch, width, c.rows, stream));
      WKV_RETURN_IF_ERROR(mem_copy_rows(c.dst_v, width, v + c.src_off, src_pitch, width, c.rows, stream));
    }
    return Status::ok();
  }
  // copy_rows, and where the backend can, the end of the trackers' steps
  // (epochs[i] of trackers[i], i < n_ends) in the same work, as end_work_many
  // after it would (CUDA: one launch for both, for small appends); *ended
  // says whether it did (else the caller ends them).
  virtual Status copy_rows_then_end(const RowCopy *copies, uint32_t n, const uint8_t *k, const uint8_t *v,
                                    size_t src_pitch, size_t width, StepTracker *const *trackers,
                                    const uint64_t *epochs, uint32_t n_ends, void *stream, bool *ended) {
    (void)trackers;
    (void)epochs;
    (void)n_ends;
    *ended = false;
    return copy_rows(copies, n, k, v, src_pitch, width, stream);
  }

  // Waits for everything enqueued on `stream` (reads of engine memory into
  // host memory are complete after it).
  virtual Status mem_sync(void *stream) = 0;
  // Waits for everything enqueued on the device, whatever the stream.
  virtual Status device_sync() { return Status::ok(); }
  // The backend's own stream for copies the caller gave no stream for
  // (saving and loading sequences): CUDA, a non-blocking stream made at
  // open, never the legacy default stream; nullptr on the CPU.
  virtual void *io_stream() { return nullptr; }

  // Index growth ------------------------------------------------------------
  // Complete prompt segments a layer gathers per KV head before they are
  // clustered during the appends (the prompt's end clusters the rest).
  virtual uint32_t prompt_batch_segments() const = 0;
  // The k-means of a growth, in four calls, so that a generated segment is
  // clustered off the decoding path (lib/index/growth.cpp):
  //   cluster_begin    begins the k-means of n segments whose rows the work
  //                    enqueued on `stream` so far writes (CUDA: on the
  //                    backend's growth stream, after an event of `stream`;
  //                    the CPU clusters at once); the batch's outputs are its
  //                    own, so several may be in flight
  //   cluster_ready    whether the results can be taken without waiting
  //                    (never waits)
  //   cluster_take     the results (waits for them if not ready: a prompt's
  //                    growth), and orders `stream` after the k-means, so
  //                    that reads of its engine-memory outputs enqueued on it
  //                    come after; adds the k-means time to the counters
  //   cluster_end      the caller's last read of the outputs is enqueued on
  //                    `stream`, or, with nullptr, nothing was read and the
  //                    batch is abandoned (a layer released: memory freed
  //                    after it waits for the k-means too)
  // Every begun batch ends exactly once.
  // `scratch` bytes of host memory come with the batch (cluster_scratch):
  // what the growth copies to engine memory from there never waits for the
  // stream (CUDA: pinned memory), and lives until the batch has ended.
  virtual Status cluster_begin(const ClusterJob *jobs, uint32_t n, size_t scratch, void *stream,
                               ClusterBatch **out) = 0;
  virtual uint8_t *cluster_scratch(ClusterBatch *b) = 0;
  virtual bool cluster_ready(ClusterBatch *b) = 0;
  virtual Status cluster_take(ClusterBatch *b, void *stream, ClusterOut *out) = 0;
  virtual void cluster_end(ClusterBatch *b, void *stream) = 0;
  // Makes `stream` wait, on the device, for the batch's k-means (its reads
  // of the segments' rows): before rows it reads move.
  virtual Status cluster_after(ClusterBatch *b, void *stream) {
    (void)b, (void)stream;
    return Status::ok();
  }
  // Writes clustered segments into host pages, in stream order.
  virtual Status write_pages(const PageWriteJob *jobs, uint32_t n, void *stream) = 0;
  // The address a kernel reads host page `id` at (CUDA: mapped memory);
  // null for kNoPage.
  virtual const uint8_t *page_address(PageId id) = 0;
  // Cold pages (lib/engine/cold.hpp). Points the device page table entries
  // of the head's pages[0..n) at their host pages (null where kNoPage), in
  // stream order; nothing to do where steps read the host's table.
  virtual Status point_pages(HeadState &hs, const uint32_t *pages, uint32_t n, void *stream) {
    (void)hs, (void)pages, (void)n, (void)stream;
    return Status::ok();
  }
  // Copies the head's device recency stamps (HeadMirror::stamps) of
  // clusters [0, n) into dst, waiting for the copy only (steps in flight
  // may be writing them: a stamp read is a hint). Unsupported where the
  // host keeps the stamps itself.
  virtual Status read_stamps(const HeadState &hs, uint32_t *dst, uint32_t n) {
    (void)hs, (void)dst, (void)n;
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "the host keeps the recency stamps");
  }

  // Marks the end of an append's or growth's device work on `stream` in the
  // sequence's tracker (the buffer manager frees a destroyed sequence's
  // memory once it is done).
  virtual Status end_work(StepTracker &tracker, uint64_t epoch, void *stream) = 0;
  // end_work for n trackers at once (a batched append). CUDA: one launch.
  virtual Status end_work_many(StepTracker *const *trackers, const uint64_t *epochs, uint32_t n, void *stream) {
    Status first = Status::ok();
    for (uint32_t i = 0; i < n; ++i) {
      Status st = end_work(*trackers[i], epochs[i], stream);
      if (first.is_ok()) first = st;
    }
    return first;
  }

  // The buffer manager's view of the device (done words, the record ring,
  // unit map stores), and the device cache's frames (0: no cache).
  virtual BufferManager::Device *buffer_device() = 0;
  virtual uint32_t cache_units() const { return 0; }

  // Registers a new head with the device cache (CUDA); a no-op elsewhere.
  virtual void on_head_created(HeadState &head) { (void)head; }
  // A head is being destroyed: its cache frames go back (CUDA).
  virtual void on_head_destroyed(HeadState &head) { (void)head; }

  // The step --------------------------------------------------------------
  // Describes the plan's assembled execution buffer (pointers on the device).
  virtual void xbuf(const Plan &plan, wkv_xbuf_view *view) = 0;
  // Adds the backend's own figures (cache) to *out.
  virtual void fill_stats(wkv_stats *out) { (void)out; }
  // Scores clusters, selects the zones and estimates the estimation zone.
  virtual Status lookup(Plan &plan) = 0;
  // Lays out steady and retrieval tokens in the execution buffer.
  virtual Status assemble(Plan &plan) = 0;
  // Exact attention over the execution buffer merged with the estimate.
  virtual Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) = 0;
  // Folds the estimate into a caller's output and lse.
  virtual Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                       int64_t lse_seq_stride) = 0;
  // Frees a plan's backend buffers once its steps have ended.
  virtual void release_plan(Plan &plan) { (void)plan; }
  // A whole decoding step (lookup, assemble, attend) at once, where the
  // backend has a faster way than the verbs one by one (decodes() true;
  // CUDA: the step's kernels replayed as a graph). Called in place of
  // lookup, with the plan's runs sized.
  virtual bool decodes() const { return false; }
  // Whether a decode leaves the step's rows in the plan's execution buffer
  // (for wkv_plan_xbuf and wkv_attend after it); false where it attends
  // from where the rows live.
  virtual bool decode_lays_out_rows() const { return true; }
  virtual Status decode(Plan &plan, const DecodeOut &out) {
    (void)plan;
    (void)out;
    return WKV_ERROR(WKV_ERR_INTERNAL, "the backend has no whole-step decode");
  }

  // Steps a runtime captures (lib/engine/binding.hpp; CUDA) ----------------
  // Whether plans may be bound.
  virtual bool binds() const { return false; }
  // Whether `stream` is being captured into a CUDA graph (false where
  // nothing is captured).
  virtual Status capturing(void *stream, bool *yes) {
    (void)stream;
    *yes = false;
    return Status::ok();
  }
  // Readies the plan for `b` (its seqs, max_calls and per-layer reserve
  // set): buffers for every layer's reserve, b.max_calls rings of
  // kBoundSlots slots (a call's ring is ring i: bound_ring), every call's
  // count zero, a new generation and no fault in the words. All or nothing.
  virtual Status bind(Plan &plan, Binding &b) {
    (void)plan, (void)b;
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "the backend captures no steps");
  }
  virtual void bound_ring(Plan &plan, uint32_t i, BoundRing *out) { (void)plan, (void)i, (void)out; }
  // The binding ends: its generation is retired (a graph captured under it
  // faults kBindStale), its rings go back. Pre: no replay in flight.
  virtual void unbind(Plan &plan) { (void)plan; }
  // The fault the binding's kernels found (kernels::kBind*; 0: none), and
  // the program's call count for them (at the first prepare).
  virtual uint32_t bound_fault(const Plan &plan) {
    (void)plan;
    return 0;
  }
  virtual void bound_seal(Plan &plan, uint32_t n_calls) { (void)plan, (void)n_calls; }
  // The slots whose work each of the first n calls did (waits for the copy
  // only): a prefix of the steps prepared, the rest never written.
  virtual Status bound_counts(Plan &plan, uint32_t n, uint32_t *out) {
    (void)plan, (void)n, (void)out;
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "the backend captures no steps");
  }
  // Enqueues call i of b on `stream`, which is being captured.
  virtual Status capture_bound(Plan &plan, Binding &b, uint32_t i, void *stream) {
    (void)plan, (void)b, (void)i, (void)stream;
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "the backend captures no steps");
  }
  // Faults the binding on the device unless call i has consumed `want`
  // slots where `stream` has come to.
  virtual Status bound_expect(Plan &plan, uint32_t i, uint32_t want, void *stream) {
    (void)plan, (void)i, (void)want, (void)stream;
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "the backend captures no steps");
  }
  // Prepare's decode (call i of b, the plan's runs sized as a lookup's):
  // the slot body after kernels::BoundSlotHead, checked against the layer's
  // reserve (WKV_ERR_STATE beyond it); the call's run_heads, want_units,
  // retrieved and estimated. Then, once every call of the step is ready,
  // seal_decode: the step's variables (epoch, access record, output).
  virtual Status prepare_decode(Plan &plan, Binding &b, uint32_t i, uint8_t *body) {
    (void)plan, (void)b, (void)i, (void)body;
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "the backend captures no steps");
  }
  virtual void seal_decode(Plan &plan, BoundCallState &c, uint64_t epoch, uint8_t *body) {
    (void)plan, (void)c, (void)epoch, (void)body;
  }
};

}  // namespace wkv
