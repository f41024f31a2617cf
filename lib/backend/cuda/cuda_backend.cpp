// The CUDA backend: a head's regions (steady zone, meta index, the mapping
// table's mirror) live in device memory; pages live in pinned, mapped host
// arenas and, when hot, in the device block cache as frames (lib/buffer/
// buffer_manager.hpp). A decoding step (lookup, assemble, attend or merge) is
// enqueued on the caller's stream with no host wait; its last kernel reports
// its end in its plan's step tracker. Everything else of the engine is
// shared with the CPU backend: growth (lib/index/growth.cpp), buffer
// management (lib/buffer/), plans and sequences (lib/engine/).
//
// Every entry point makes the engine's device current and restores the
// caller's on return (DeviceGuard), the buffer manager's thread included.
#if defined(WKV_WITH_CUDA)

#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>

#include "kernels/attention_cuda.hpp"
#include "kernels/gather_cuda.hpp"
#include "kernels/kmeans_cuda.hpp"
#include "kernels/lookup_cuda.hpp"
#include "kernels/table_cuda.hpp"
#include "lib/backend/cuda/device_state.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/binding.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"

namespace wkv {

Status cuda_error(cudaError_t err, const char *stmt, const char *file, int line) {
  (void)cudaGetLastError();
  const int code = err == cudaErrorMemoryAllocation ? WKV_ERR_OUT_OF_MEMORY : WKV_ERR_DEVICE;
  return Status(code, format("CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(err), cudaGetErrorString(err),
                             stmt, file, line));
}

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&prev_) != cudaSuccess) {
    (void)cudaGetLastError();
    prev_ = -1;
  }
  if (prev_ != device) {
    ok_ = cudaSetDevice(device) == cudaSuccess;
    if (!ok_) (void)cudaGetLastError();
    changed_ = ok_ && prev_ >= 0;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(prev_);
}

Status PinnedBlocks::alloc(size_t bytes, void **host, void **dev) {
  void *p = nullptr;
  WKV_CU(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(p, 0, bytes);
  cudaError_t err = cudaHostGetDevicePointer(dev, p, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(p);
    return cuda_error(err, "cudaHostGetDevicePointer", __FILE__, __LINE__);
  }
  try {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back(p);
  } catch (...) {
    cudaFreeHost(p);
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory");
  }
  *host = p;
  return Status::ok();
}

PinnedBlocks::~PinnedBlocks() {
  for (void *p : blocks_) cudaFreeHost(p);
}

bool cuda_device_usable(int device_id) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return device_id >= 0 && device_id < n;
}

namespace {

// Complete prompt segments a layer gathers per head before they are
// clustered during the appends (the prompt's end clusters the rest): 16 x
// 8192 tokens makes a 128K prompt one batch. Bounds the device memory a
// chunked prefill holds unclustered: 16 segments x KV heads x 2 x row.
constexpr uint32_t kPromptBatchSegments = 16;

// A host arena chunk is faulted in and pinned in pieces of 4 MiB, each
// piece's pages faulted in before it is pinned. Both hold locks that other
// threads' calls wait for: CUDA may serialize calls across threads (the
// issue measured 100 to 150 ms of pinning per 512 MiB, some 15 ms for a
// 64 MiB chunk in one call), and faulting pages in holds the process's
// memory map lock, which every mmap waits for. A piece holds either for far
// less, and the thread yields between pieces.
constexpr size_t kPinPiece = size_t{4} << 20;

// Unpins what pin_in_pieces pinned (a chunk left pageable: nothing).
void unpin_pieces(void *base, size_t bytes) {
  uint8_t *const p = static_cast<uint8_t *>(base);
  for (size_t off = 0; off < bytes; off += kPinPiece)
    if (cudaHostUnregister(p + off) != cudaSuccess) (void)cudaGetLastError();
}

cudaError_t pin_in_pieces(void *base, size_t bytes) {
  uint8_t *const p = static_cast<uint8_t *>(base);
  for (size_t off = 0; off < bytes; off += kPinPiece) {
    const size_t n = std::min(kPinPiece, bytes - off);
    // Fault the piece's pages in (after the arena's NUMA binding) outside
    // the driver, a piece at a time: faulting holds the process's memory
    // map lock, and a whole 64 MiB chunk of huge pages (some 15 ms of
    // zeroing) held it long enough to stall every other thread's mmap
    // behind it: the decoding thread's allocations waited 12 to 28 ms at
    // growth rounds. A kernel without MADV_POPULATE_WRITE (before Linux
    // 5.14) says EINVAL: touch each page instead. Any other failure (no
    // memory) is the pinning's failure, not a fault later.
#if defined(MADV_POPULATE_WRITE)
    if (madvise(p + off, n, MADV_POPULATE_WRITE) != 0) {
      if (errno != EINVAL) {
        unpin_pieces(p, off);
        return cudaErrorMemoryAllocation;
      }
      for (size_t b = 0; b < n; b += 4096) p[off + b] = 0;
    }
#else
    for (size_t b = 0; b < n; b += 4096) p[off + b] = 0;
#endif
    const cudaError_t err = cudaHostRegister(p + off, n, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      unpin_pieces(p, off);
      return err;
    }
    std::this_thread::yield();
  }
  return cudaSuccess;
}

// A kernel wrapper's error as a status: the kernels return the CUDA error,
// with cudaErrorInvalidValue for arguments they refuse (the engine checks
// them first, so that is a bug here) and cudaErrorNotSupported for a shape
// they have no instantiation of.
Status kernel_status(cudaError_t err, const char *call) {
  (void)cudaGetLastError();
  switch (err) {
    case cudaErrorInvalidValue:
      return WKV_ERROR(WKV_ERR_INTERNAL, "%s refused its arguments", call);
    case cudaErrorNotSupported:
      return WKV_ERROR(WKV_ERR_UNSUPPORTED, "%s has no kernel for this shape", call);
    case cudaErrorMemoryAllocation:
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "%s: out of device memory", call);
    default:
      return WKV_ERROR(WKV_ERR_DEVICE, "%s: CUDA error %s (%s)", call, cudaGetErrorName(err),
                       cudaGetErrorString(err));
  }
}

#define WKV_KERNEL(call)                                        \
  do {                                                          \
    const cudaError_t wkv_k_err_ = (call);                      \
    if (wkv_k_err_ != cudaSuccess) return kernel_status(wkv_k_err_, #call); \
  } while (0)

// A bound that a decode graph's kernels take (grids, splits, scratch):
// `have` while it covers n, else n and an eighth more, rounded up to an
// eighth of its power of two (at least 64). Bounds only rise, so that a
// graph serves while the sizes it bounds move below it.
uint64_t decode_bound(uint64_t have, uint64_t n) {
  if (n <= have) return have;
  n += n / 8;
  if (n <= 64) return 64;
  uint64_t p = 1;
  while (p <= n / 2) p *= 2;  // the largest power of two <= n
  const uint64_t step = p / 8;
  return (n + step - 1) / step * step;
}
uint32_t decode_bound32(uint32_t have, uint64_t n) {
  return static_cast<uint32_t>(std::min<uint64_t>(decode_bound(have, n), UINT32_MAX));
}

// A decode's variables (kernels::StepVars): its epoch, its access record
// where it has one, its output.
kernels::StepVars step_vars(uint64_t epoch, const StepRecord &rec, void *out, int64_t seq_stride,
                            int64_t head_stride) {
  kernels::StepVars v;
  v.epoch = epoch;
  if (rec.header) {
    v.admits = rec.admits;
    v.hits = rec.hits;
    v.record_counts = &rec.header->used;
    v.admit_cap = rec.admit_cap;
    v.hit_cap = rec.hit_cap;
  }
  v.out = out;
  v.out_seq_stride = seq_stride;
  v.out_head_stride = head_stride;
  return v;
}

// What sizing a plan's lookup found (CudaBackend::size_plan).
struct PlanSizes {
  uint32_t R = 0, max_clusters = 0;
  float *scores = nullptr;  // the selection's scratch, after the logits
  size_t retrieved = 0, estimated = 0;
};

// The plan's kernel counters (PlanDevice::counters): the gather's three,
// the finished CTAs of attend's, merge's and the lookup's last kernels, a
// replay's staging: its finished CTAs and the ring's count of slots taken,
// and the finished CTAs of a forked decode's selection.
constexpr uint32_t kGatherWork = 0, kAttendCtas = 3, kMergeCtas = 4, kLookupCtas = 5, kStageCtas = 6,
                   kStageTaken = 7, kSelectCtas = 8, kCounterWords = 9;

// A growth's k-means batch: its outputs in device memory, what the host
// reads of them (counts, first members, sizes, value totals) and the
// commit's scratch in one pinned block, and its events.
struct CudaClusterBatch final : ClusterBatch {
  Region n, begin, order, size, cent, vsum, spread, vtot;  // device, grow only
  uint32_t *host = nullptr;  // pinned: the readback, then the scratch
  size_t host_bytes = 0;
  // Byte offsets in host: n_clusters and n_outliers at 0, then begins,
  // sizes, the value totals (8-byte aligned) and the scratch.
  size_t begin_at = 0, size_at = 0, totals_at = 0, scratch_at = 0;
  uint32_t S = 0;
  std::vector<uint64_t> tok_off, clu_off;
  cudaEvent_t input = nullptr;     // the caller's stream: the segments' rows written
  cudaEvent_t t0 = nullptr, t1 = nullptr;  // the k-means, timed; t1 also: the readback done
  cudaEvent_t done = nullptr;      // after the batch's last reader (its end)
  bool in_use = false, ended_once = false, timed = false;
};

class CudaBackend final : public Backend, public BufferManager::Device {
 public:
  explicit CudaBackend(Engine &e) : e_(e) {}
  ~CudaBackend() override;
  Status init(HostArena::Options *ao);
  // host_rows_pool_, on the host NUMA node given (-1: none known).
  Status open_host_rows_pool(int numa_node);

  uint32_t device() const override { return WKV_DEVICE_CUDA; }
  Status check_stream(void *stream, const char *verb) override;
  Status check_pointer(const void *p, const char *what, size_t align, const void **device) override;

  bool host_memory() const override { return false; }
  uint32_t meta_row_bits() const override { return meta_row_bits_; }
  using Backend::mem_alloc;
  Status mem_alloc(size_t bytes, void *stream, Region *out, MemUse use) override;
  bool mem_mapped_host(MemUse use) const override { return use == MemUse::kMetaRows && host_rows_pool_; }
  void mem_free(Region *r, void *stream) override;
  void mem_free_deferred(Region *r) override;
  void mem_free_after(Region *r, void *stream) override;
  Status mem_copy(void *dst, const void *src, size_t bytes, void *stream) override;
  Status mem_copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width, size_t rows,
                       void *stream) override;
  Status mem_fill(void *dst, uint8_t byte, size_t bytes, void *stream) override;
  Status mem_store64(void *dst, uint64_t value, void *stream) override;
  Status narrow_f16(const float *src, size_t n, void *dst, uint32_t *overflow, void *stream) override;
  Status quantize_rows8(const float *src, size_t rows, uint32_t d, int8_t *dst, float *scales, uint32_t *overflow,
                        void *stream) override;
  Status write_spans(const SpanWrite *spans, uint32_t n, void *stream) override;
  Status copy_rows(const RowCopy *copies, uint32_t n, const uint8_t *k, const uint8_t *v, size_t src_pitch,
                   size_t width, void *stream) override;
  Status copy_rows_then_end(const RowCopy *copies, uint32_t n, const uint8_t *k, const uint8_t *v, size_t src_pitch,
                            size_t width, StepTracker *const *trackers, const uint64_t *epochs, uint32_t n_ends,
                            void *stream, bool *ended) override;
  Status mem_sync(void *stream) override;
  Status device_sync() override;
  void *io_stream() override { return io_; }

  uint32_t prompt_batch_segments() const override { return kPromptBatchSegments; }
  Status cluster_begin(const ClusterJob *jobs, uint32_t n, size_t scratch, void *stream, ClusterBatch **out) override;
  uint8_t *cluster_scratch(ClusterBatch *b) override;
  bool cluster_ready(ClusterBatch *b) override;
  Status cluster_take(ClusterBatch *b, void *stream, ClusterOut *out) override;
  void cluster_end(ClusterBatch *b, void *stream) override;
  Status cluster_after(ClusterBatch *b, void *stream) override;
  Status write_pages(const PageWriteJob *jobs, uint32_t n, void *stream) override;
  const uint8_t *page_address(PageId id) override { return id == kNoPage ? nullptr : e_.arena().page_ptr(id); }
  Status point_pages(HeadState &hs, const uint32_t *pages, uint32_t n, void *stream) override;
  Status read_stamps(const HeadState &hs, uint32_t *dst, uint32_t n) override;
  Status end_work(StepTracker &t, uint64_t epoch, void *stream) override;
  Status end_work_many(StepTracker *const *trackers, const uint64_t *epochs, uint32_t n, void *stream) override;

  BufferManager::Device *buffer_device() override { return this; }
  uint32_t cache_units() const override { return frames_; }
  void on_head_created(HeadState &head) override;
  void on_head_destroyed(HeadState &head) override;

  // The buffer manager's device.
  Status alloc_words(size_t n, uint64_t **host, uint64_t **dev) override;
  Status alloc_ring(size_t bytes, uint8_t **host, uint8_t **dev) override;
  Status alloc_device(size_t bytes, void **dev) override;
  Status publish_frames(const uint32_t *host_slots, const uint32_t *host_slots_dev, uint32_t *dev_slots,
                        uint64_t first, uint64_t n, uint32_t cap,
                        uint64_t *avail) override;
  Status clear_entries(const uint64_t *entries, uint32_t n) override;

  void xbuf(const Plan &plan, wkv_xbuf_view *view) override;
  void fill_stats(wkv_stats *out) override;
  Status lookup(Plan &plan) override;
  bool decodes() const override { return graphs_; }
  bool decode_lays_out_rows() const override { return !from_frames(); }
  // Decodes from frames, where the page format allows: the attention adds
  // no centroid back (centered keys lay their rows out).
  bool from_frames() const { return from_frames_ && !e_.config().centered_keys(); }
  Status decode(Plan &plan, const DecodeOut &out) override;
  Status assemble(Plan &plan) override;
  Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) override;
  Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
               int64_t lse_seq_stride) override;
  void release_plan(Plan &plan) override;

  bool binds() const override { return true; }
  Status capturing(void *stream, bool *yes) override;
  Status bind(Plan &plan, Binding &b) override;
  void bound_ring(Plan &plan, uint32_t i, BoundRing *out) override;
  void unbind(Plan &plan) override;
  uint32_t bound_fault(const Plan &plan) override;
  void bound_seal(Plan &plan, uint32_t n_calls) override;
  Status bound_counts(Plan &plan, uint32_t n, uint32_t *out) override;
  Status capture_bound(Plan &plan, Binding &b, uint32_t i, void *stream) override;
  Status bound_expect(Plan &plan, uint32_t i, uint32_t want, void *stream) override;
  Status prepare_decode(Plan &plan, Binding &b, uint32_t i, uint8_t *body) override;
  void seal_decode(Plan &plan, BoundCallState &c, uint64_t epoch, uint8_t *body) override;

 private:
  // A bound plan's slot: its header and the larger of a decode's body (the
  // staging slot and the run table) and an append's (its copies and marks).
  size_t bound_slot_bytes(uint32_t n_seqs) const;
  // The binding words of plans (kernels::BindWords): pinned and mapped, in
  // blocks of 256, a plan's taken at its first binding and given back once
  // its steps have ended.
  Status take_bind_words(kernels::BindWords **host, kernels::BindWords **dev);
  std::mutex words_mu_;
  std::vector<std::pair<kernels::BindWords *, kernels::BindWords *>> free_words_;

  // Grows one of a plan's buffers (contents not kept); the old one goes
  // once the plan's steps in flight have ended, or with the plan once it
  // has been bound (PlanDevice::retired).
  Status plan_region(PlanDevice &pd, Region *r, size_t bytes, cudaStream_t s);
  // A lookup's host part: the run table (PlanDevice::host_runs), its bounds
  // and the plan's buffers; `graph`: laid out for a decode graph; `fixed`:
  // a bound plan's, whose buffers must hold the step as they are.
  Status size_plan(Plan &plan, cudaStream_t s, bool graph, PlanSizes *z, bool fixed = false);
  // A step's access record (null header without a device cache): room to
  // log the admissions of its misses (frames it takes from the buffer
  // manager's pool) and its hits. Hits beyond the log's room refresh
  // nothing (recency is a hint).
  StepRecord open_step_record(Plan &plan, uint64_t epoch);
  // ... for runs of the given cache heads (a bound decode's, kept from its
  // prepare's first pass).
  StepRecord open_step_record(Plan &plan, uint64_t epoch, const uint64_t *heads, uint32_t n_runs,
                              uint32_t want_units, uint32_t layer);
  // A gather's arguments but for its pool, record, mark and variables.
  kernels::GatherArgs gather_args(const kernels::DevRun *runs, uint32_t R, const kernels::DevLookup &lookup,
                                  uint32_t max_ret, uint8_t *xk, uint8_t *xv, uint32_t *counters) const;
  // The kernels of a decode after its staging, on s (captured or not).
  struct DecodeBody;
  // A decode's geometry and the plan's buffers (its bounds, scores and
  // split are the caller's).
  DecodeBody decode_body(Plan &plan, uint32_t R) const;
  // With `side` (a capture's), the estimate runs there, beside the offsets
  // and the gather: a fork after the selection, joined before the
  // attention. `fail_in_fork` (fault injection) fails the capture there.
  // fork_ev and join_ev: the fork's events (the engine's own captures':
  // fork_ev_ and join_ev_, under cap_mu_).
  cudaError_t launch_decode(const DecodeBody &b, cudaStream_t s, cudaStream_t side = nullptr,
                            bool fail_in_fork = false, cudaEvent_t fork_ev = nullptr, cudaEvent_t join_ev = nullptr);
  // A ring for the plan's replays with slots for R runs (PlanDevice::stage_host).
  static size_t stage_slot_bytes(uint32_t R);
  Status stage_ring(PlanDevice &pd, uint32_t R);
  void release_stage(PlanDevice &pd);
  // Captures them into an executable graph (`fail`: fault injection, a
  // failure inside the capture).
  cudaError_t capture_decode(const DecodeBody &b, cudaGraphExec_t *out, bool fail = false);
  // The k-means workspace, grow only (one growth at a time uses it).
  Status km_region(Region *r, size_t bytes, cudaStream_t s);
  // A step's verb failed after taking its epoch: its kernels will not all
  // run, so its end is reported from the host once the stream is idle.
  Status finish(StepTracker &t, uint64_t epoch, Status st, cudaStream_t s);

  Engine &e_;
  int dev_ = 0;
  cudaStream_t side_ = nullptr;           // the buffer manager's stores and stats reads: waits for nothing
  // Frees in stream order once no step reads the memory: may wait (on the
  // device) for a caller's stream or the growth stream, so never on side_,
  // whose users synchronize with it.
  cudaStream_t free_ = nullptr;
  std::mutex free_mu_;
  // The engine's device memory (mem_alloc, the k-means's): a pool of its own
  // that keeps what is freed for the engine's next allocations. The
  // device's default pool gives memory back to the driver at every
  // synchronization, so a growth's allocations after a runtime's per-token
  // synchronization mapped fresh memory: 1 to 21 ms a commit at batch 7.
  cudaMemPool_t mempool_ = nullptr;
  // The meta index's f32 rows with WKV_CONFIG_HOST_META_ROWS: pinned host
  // memory on the GPU's NUMA node (where the driver places it so), mapped
  // for the device, and kept by the pool when freed as mempool_'s is, so
  // that a growth that replaces a region neither pins nor unpins (which
  // would synchronize the device).
  cudaMemPool_t host_rows_pool_ = nullptr;
  cudaStream_t io_ = nullptr;             // copies of sequences saved and loaded
  std::mutex side_mu_;                    // one user of side_ at a time
  // clear_entries' addresses (mapped, pinned_'s; guarded by side_mu_).
  uint64_t *clear_host_ = nullptr;
  const uint64_t *clear_dev_ = nullptr;
  uint32_t clear_cap_ = 0;
  uint32_t clear_retry_ = 0;  // calls until a failed growth is tried again (0: now)
  uint8_t *cache_ = nullptr;              // frames_ frames of frame_bytes_
  size_t frame_bytes_ = 0;
  uint32_t frames_ = 0;
  unsigned long long *d_stats_ = nullptr;  // [0] hits, [1] misses (units), [2] tokens gathered
  static constexpr size_t kStatsBytes = 3 * sizeof(unsigned long long);
  std::vector<void *> d_blocks_;            // the buffer manager's device memory
  std::atomic<uint64_t> d_block_bytes_{0};  // their bytes (wkv_stats.device_bytes_*)
  // The buffer manager's publications to its pool (copies of slots and
  // additions to its count): a stream of their own (side_ is waited on).
  cudaStream_t pool_stream_ = nullptr;
  PinnedBlocks pinned_;

  // Decode graphs (CudaBackend::decode): on unless WKV_DECODE_GRAPHS=0;
  // captured on a stream of their own, one capture at a time.
  bool graphs_ = true;
  // Replays staged from the plan's ring (one launch a step) unless
  // WKV_DECODE_RING=0: then a staging launch before each replay (two).
  bool rings_ = true;
  std::mutex cap_mu_;
  cudaStream_t cap_ = nullptr;
  // A graph's estimate beside its gather (launch_decode's fork) unless
  // WKV_DECODE_FORK=0; captured on cap_side_, one priority below the
  // device's highest where the range has two (side_priority()), so that
  // its CTAs are placed as soon as the gather's leave room, yet after the
  // buffer manager's clears and publishes of free frames (side_ and
  // pool_stream_, at the highest), which no step's CTAs may hold up.
  // The graph's other kernels keep the priority of the caller's stream:
  // they are captured on a stream of that priority (cap_priority_, made
  // when first asked; cap_ is the least's, the default). A plan whose steps
  // alternate between streams of two priorities changes its graph's key at
  // every step, and launches one by one.
  bool fork_ = true;
  // With WKV_DECODE_FROM_FRAMES=1 a decode's attention reads each row
  // where it lives (a device cache frame, host pages, the steady zone's
  // buffers; the gather then writes only where, and reads only what it
  // admits); by default the gather lays the rows out in the execution
  // buffer and the attention reads them there, as the split verbs do. The
  // same bits either way. Off by default: slower on the H100 (its
  // attention waits on device memory with 8 warps a multiprocessor;
  // bench/RESULTS.md, "fourth session").
  bool from_frames_ = false;
  // The estimate reads the value sums' compact copy (MetaIndex::value_sum8
  // or value_sum16) where a head keeps one; WKV_VALUE_SUM16=0 (a
  // diagnostic) keeps it on the f32 rows.
  bool value_sum16_ = true;
  // The centroid and value sum rows the logits and the estimate read: 8
  // bits a component with a scale a row (half the bytes of f16);
  // WKV_META_ROWS=16 (an A/B) keeps them in f16 for the backend's life.
  uint32_t meta_row_bits_ = 8;
  int least_priority_ = 0, greatest_priority_ = 0;
  // The estimate's stream (cap_side_, a plan's bind_side): side_levels_
  // priorities below the device's highest, at most its least (1 unless
  // WKV_DECODE_SIDE_LEVELS says otherwise: a diagnostic, so that an A/B can
  // price what the estimate's priority over the gather costs a step; a
  // large value gives the caller's default priority).
  int side_levels_ = 1;
  int side_priority() const {
    // Numerically lower is higher: greatest_priority_ <= least_priority_.
    return std::min(least_priority_, greatest_priority_ + side_levels_);
  }
  std::vector<cudaStream_t> cap_priority_;  // [least - priority]
  cudaStream_t cap_side_ = nullptr;
  cudaEvent_t fork_ev_ = nullptr, join_ev_ = nullptr;
  // The plans' staging rings (PlanDevice::stage_host): pinned blocks, never
  // freed before close (that would synchronize the device); a plan's old
  // ring comes back here once the steps that may read it have ended.
  struct StageBlock {
    uint8_t *host = nullptr, *dev = nullptr;
    size_t bytes = 0;
  };
  std::mutex stage_mu_;
  std::vector<StageBlock> stage_free_;
  // The smallest free block of `bytes` or more, else a new one; and a
  // block given back (no step may read it any more).
  Status take_stage_block(size_t bytes, StageBlock *out);
  void give_stage_block(const StageBlock &blk);

  // The k-means of growths: on a stream of their own (grow_), one batch
  // after another, sharing one workspace; each batch has its outputs
  // (CudaClusterBatch), reused once the batch has ended and its last
  // reader has run.
  std::mutex km_mu_;  // grow_, km_ws_, batches_
  cudaStream_t grow_ = nullptr;
  Region km_ws_;
  std::vector<std::unique_ptr<CudaClusterBatch>> batches_;
};

// 1. Set-up --------------------------------------------------------------------

Status CudaBackend::init(HostArena::Options *ao) {
  const Config &cfg = e_.config();
  dev_ = cfg.c.device_id;
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || dev_ < 0 || dev_ >= n) {
    (void)cudaGetLastError();
    return WKV_ERROR(WKV_ERR_NO_DEVICE, "no usable CUDA device %d (%d found%s%s)", dev_, err == cudaSuccess ? n : 0,
                     err == cudaSuccess ? "" : ": ", err == cudaSuccess ? "" : cudaGetErrorString(err));
  }
  DeviceGuard guard(dev_);
  if (!guard.ok()) return WKV_ERROR(WKV_ERR_NO_DEVICE, "CUDA device %d cannot be made current", dev_);
  char bus[32] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, dev_) == cudaSuccess) {
    for (char &c : bus) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (!(cfg.c.flags & WKV_CONFIG_NO_NUMA)) ao->numa_node = numa_node_of_pci(bus);
  } else {
    (void)cudaGetLastError();
  }
  // Pages are pinned and mapped so that the gather reads them over PCIe.
  // Where the device can read pageable memory (HMM), a chunk that cannot be
  // pinned stays pageable instead (slower, counted in the stats); elsewhere
  // the allocation that needed it fails. WKV_CONFIG_NO_PINNED asks for
  // pageable memory throughout.
  int pageable = 0;
  if (cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, dev_) != cudaSuccess) {
    (void)cudaGetLastError();
    pageable = 0;
  }
  if ((cfg.c.flags & WKV_CONFIG_NO_PINNED) && !pageable)
    return WKV_ERROR(WKV_ERR_UNSUPPORTED,
                     "WKV_CONFIG_NO_PINNED: CUDA device %d cannot read pageable host memory (no HMM)", dev_);
  if (!(cfg.c.flags & WKV_CONFIG_NO_PINNED)) {
    const int dev = dev_;
    FaultInjector *faults = &e_.faults();
    std::atomic<uint64_t> *fallbacks = &e_.counters().pin_fallbacks;
    ao->on_register = [dev, faults, fallbacks, pageable](void *base, size_t bytes) -> Status {
      DeviceGuard g(dev);
      cudaError_t err = faults->fail(FaultInjector::kPinning) ? cudaErrorMemoryAllocation : pin_in_pieces(base, bytes);
      if (err == cudaSuccess) return Status::ok();
      (void)cudaGetLastError();
      if (pageable) {
        fallbacks->fetch_add(1);
        return Status::ok();
      }
      return cuda_error(err, "cudaHostRegister", __FILE__, __LINE__);
    };
    ao->ahead = true;  // pinned ahead of need, off the decoding path
    ao->on_unregister = [dev](void *base, size_t bytes) {
      DeviceGuard g(dev);
      unpin_pieces(base, bytes);
    };
  }
  {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev_;
    WKV_CU(cudaMemPoolCreate(&mempool_, &props));
    uint64_t keep = UINT64_MAX;
    WKV_CU(cudaMemPoolSetAttribute(mempool_, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  if (cfg.c.flags & WKV_CONFIG_HOST_META_ROWS) WKV_RETURN_IF_ERROR(open_host_rows_pool(ao->numa_node));
  // The buffer manager's streams at the device's highest priority: their
  // small kernels (clearing evicted entries, publishing free frames) are
  // scheduled as soon as a multiprocessor frees, not after the CTAs that
  // decoding steps have queued. Waiting behind a step's gather, an eviction
  // took about 0.5 ms (1.4 ms at p90) at batch 7, and its frames reached
  // the pool that much later.
  WKV_CU(cudaDeviceGetStreamPriorityRange(&least_priority_, &greatest_priority_));
  WKV_CU(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, greatest_priority_));
  WKV_CU(cudaStreamCreateWithFlags(&free_, cudaStreamNonBlocking));
  WKV_CU(cudaStreamCreateWithFlags(&io_, cudaStreamNonBlocking));
  WKV_CU(cudaStreamCreateWithPriority(&pool_stream_, cudaStreamNonBlocking, greatest_priority_));
  WKV_CU(cudaMalloc(&d_stats_, kStatsBytes));
  WKV_CU(cudaMemsetAsync(d_stats_, 0, kStatsBytes, side_));
  WKV_CU(cudaStreamSynchronize(side_));
  WKV_CU(cudaStreamCreateWithFlags(&grow_, cudaStreamNonBlocking));
  WKV_CU(cudaStreamCreateWithPriority(&cap_, cudaStreamNonBlocking, least_priority_));
  if (const char *g = std::getenv("WKV_DECODE_GRAPHS")) graphs_ = std::strcmp(g, "0") != 0;
  if (const char *r = std::getenv("WKV_DECODE_RING")) rings_ = std::strcmp(r, "0") != 0;
  if (const char *f = std::getenv("WKV_DECODE_FORK")) fork_ = std::strcmp(f, "0") != 0;
  if (const char *f = std::getenv("WKV_DECODE_FROM_FRAMES")) from_frames_ = std::strcmp(f, "1") == 0;
  // The diagnostic would send every step's estimate to the f32 value sums,
  // over PCIe where they are in host memory: the flag wins.
  if (const char *v = std::getenv("WKV_VALUE_SUM16")) value_sum16_ = std::strcmp(v, "0") != 0 || host_rows_pool_;
  if (const char *v = std::getenv("WKV_META_ROWS")) meta_row_bits_ = std::strcmp(v, "16") == 0 ? 16 : 8;
  if (const char *l = std::getenv("WKV_DECODE_SIDE_LEVELS")) side_levels_ = std::max(0, std::atoi(l));
  WKV_CU(cudaStreamCreateWithPriority(&cap_side_, cudaStreamNonBlocking, side_priority()));
  WKV_CU(cudaEventCreateWithFlags(&fork_ev_, cudaEventDisableTiming));
  WKV_CU(cudaEventCreateWithFlags(&join_ev_, cudaEventDisableTiming));

  // The shared block cache: device_cache_bytes, or 5% of the device's memory
  // while the KV held is unknown at open time (the DESIGN's 5% of KV held).
  frame_bytes_ = cfg.page_slot_bytes();
  size_t want = cfg.c.device_cache_bytes;
  if (want == 0) {
    size_t free_b = 0, total_b = 0;
    WKV_CU(cudaMemGetInfo(&free_b, &total_b));
    want = total_b / 20;
  }
  frames_ = static_cast<uint32_t>(std::min<size_t>(want / frame_bytes_, 1u << 30));
  if (frames_ > 0) WKV_CU(cudaMalloc(&cache_, static_cast<size_t>(frames_) * frame_bytes_));
  return Status::ok();
}

CudaBackend::~CudaBackend() {
  // The engine's buffer manager is gone: no step is in flight and nothing
  // else uses the device memory below. Close may synchronize.
  DeviceGuard guard(dev_);
  auto close_stream = [](cudaStream_t s) {
    if (!s) return;
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  };
  for (cudaStream_t s : {side_, free_, io_, pool_stream_, grow_, cap_, cap_side_}) close_stream(s);
  for (cudaStream_t s : cap_priority_) close_stream(s);
  for (cudaEvent_t ev : {fork_ev_, join_ev_})
    if (ev) cudaEventDestroy(ev);
  if (km_ws_.p) cudaFree(km_ws_.p);
  for (auto &b : batches_) {
    for (Region *r : {&b->n, &b->begin, &b->order, &b->size, &b->cent, &b->vsum, &b->spread, &b->vtot})
      if (r->p) cudaFree(r->p);
    for (cudaEvent_t ev : {b->input, b->t0, b->t1, b->done})
      if (ev) cudaEventDestroy(ev);
  }
  if (cache_) cudaFree(cache_);
  // Released once its last allocation is freed, if any is still out.
  if (mempool_) cudaMemPoolDestroy(mempool_);
  if (host_rows_pool_) cudaMemPoolDestroy(host_rows_pool_);
  if (d_stats_) cudaFree(d_stats_);
  for (void *p : d_blocks_) cudaFree(p);
  (void)cudaGetLastError();
}

Status CudaBackend::check_stream(void *stream, const char *verb) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(s, &cap);
  if (err == cudaErrorStreamCaptureImplicit || (err == cudaSuccess && cap != cudaStreamCaptureStatusNone)) {
    if (err != cudaSuccess) (void)cudaGetLastError();
    // A captured step would replay its run table and its epochs as they
    // were at capture, ignoring later appends and growths.
    return WKV_ERROR(WKV_ERR_UNSUPPORTED,
                     "%s: the stream is being captured into a CUDA graph; only a bound plan's steps are "
                     "captured (wkv_plan_bind: otherwise a replay would not see later appends and growths)",
                     verb);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s: the stream is not one CUDA knows (%s)", verb,
                     cudaGetErrorString(err));
  }
  // The default streams are the current device's, which every verb makes
  // the engine's before it enqueues.
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return Status::ok();
  int dev = -1;
  err = cudaStreamGetDevice(s, &dev);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s: the stream is not one CUDA knows (%s)", verb,
                     cudaGetErrorString(err));
  }
  if (dev != dev_)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s: the stream belongs to CUDA device %d, the engine to device %d",
                     verb, dev, dev_);
  return Status::ok();
}

Status CudaBackend::check_pointer(const void *p, const char *what, size_t align, const void **device) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s (%p) is not aligned to its %zu-byte elements", what, p, align);
  DeviceGuard guard(dev_);  // a mapped block's device pointer is the engine device's
  cudaPointerAttributes a;
  const cudaError_t err = cudaPointerGetAttributes(&a, p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s is not a pointer CUDA knows", what);
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) {
    if (a.device != dev_)
      return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s is on CUDA device %d, the engine on device %d", what, a.device,
                       dev_);
    if (device) *device = p;
    return Status::ok();
  }
  if (a.type == cudaMemoryTypeHost && a.devicePointer) {  // mapped host memory
    // The device pointer of the byte p names (p may be inside the block).
    if (device) *device = a.devicePointer;
    return Status::ok();
  }
  return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s is a host pointer; a CUDA engine needs device (or mapped) memory",
                   what);
}

// 2. Engine memory ------------------------------------------------------------------

Status CudaBackend::open_host_rows_pool(int numa_node) {
  const Config &cfg = e_.config();
  if (cfg.dtype() == DType::kF32)
    return WKV_ERROR(WKV_ERR_UNSUPPORTED,
                     "WKV_CONFIG_HOST_META_ROWS with WKV_DTYPE_F32: an f32 engine's steps read the f32 meta rows "
                     "themselves (it keeps no 8-bit copies), which would then cross PCIe at every step");
  if (cfg.centered_keys())
    return WKV_ERROR(WKV_ERR_UNSUPPORTED,
                     "WKV_CONFIG_HOST_META_ROWS with WKV_PAGE_FORMAT_INT8_CENTERED: the gather adds each retrieved "
                     "cluster's f32 centroid back to its keys, which would then cross PCIe at every step");
#if CUDART_VERSION >= 12060
  auto attr = [this](cudaDeviceAttr a) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, a, dev_) != cudaSuccess) {
      (void)cudaGetLastError();
      v = 0;
    }
    return v;
  };
  // A pool on the GPU's NUMA node where the driver makes one there, else
  // on the host wherever it places it. A pool that cannot be made, or made
  // usable by the device, is the flag unsupported here, and nothing of it
  // is kept.
  std::string why = "no host memory pools";
  for (const bool numa : {true, false}) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    if (numa) {
      if (numa_node < 0 || !attr(cudaDevAttrHostNumaMemoryPoolsSupported)) continue;
      props.location.type = cudaMemLocationTypeHostNuma;
      props.location.id = numa_node;
    } else {
      if (!attr(cudaDevAttrHostMemoryPoolsSupported)) continue;
      props.location.type = cudaMemLocationTypeHost;
    }
    cudaMemPool_t pool = nullptr;
    cudaMemAccessDesc access = {};
    access.location.type = cudaMemLocationTypeDevice;
    access.location.id = dev_;
    access.flags = cudaMemAccessFlagsProtReadWrite;
    uint64_t keep = UINT64_MAX;
    cudaError_t err = cudaMemPoolCreate(&pool, &props);
    if (err == cudaSuccess) err = cudaMemPoolSetAccess(pool, &access, 1);
    if (err == cudaSuccess) err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    if (err == cudaSuccess) {
      host_rows_pool_ = pool;
      return Status::ok();
    }
    (void)cudaGetLastError();
    if (pool) (void)cudaMemPoolDestroy(pool);
    why = std::string(numa ? "a host pool on NUMA node " + std::to_string(numa_node) : std::string("a host pool")) +
          ": " + cudaGetErrorString(err);
  }
  return WKV_ERROR(WKV_ERR_UNSUPPORTED, "WKV_CONFIG_HOST_META_ROWS: CUDA device %d: %s", dev_, why.c_str());
#else
  (void)numa_node;
  return WKV_ERROR(WKV_ERR_UNSUPPORTED,
                   "WKV_CONFIG_HOST_META_ROWS: this libwavekv was built with a CUDA runtime before 12.6, which has "
                   "no host memory pools");
#endif
}

Status CudaBackend::mem_alloc(size_t bytes, void *stream, Region *out, MemUse use) {
  DeviceGuard guard(dev_);
  const size_t n = (std::max<size_t>(bytes, 1) + 255) & ~size_t{255};
  const bool host = mem_mapped_host(use);
  if (e_.faults().fail(FaultInjector::kEngineAlloc))
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of %s memory for %zu bytes (injected)",
                     host ? "pinned host" : "device", n);
  void *p = nullptr;
  WKV_CU(cudaMallocFromPoolAsync(&p, n, host ? host_rows_pool_ : mempool_, static_cast<cudaStream_t>(stream)));
  out->p = static_cast<uint8_t *>(p);
  out->bytes = n;
  return Status::ok();
}

void CudaBackend::mem_free(Region *r, void *stream) {
  if (r->p) {
    DeviceGuard guard(dev_);
    if (cudaFreeAsync(r->p, static_cast<cudaStream_t>(stream)) != cudaSuccess) (void)cudaGetLastError();
  }
  *r = Region{};
}

void CudaBackend::mem_free_deferred(Region *r) {
  if (!r->p) return;
  void *p = r->p;
  *r = Region{};
  try {
    // Freed in stream order on free_ once no step can read it: no
    // device synchronization, whichever thread runs the release.
    e_.buffers().defer([this, p] {
      DeviceGuard guard(dev_);
      std::lock_guard<std::mutex> lock(free_mu_);
      if (cudaFreeAsync(p, free_) != cudaSuccess) (void)cudaGetLastError();
    });
  } catch (...) {
    // Out of memory for the release itself: kept rather than freed under a
    // reader.
  }
}

void CudaBackend::mem_free_after(Region *r, void *stream) {
  if (!r->p) return;
  DeviceGuard guard(dev_);
  void *p = r->p;
  *r = Region{};
  // An event marks the stream's work so far; the side stream waits on it
  // before the free. Without it, a free on the idle side stream completes at
  // once and the pool hands the memory out again while `stream` still reads
  // it.
  cudaEvent_t ev = nullptr;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventRecord(ev, static_cast<cudaStream_t>(stream)) != cudaSuccess) {
    (void)cudaGetLastError();
    if (ev) (void)cudaEventDestroy(ev);
    ev = nullptr;
    // Without an event: wait here for the stream's work instead (rare).
    if (cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) != cudaSuccess) (void)cudaGetLastError();
  }
  try {
    e_.buffers().defer([this, p, ev] {
      DeviceGuard guard(dev_);
      std::lock_guard<std::mutex> lock(free_mu_);
      if (ev && cudaStreamWaitEvent(free_, ev, 0) != cudaSuccess) (void)cudaGetLastError();
      if (cudaFreeAsync(p, free_) != cudaSuccess) (void)cudaGetLastError();
      if (ev) (void)cudaEventDestroy(ev);
    });
  } catch (...) {
    // Out of memory for the release itself: kept rather than freed under a
    // reader.
    if (ev) (void)cudaEventDestroy(ev);
  }
}

Status CudaBackend::mem_copy(void *dst, const void *src, size_t bytes, void *stream) {
  if (bytes == 0) return Status::ok();
  DeviceGuard guard(dev_);
  WKV_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status CudaBackend::mem_copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                                  size_t rows, void *stream) {
  if (rows == 0) return Status::ok();
  DeviceGuard guard(dev_);
  WKV_CU(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault,
                           static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status CudaBackend::mem_fill(void *dst, uint8_t byte, size_t bytes, void *stream) {
  DeviceGuard guard(dev_);
  WKV_CU(cudaMemsetAsync(dst, byte, bytes, static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status CudaBackend::mem_store64(void *dst, uint64_t value, void *stream) {
  DeviceGuard guard(dev_);
  const uint64_t addr = reinterpret_cast<uintptr_t>(dst);
  const cudaError_t err = kernels::store_pairs(&addr, &value, 1, static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? Status::ok() : kernel_status(err, "store_pairs");
}

Status CudaBackend::narrow_f16(const float *src, size_t n, void *dst, uint32_t *overflow, void *stream) {
  DeviceGuard guard(dev_);
  WKV_CU(kernels::narrow_f16(src, n, dst, overflow, stream));
  return Status::ok();
}

Status CudaBackend::quantize_rows8(const float *src, size_t rows, uint32_t d, int8_t *dst, float *scales,
                                   uint32_t *overflow, void *stream) {
  DeviceGuard guard(dev_);
  WKV_CU(kernels::quantize_rows8(src, rows, d, dst, scales, overflow, stream));
  return Status::ok();
}

// write_spans and write_pages convert their jobs into the kernels' form in
// batches on the stack (no host allocation that could fail halfway), check
// every batch before launching any, then convert again and launch:
// convert(job, &k) -> Status, check(batch, m) and launch(batch, m) ->
// cudaError_t.
constexpr uint32_t kJobBatch = 96;

template <typename K, uint32_t kBatch = kJobBatch, typename J, typename Convert, typename Check, typename Launch>
Status checked_launches(const J *jobs, uint32_t n, Convert convert, Check check, Launch launch) {
  K batch[kBatch];
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t at = 0; at < n; at += kBatch) {
      const uint32_t m = std::min(n - at, kBatch);
      for (uint32_t i = 0; i < m; ++i) WKV_RETURN_IF_ERROR(convert(jobs[at + i], &batch[i]));
      WKV_KERNEL(pass ? launch(batch, m) : check(batch, m));
    }
  }
  return Status::ok();
}

Status CudaBackend::write_spans(const SpanWrite *spans, uint32_t n, void *stream) {
  if (n == 0) return Status::ok();
  DeviceGuard guard(dev_);
  return checked_launches<kernels::SpanDesc, kernels::kSpansPerLaunch>(
      spans, n,
      [](const SpanWrite &w, kernels::SpanDesc *k) {
        if (w.n > UINT32_MAX) return WKV_ERROR(WKV_ERR_INTERNAL, "a span of %zu elements", w.n);
        *k = kernels::SpanDesc{static_cast<uint8_t *>(w.dst),
                               static_cast<const uint8_t *>(w.src),
                               w.narrow_overflow,
                               static_cast<uint32_t>(w.n),
                               w.quant_row         ? kernels::kSpanQuantRows8
                               : w.narrow_overflow ? kernels::kSpanNarrowF16
                                                   : kernels::kSpanCopy,
                               w.quant_scales,
                               w.quant_row};
        return Status::ok();
      },
      [](const kernels::SpanDesc *b, uint32_t m) { return kernels::check_spans(b, m); },
      [stream](const kernels::SpanDesc *b, uint32_t m) {
        return kernels::apply_spans(b, m, static_cast<cudaStream_t>(stream));
      });
}

Status CudaBackend::copy_rows(const RowCopy *copies, uint32_t n, const uint8_t *k, const uint8_t *v,
                              size_t src_pitch, size_t width, void *stream) {
  if (n == 0) return Status::ok();
  DeviceGuard guard(dev_);
  std::vector<kernels::RowCopyDesc> desc;
  try {
    desc.resize(n);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for %u row copies", n);
  }
  for (uint32_t i = 0; i < n; ++i)
    desc[i] = kernels::RowCopyDesc{copies[i].dst_k, copies[i].dst_v, copies[i].src_off, copies[i].rows, 0};
  WKV_KERNEL(kernels::copy_rows(desc.data(), n, k, v, src_pitch, static_cast<uint32_t>(width),
                                static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status CudaBackend::copy_rows_then_end(const RowCopy *copies, uint32_t n, const uint8_t *k, const uint8_t *v,
                                       size_t src_pitch, size_t width, StepTracker *const *trackers,
                                       const uint64_t *epochs, uint32_t n_ends, void *stream, bool *ended) {
  *ended = false;
  // One launch for both where the append is small (kernels::copy_rows_marked).
  constexpr uint32_t kMaxCopies = 96, kMaxEnds = 48;
  if (n == 0 || n > kMaxCopies || n_ends > kMaxEnds) return copy_rows(copies, n, k, v, src_pitch, width, stream);
  DeviceGuard guard(dev_);
  kernels::RowCopyDesc desc[kMaxCopies];
  unsigned long long *done[kMaxEnds];
  unsigned long long ep[kMaxEnds];
  for (uint32_t i = 0; i < n; ++i)
    desc[i] = kernels::RowCopyDesc{copies[i].dst_k, copies[i].dst_v, copies[i].src_off, copies[i].rows, 0};
  for (uint32_t i = 0; i < n_ends; ++i) {
    done[i] = reinterpret_cast<unsigned long long *>(trackers[i]->done_device());
    ep[i] = epochs[i];
  }
  const cudaError_t err = kernels::copy_rows_marked(desc, n, k, v, src_pitch, static_cast<uint32_t>(width), done, ep,
                                                    n_ends, static_cast<cudaStream_t>(stream));
  if (err == cudaErrorNotSupported) return copy_rows(copies, n, k, v, src_pitch, width, stream);  // too many rows
  if (err != cudaSuccess) return kernel_status(err, "copy_rows_marked");
  *ended = true;
  return Status::ok();
}

Status CudaBackend::mem_sync(void *stream) {
  DeviceGuard guard(dev_);
  WKV_CU(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

Status CudaBackend::end_work(StepTracker &t, uint64_t epoch, void *stream) {
  DeviceGuard guard(dev_);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = kernels::mark_step_end(reinterpret_cast<unsigned long long *>(t.done_device()), epoch, s);
  return finish(t, epoch, err == cudaSuccess ? Status::ok() : kernel_status(err, "mark_step_end"), s);
}

Status CudaBackend::end_work_many(StepTracker *const *trackers, const uint64_t *epochs, uint32_t n, void *stream) {
  if (n == 1) return end_work(*trackers[0], epochs[0], stream);
  DeviceGuard guard(dev_);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  std::vector<unsigned long long *> done;
  std::vector<unsigned long long> ep;
  cudaError_t err = cudaSuccess;
  try {
    done.resize(n);
    ep.assign(epochs, epochs + n);
  } catch (const std::bad_alloc &) {
    err = cudaErrorMemoryAllocation;
  }
  if (err == cudaSuccess) {
    for (uint32_t i = 0; i < n; ++i) done[i] = reinterpret_cast<unsigned long long *>(trackers[i]->done_device());
    err = kernels::mark_steps_end(done.data(), ep.data(), n, s);
  }
  if (err == cudaSuccess) return Status::ok();
  // As finish(): the work is waited for here and the steps ended on the host.
  Status st = kernel_status(err, "mark_steps_end");
  if (cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
  for (uint32_t i = 0; i < n; ++i) e_.buffers().end_on_host(*trackers[i], epochs[i]);
  return st;
}

Status CudaBackend::finish(StepTracker &t, uint64_t epoch, Status st, cudaStream_t s) {
  if (st.is_ok()) return st;
  if (cudaStreamSynchronize(s) != cudaSuccess) (void)cudaGetLastError();
  e_.buffers().end_on_host(t, epoch);
  return st;
}

void CudaBackend::on_head_created(HeadState &head) {
  if (frames_ == 0) return;
  head.mirror.cache_id = e_.buffers().head_created(&head.mirror.cache_gen);
}

void CudaBackend::on_head_destroyed(HeadState &head) {
  if (head.mirror.cache_id) e_.buffers().head_destroyed(head.mirror.cache_id);
  head.mirror.cache_id = 0;
}

Status CudaBackend::alloc_words(size_t n, uint64_t **host, uint64_t **dev) {
  DeviceGuard guard(dev_);
  void *h = nullptr, *d = nullptr;
  WKV_RETURN_IF_ERROR(pinned_.alloc(n * sizeof(uint64_t), &h, &d));
  *host = static_cast<uint64_t *>(h);
  *dev = static_cast<uint64_t *>(d);
  return Status::ok();
}

Status CudaBackend::alloc_ring(size_t bytes, uint8_t **host, uint8_t **dev) {
  DeviceGuard guard(dev_);
  void *h = nullptr, *d = nullptr;
  WKV_RETURN_IF_ERROR(pinned_.alloc(bytes, &h, &d));
  *host = static_cast<uint8_t *>(h);
  *dev = static_cast<uint8_t *>(d);
  return Status::ok();
}

Status CudaBackend::alloc_device(size_t bytes, void **dev) {
  DeviceGuard guard(dev_);
  try {
    d_blocks_.reserve(d_blocks_.size() + 1);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for the buffer manager's device blocks");
  }
  void *d = nullptr;
  WKV_CU(cudaMalloc(&d, bytes));
  // Zeroed on the pool's stream, and waited for (the engine is opening):
  // the pool's slots and counts are written there (publish_frames) and
  // read by steps on any stream. Not cudaMemset: that zeroes on the legacy
  // default stream, which the engine's non-blocking streams do not wait
  // for. A publish could overtake the zeroing (a copy engine's copy runs
  // while other processes' kernels hold the multiprocessors), leaving
  // every slot naming frame 0: every unit admitted mapped to one frame,
  // and the steps after it reading that frame's rows for all of them.
  cudaError_t err = cudaMemsetAsync(d, 0, bytes, pool_stream_);
  if (err == cudaSuccess) err = cudaStreamSynchronize(pool_stream_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFree(d);
    return WKV_ERROR(WKV_ERR_DEVICE, "zeroing the buffer manager's device memory failed: %s",
                     cudaGetErrorString(err));
  }
  d_blocks_.push_back(d);
  d_block_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  *dev = d;
  return Status::ok();
}

Status CudaBackend::publish_frames(const uint32_t *host_slots, const uint32_t *host_slots_dev, uint32_t *dev_slots,
                                   uint64_t first, uint64_t n, uint32_t cap, uint64_t *avail) {
  DeviceGuard guard(dev_);
  // One launch that reads the host copy where it is (mapped memory) and
  // counts the frames after: the decoding path publishes too (open_record).
  // Its one CTA reads over PCIe; a large publish (the pool's first, a
  // burst of evictions) takes the copy below.
  if (n <= 4096) {
    WKV_KERNEL(kernels::publish_slots(host_slots_dev, dev_slots, first, n, cap,
                                      reinterpret_cast<unsigned long long *>(avail), pool_stream_));
    return Status::ok();
  }
  // One copy, or two where the range wraps; then the count, in stream
  // order.
  for (uint64_t done = 0; done < n;) {
    const uint64_t at = (first + done) % cap, len = std::min<uint64_t>(n - done, cap - at);
    WKV_CU(cudaMemcpyAsync(dev_slots + at, host_slots + at, len * sizeof(uint32_t), cudaMemcpyHostToDevice,
                           pool_stream_));
    done += len;
  }
  WKV_KERNEL(kernels::add_to_word(reinterpret_cast<unsigned long long *>(avail), n, pool_stream_));
  return Status::ok();
}

Status CudaBackend::clear_entries(const uint64_t *entries, uint32_t n) {
  DeviceGuard guard(dev_);
  std::lock_guard<std::mutex> lock(side_mu_);
  // The addresses go through a mapped buffer, in one launch: by value, a
  // batch of evictions took a launch every 480 entries (nine at batch 7),
  // a quarter of the manager's time. The buffer grows by doubling (old
  // ones stay with pinned_ until close); where it cannot, by value, and a
  // failed growth is tried again only 1024 calls later (pinning is slow).
  if (n > clear_cap_ && (clear_retry_ == 0 || --clear_retry_ == 0)) {
    const uint32_t cap = static_cast<uint32_t>(std::min<uint64_t>(UINT32_MAX, std::max<uint64_t>(n, 2ull * clear_cap_)));
    void *host = nullptr, *dev = nullptr;
    if (pinned_.alloc(size_t{cap} * sizeof(uint64_t), &host, &dev).is_ok()) {
      clear_host_ = static_cast<uint64_t *>(host);
      clear_dev_ = static_cast<const uint64_t *>(dev);
      clear_cap_ = cap;
    } else {
      clear_retry_ = 1024;
    }
  }
  cudaError_t err;
  if (n <= clear_cap_) {
    // Every earlier call's kernel has ended (each waits below, whatever
    // its launch returned): the buffer is free.
    std::memcpy(clear_host_, entries, size_t{n} * sizeof(uint64_t));
    err = kernels::store_words_at(clear_dev_, n, kNoFrame, side_);
  } else {
    err = kernels::store_words(entries, n, kNoFrame, side_);
  }
  // Waited for even when the launch reported an error (it may be an
  // earlier call's): nothing of this call stays queued.
  const cudaError_t synced = cudaStreamSynchronize(side_);
  if (err != cudaSuccess) return kernel_status(err, "store_words_at (clearing unit map entries)");
  WKV_CU(synced);
  return Status::ok();
}

// 3. Index growth -------------------------------------------------------------------

Status CudaBackend::km_region(Region *r, size_t bytes, cudaStream_t s) {
  if (bytes <= r->bytes) return Status::ok();
  const size_t n = (std::max(bytes, r->bytes + r->bytes / 2) + 255) & ~size_t{255};
  void *p = nullptr;
  WKV_CU(cudaMallocFromPoolAsync(&p, n, mempool_, s));
  if (r->p) cudaFreeAsync(r->p, s);  // grow_ ran every read of it before (see cluster_begin)
  r->p = static_cast<uint8_t *>(p);
  r->bytes = n;
  return Status::ok();
}

Status CudaBackend::cluster_begin(const ClusterJob *jobs, uint32_t S, size_t scratch, void *stream,
                                  ClusterBatch **out) {
  DeviceGuard guard(dev_);
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  std::lock_guard<std::mutex> lock(km_mu_);
  // 1. A batch whose last reader has run (its outputs are rewritten on
  //    grow_, after everything enqueued there before), or a new one.
  CudaClusterBatch *kb = nullptr;
  for (auto &b : batches_) {
    if (b->in_use) continue;
    const cudaError_t q = b->ended_once ? cudaEventQuery(b->done) : cudaSuccess;
    if (q == cudaSuccess) {
      kb = b.get();
      break;
    }
    if (q != cudaErrorNotReady) (void)cudaGetLastError();
  }
  if (!kb) {
    try {
      batches_.reserve(batches_.size() + 1);
      auto fresh = std::make_unique<CudaClusterBatch>();
      WKV_CU(cudaEventCreateWithFlags(&fresh->input, cudaEventDisableTiming));
      WKV_CU(cudaEventCreate(&fresh->t0));
      WKV_CU(cudaEventCreate(&fresh->t1));
      WKV_CU(cudaEventCreateWithFlags(&fresh->done, cudaEventDisableTiming));
      batches_.push_back(std::move(fresh));  // reserved: no throw
    } catch (const std::bad_alloc &) {
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for a k-means batch");
    }
    kb = batches_.back().get();
  }
  kernels::KMeansBatchParams kp;
  kp.dtype = cfg.dtype();
  kp.head_dim = d;
  kp.iters = cfg.c.kmeans_iters;
  const kernels::KMeansBatchShape shape = kernels::kmeans_batch_shape(jobs, S);
  try {
    kb->tok_off.resize(S);
    kb->clu_off.resize(S);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for a k-means batch");
  }
  kernels::kmeans_batch_offsets(jobs, S, kb->tok_off.data(), kb->clu_off.data());
  uint64_t sum_k = 0;
  for (uint32_t i = 0; i < S; ++i) sum_k += kernels::kmeans_out_clusters(jobs[i]);
  kb->S = S;

  // 2. The pinned block: the readback (n_clusters and n_outliers, begins,
  //    sizes, then the value totals 8-byte aligned), then the scratch.
  //    Grow only, kept for the engine's life (freeing pinned memory would
  //    synchronize the device).
  kb->begin_at = size_t(2) * S * 4;
  kb->size_at = kb->begin_at + (sum_k + S) * 4;
  kb->totals_at = (kb->size_at + sum_k * 4 + 7) & ~size_t{7};
  kb->scratch_at = (kb->totals_at + size_t(S) * d * 8 + 255) & ~size_t{255};
  const size_t bytes = kb->scratch_at + scratch;
  if (bytes > kb->host_bytes) {
    const size_t n = std::max(bytes, kb->host_bytes * 2);
    void *h = nullptr, *dv = nullptr;
    WKV_RETURN_IF_ERROR(pinned_.alloc(n, &h, &dv));
    kb->host = static_cast<uint32_t *>(h);
    kb->host_bytes = n;
  }

  // 3. grow_ waits for the rows on the device, then clusters and reads back.
  WKV_CU(cudaEventRecord(kb->input, s));
  WKV_CU(cudaStreamWaitEvent(grow_, kb->input, 0));
  size_t ws_bytes = 0;
  WKV_KERNEL(kernels::kmeans_batch_workspace_size(kp, shape, &ws_bytes));
  WKV_RETURN_IF_ERROR(km_region(&km_ws_, ws_bytes, grow_));
  WKV_RETURN_IF_ERROR(km_region(&kb->n, 2 * S * sizeof(uint32_t), grow_));  // n_clusters, then n_outliers
  WKV_RETURN_IF_ERROR(km_region(&kb->begin, (sum_k + S) * sizeof(uint32_t), grow_));
  WKV_RETURN_IF_ERROR(km_region(&kb->order, shape.total_tokens * sizeof(uint32_t), grow_));
  WKV_RETURN_IF_ERROR(km_region(&kb->size, sum_k * sizeof(uint32_t), grow_));
  WKV_RETURN_IF_ERROR(km_region(&kb->cent, sum_k * d * sizeof(float), grow_));
  WKV_RETURN_IF_ERROR(km_region(&kb->vsum, sum_k * d * sizeof(float), grow_));
  WKV_RETURN_IF_ERROR(km_region(&kb->spread, sum_k * sizeof(float), grow_));
  WKV_RETURN_IF_ERROR(km_region(&kb->vtot, size_t(S) * d * sizeof(double), grow_));
  kernels::KMeansBatchOut ko;
  ko.n_clusters = kb->n.as<uint32_t>();
  ko.n_outliers = kb->n.as<uint32_t>() + S;
  ko.spread = kb->spread.as<float>();
  ko.value_total = kb->vtot.as<double>();
  ko.begin = kb->begin.as<uint32_t>();
  ko.order = kb->order.as<uint32_t>();
  ko.centroid = kb->cent.as<float>();
  ko.value_sum = kb->vsum.as<float>();
  ko.size = kb->size.as<uint32_t>();
  WKV_CU(cudaEventRecord(kb->t0, grow_));
  WKV_KERNEL(kernels::kmeans_batch_cuda(kp, jobs, S, ko, km_ws_.p, km_ws_.bytes, nullptr, grow_));
  uint8_t *const h = reinterpret_cast<uint8_t *>(kb->host);
  WKV_CU(cudaMemcpyAsync(h, ko.n_clusters, 2 * S * sizeof(uint32_t), cudaMemcpyDeviceToHost, grow_));
  WKV_CU(cudaMemcpyAsync(h + kb->begin_at, ko.begin, (sum_k + S) * sizeof(uint32_t), cudaMemcpyDeviceToHost,
                         grow_));
  WKV_CU(cudaMemcpyAsync(h + kb->size_at, ko.size, sum_k * sizeof(uint32_t), cudaMemcpyDeviceToHost, grow_));
  WKV_CU(cudaMemcpyAsync(h + kb->totals_at, ko.value_total, size_t(S) * d * sizeof(double), cudaMemcpyDeviceToHost,
                         grow_));
  WKV_CU(cudaEventRecord(kb->t1, grow_));
  kb->in_use = true;
  kb->timed = false;
  *out = kb;
  return Status::ok();
}

uint8_t *CudaBackend::cluster_scratch(ClusterBatch *b) {
  CudaClusterBatch &kb = static_cast<CudaClusterBatch &>(*b);
  return reinterpret_cast<uint8_t *>(kb.host) + kb.scratch_at;
}

bool CudaBackend::cluster_ready(ClusterBatch *b) {
  DeviceGuard guard(dev_);
  const cudaError_t q = cudaEventQuery(static_cast<CudaClusterBatch *>(b)->t1);
  if (q == cudaErrorNotReady) return false;
  if (q != cudaSuccess) (void)cudaGetLastError();  // cluster_take reports it
  return true;
}

Status CudaBackend::cluster_take(ClusterBatch *b, void *stream, ClusterOut *out) {
  DeviceGuard guard(dev_);
  CudaClusterBatch &kb = static_cast<CudaClusterBatch &>(*b);
  // The one wait of a prompt's growth; a generated segment's commits once
  // cluster_ready says so, and this waits for nothing.
  WKV_CU(cudaEventSynchronize(kb.t1));
  WKV_CU(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), kb.t1, 0));
  if (!kb.timed) {
    float km_ms = 0.f;
    if (cudaEventElapsedTime(&km_ms, kb.t0, kb.t1) == cudaSuccess)
      e_.counters().kmeans_ns.fetch_add(static_cast<uint64_t>(static_cast<double>(km_ms) * 1e6));
    else
      (void)cudaGetLastError();
    kb.timed = true;
  }
  const uint8_t *const h = reinterpret_cast<const uint8_t *>(kb.host);
  out->n_clusters = kb.host;
  out->n_outliers = kb.host + kb.S;
  out->begin = reinterpret_cast<const uint32_t *>(h + kb.begin_at);
  out->begin_engine = kb.begin.as<uint32_t>();
  out->size = reinterpret_cast<const uint32_t *>(h + kb.size_at);
  out->value_total = reinterpret_cast<const double *>(h + kb.totals_at);
  out->tok_off = kb.tok_off.data();
  out->clu_off = kb.clu_off.data();
  out->order = kb.order.as<uint32_t>();
  out->centroid = kb.cent.as<float>();
  out->value_sum = kb.vsum.as<float>();
  out->spread = kb.spread.as<float>();
  return Status::ok();
}

Status CudaBackend::cluster_after(ClusterBatch *b, void *stream) {
  DeviceGuard guard(dev_);
  WKV_CU(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<CudaClusterBatch *>(b)->t1, 0));
  return Status::ok();
}

void CudaBackend::cluster_end(ClusterBatch *b, void *stream) {
  DeviceGuard guard(dev_);
  CudaClusterBatch &kb = static_cast<CudaClusterBatch &>(*b);
  // What runs on `stream` from now on (a tail's region freed after it, say)
  // comes after the k-means, which read the tails; the batch is reused
  // once `done` has passed. Abandoned (no stream): the memory freed after
  // steps end goes on free_, which waits for the k-means first.
  cudaError_t err = cudaSuccess;
  if (stream) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    err = cudaStreamWaitEvent(s, kb.t1, 0);
    if (err == cudaSuccess) err = cudaEventRecord(kb.done, s);
  } else {
    std::lock_guard<std::mutex> free_lock(free_mu_);
    err = cudaStreamWaitEvent(free_, kb.t1, 0);
    if (err == cudaSuccess) err = cudaEventRecord(kb.done, grow_);
  }
  if (err != cudaSuccess) {
    // Without the events: wait here instead (rare).
    (void)cudaGetLastError();
    if (cudaEventSynchronize(kb.t1) != cudaSuccess) (void)cudaGetLastError();
    if (stream && cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) != cudaSuccess) (void)cudaGetLastError();
    if (cudaEventRecord(kb.done, grow_) != cudaSuccess) (void)cudaGetLastError();
  }
  std::lock_guard<std::mutex> lock(km_mu_);
  kb.in_use = false;
  kb.ended_once = true;
}

Status CudaBackend::write_pages(const PageWriteJob *jobs, uint32_t n, void *stream) {
  if (n == 0) return Status::ok();
  DeviceGuard guard(dev_);
  const Config &cfg = e_.config();
  const uint32_t row_bytes = cfg.page_row_bytes(), pt = cfg.page_tokens();
  kernels::Int8PageLayout int8;
  int8.dtype = cfg.dtype();
  int8.head_dim = cfg.c.head_dim;
  int8.page_tokens = pt;
  int8.scales_at = cfg.page_scales_at();
  int8.centered = cfg.centered_keys();
  return checked_launches<kernels::WritePagesJob>(
      jobs, n,
      [&](const PageWriteJob &j, kernels::WritePagesJob *k) {
        *k = kernels::WritePagesJob{};
        k->order = j.order;
        k->k = j.k;
        k->v = j.v;
        k->pages = j.dev_pages;
        k->tokens = j.tokens;
        if (cfg.centered_keys() && j.tokens > 0) {
          if (!j.begin_engine || !j.centroid || j.clusters == 0)
            return WKV_ERROR(WKV_ERR_INTERNAL, "a page write of centered keys without its clusters");
          k->clusters = j.clusters;
          k->begin = j.begin_engine;
          k->centroid = j.centroid;
        }
        return Status::ok();
      },
      [&](const kernels::WritePagesJob *b, uint32_t m) { return kernels::check_page_jobs(b, m, row_bytes, pt); },
      [&](const kernels::WritePagesJob *b, uint32_t m) {
        if (cfg.int8_pages())
          return kernels::write_pages_int8_many_cuda(b, m, int8, static_cast<cudaStream_t>(stream));
        return kernels::write_pages_many_cuda(b, m, row_bytes, pt, static_cast<cudaStream_t>(stream));
      });
}

// 4. The decoding step --------------------------------------------------------------

kernels::DevLookup lookup_view(const PlanDevice &pd) {
  kernels::DevLookup lk;
  lk.ret_ids = pd.ret_ids.as<uint32_t>();
  lk.ret_pos = pd.ret_pos.as<uint32_t>();
  lk.est_ids = pd.est_ids.as<uint32_t>();
  lk.run_tokens = pd.run_tokens.as<uint32_t>();
  lk.est_out = pd.est_out.as<float>();
  lk.est_lse = pd.est_lse.as<float>();
  lk.offsets = pd.offsets.as<int32_t>();
  lk.logits = pd.logits.as<float>();
  lk.zones = pd.zones.as<uint8_t>();
  lk.est_extra = pd.est_extra.p ? pd.est_extra.as<uint32_t>() : nullptr;  // engines with cold pages only
  return lk;
}

Status CudaBackend::point_pages(HeadState &hs, const uint32_t *pages, uint32_t n, void *stream) {
  if (n == 0 || !hs.mirror.pages.p) return Status::ok();
  std::vector<uint64_t> addr, value;
  try {
    addr.resize(n);
    value.resize(n);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for %u page table entries", n);
  }
  for (uint32_t i = 0; i < n; ++i) {
    addr[i] = reinterpret_cast<uint64_t>(hs.mirror.pages.p + size_t(pages[i]) * 8);
    value[i] = reinterpret_cast<uint64_t>(page_address(hs.map.pages[pages[i]]));
  }
  DeviceGuard guard(dev_);
  const cudaError_t err = kernels::store_pairs(addr.data(), value.data(), n, static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? Status::ok() : kernel_status(err, "page table");
}

Status CudaBackend::read_stamps(const HeadState &hs, uint32_t *dst, uint32_t n) {
  if (n == 0) return Status::ok();
  if (!hs.mirror.stamps.p || hs.mirror.stamps.bytes < size_t(n) * 4)
    return WKV_ERROR(WKV_ERR_STATE, "the head has no device stamps for %u clusters", n);
  DeviceGuard guard(dev_);
  std::lock_guard<std::mutex> lock(side_mu_);
  // On the side stream, which synchronizes with no other: the copy waits for
  // no step.
  cudaError_t err = cudaMemcpyAsync(dst, hs.mirror.stamps.p, size_t(n) * 4, cudaMemcpyDeviceToHost, side_);
  if (err == cudaSuccess) err = cudaStreamSynchronize(side_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return cuda_error(err, "reading recency stamps", __FILE__, __LINE__);
  }
  return Status::ok();
}

Status CudaBackend::plan_region(PlanDevice &pd, Region *r, size_t bytes, cudaStream_t s) {
  if (bytes <= r->bytes) return Status::ok();
  Region fresh;
  WKV_RETURN_IF_ERROR(mem_alloc(std::max(bytes, r->bytes + r->bytes / 2), s, &fresh));
  std::swap(*r, fresh);
  if (pd.ever_bound && fresh.p) {
    // A graph captured under a binding may still be replayed (and fault):
    // what it reads stays until the plan goes.
    try {
      pd.retired.push_back(fresh);
      return Status::ok();
    } catch (const std::bad_alloc &) {
      std::swap(*r, fresh);
      mem_free(&fresh, s);
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory growing a bound plan's buffer");
    }
  }
  mem_free_after(&fresh, s);
  return Status::ok();
}

// A plan's decode graphs (PlanDevice::graphs), the most recently used
// first: the one for `key`, moved to the front, or null.
PlanDevice::Graph *find_graph(PlanDevice &pd, const PlanDevice::GraphKey &key) {
  for (size_t i = 0; i < pd.graphs.size(); ++i) {
    if (!pd.graphs[i].exec || pd.graphs[i].key != key) continue;
    std::rotate(pd.graphs.begin(), pd.graphs.begin() + i, pd.graphs.begin() + i + 1);
    return &pd.graphs[0];
  }
  return nullptr;
}

// Destroys a graph; one in flight is freed once its launches end.
void drop_graph(PlanDevice::Graph *g) {
  if (g->exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g->exec));
  *g = PlanDevice::Graph{};
}

// Adds a graph at the front, dropping the least recently used if full.
PlanDevice::Graph *add_graph(PlanDevice &pd, const PlanDevice::GraphKey &key, cudaGraphExec_t exec) {
  drop_graph(&pd.graphs.back());
  std::rotate(pd.graphs.begin(), pd.graphs.end() - 1, pd.graphs.end());
  pd.graphs[0].key = key;
  pd.graphs[0].exec = exec;
  return &pd.graphs[0];
}

void CudaBackend::release_plan(Plan &plan) {
  PlanDevice &pd = plan.dev;
  {
    DeviceGuard guard(dev_);
    for (PlanDevice::Graph &g : pd.graphs) drop_graph(&g);
  }
  release_stage(pd);
  unbind(plan);  // (the engine unbound it: the rings only)
  for (Region *r : {&pd.runs, &pd.q, &pd.ret_ids, &pd.ret_pos, &pd.est_ids, &pd.run_tokens, &pd.est_out, &pd.est_lse,
                    &pd.offsets, &pd.logits, &pd.zones, &pd.xk, &pd.xv, &pd.scratch, &pd.counters, &pd.est_extra,
                    &pd.vars, &pd.bind_counts})
    mem_free_deferred(r);
  for (Region &r : pd.retired) mem_free_deferred(&r);
  pd.retired.clear();
  if (pd.bind_side) {
    DeviceGuard guard(dev_);
    cudaStreamDestroy(static_cast<cudaStream_t>(pd.bind_side));  // released once its work is done
    cudaEventDestroy(static_cast<cudaEvent_t>(pd.bind_fork));
    cudaEventDestroy(static_cast<cudaEvent_t>(pd.bind_join));
    (void)cudaGetLastError();
    pd.bind_side = pd.bind_fork = pd.bind_join = nullptr;
  }
  if (pd.bind_words) {
    const std::pair<kernels::BindWords *, kernels::BindWords *> words{pd.bind_words, pd.bind_words_dev};
    pd.bind_words = pd.bind_words_dev = nullptr;
    try {
      e_.buffers().defer([this, words] {
        std::lock_guard<std::mutex> lock(words_mu_);
        try {
          free_words_.push_back(words);
        } catch (...) {
        }
      });
    } catch (...) {
      // Kept until close.
    }
  }
}

void CudaBackend::xbuf(const Plan &plan, wkv_xbuf_view *view) {
  // The exact token count is offsets[n_runs] on the device; the host knows
  // the capacity, which bounds it.
  const PlanDevice &pd = plan.dev;
  view->n_runs = static_cast<uint32_t>(plan.runs.size());
  view->n_tokens = pd.xbuf_tokens;
  view->k = pd.xk.p;
  view->v = pd.xv.p;
  view->offsets = pd.offsets.as<int32_t>();
}

Status CudaBackend::size_plan(Plan &plan, cudaStream_t s, bool graph, PlanSizes *z, bool fixed) {
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, G = cfg.group(), nq = cfg.c.n_q_heads, pt = cfg.page_tokens();
  PlanDevice &pd = plan.dev;

  // 1. The runs, their zone sizes and the bounds that size the buffers.
  const uint32_t R = static_cast<uint32_t>(plan.runs.size());
  try {
    pd.host_runs.resize(R);
    pd.run_heads.resize(R);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for a lookup of %u runs", R);
  }
  const ColdTier *cold = e_.cold();
  uint64_t xbuf = 0, want = 0;
  uint32_t max_run = 0, max_clusters = 0;
  size_t ret = 0, est = 0, est_zone = 0, lg = 0;
  for (uint32_t r = 0; r < R; ++r) {
    const RunPlan &rp = plan.runs[r];
    const LayerState &L = plan.seqs[rp.seq]->layer(plan.layer);
    const HeadState &hs = L.heads[rp.head];
    kernels::DevRun &dr = pd.host_runs[r];
    dr = kernels::DevRun{};
    dr.centroid = hs.meta.centroid.as<const float>();
    dr.value_sum = hs.meta.value_sum.as<const float>();
    dr.spread = cfg.c.method & WKV_METHOD_SPREAD ? hs.meta.spread.as<const float>() : nullptr;
    dr.value_mean = cfg.c.method & WKV_METHOD_TAIL ? hs.values.mean.as<const float>() : nullptr;
    dr.centroid16 = hs.meta.centroid16.p;
    dr.centroid8 = hs.meta.centroid8.p;
    dr.centroid8_scale = hs.meta.centroid8_scale.as<const float>();
    dr.value_sum8 = value_sum16_ ? hs.meta.value_sum8.p : nullptr;
    dr.value_sum8_scale = hs.meta.value_sum8_scale.as<const float>();
    dr.value_sum16 = value_sum16_ ? hs.meta.value_sum16.p : nullptr;
    dr.size = hs.mirror.size.as<const uint32_t>();
    dr.first_slot = hs.mirror.first_slot.as<const uint32_t>();
    dr.unit_begin = hs.mirror.unit_begin.as<const uint32_t>();
    dr.pages = hs.mirror.pages.as<const uint8_t *const>();
    dr.unit_dir = frames_ ? hs.mirror.unit_dir.as<uint32_t *const>() : nullptr;
    dr.sink_k = hs.sink.k_at(0);
    dr.sink_v = hs.sink.v_at(0);
    dr.tail_k = hs.tail.k_at(0);
    dr.tail_v = hs.tail.v_at(0);
    dr.clusters = rp.clusters;
    dr.n_ret = rp.n_ret;
    dr.n_one = rp.n_one;
    dr.n_est = rp.n_est;
    dr.sink_tokens = static_cast<uint32_t>(hs.sink.n);
    dr.tail_tokens = static_cast<uint32_t>(hs.tail.n);
    dr.ret_off = static_cast<uint32_t>(ret);
    dr.est_off = static_cast<uint32_t>(est);
    dr.scratch_off = static_cast<uint32_t>(lg);
    if (cold) cold->fill_run(L, hs, &dr);
    pd.run_heads[r] = (static_cast<uint64_t>(hs.mirror.cache_id) << 32) | hs.mirror.cache_gen;
    ret += rp.n_ret;
    est += rp.n_est + (cold ? rp.n_ret : 0);  // the retrieval clusters found cold go after
    est_zone += rp.n_est;
    lg += static_cast<size_t>(G) * rp.clusters;
    max_clusters = std::max(max_clusters, rp.clusters);
    // The retrieval zone at its largest: the n_ret largest clusters' real
    // sizes, kept by every growth (HeadState::ret_tokens); n_ret times the
    // largest cluster should the two ever disagree. Its units likewise
    // (ret_units_bound).
    const uint64_t clustered = L.tail_begin - hs.sink.n;
    const uint64_t ret_tokens =
        hs.ret_n == rp.n_ret ? hs.ret_tokens : static_cast<uint64_t>(rp.n_ret) * hs.max_cluster;
    const uint64_t bound = hs.sink.n + hs.tail.n + std::min<uint64_t>(ret_tokens, clustered);
    xbuf += bound;
    max_run = std::max<uint32_t>(max_run, static_cast<uint32_t>(std::min<uint64_t>(bound, UINT32_MAX)));
    want += ret_units_bound(hs, rp.n_ret, pt);
  }
  if (xbuf > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
    return WKV_ERROR(WKV_ERR_BUDGET, "execution buffer would exceed 2^31 tokens");
  pd.total_ret = static_cast<uint32_t>(ret);
  pd.xbuf_tokens = xbuf;
  pd.max_run_tokens = max_run;
  pd.want_units = static_cast<uint32_t>(std::min<uint64_t>(want, UINT32_MAX));

  // 2. Buffers (grow only; a bound plan's, fixed at its binding, are
  //    checked instead: a captured step keeps their addresses).
  const size_t row = cfg.row_bytes();
  auto region = [&](Region *r, size_t bytes) -> Status {
    if (!fixed) return plan_region(pd, r, bytes, s);
    if (bytes <= r->bytes) return Status::ok();
    return WKV_ERROR(WKV_ERR_STATE,
                     "the step outgrows what its binding reserved (%zu bytes where %zu are): unbind and bind again",
                     bytes, r->bytes);
  };
  WKV_RETURN_IF_ERROR(region(&pd.runs, R * sizeof(kernels::DevRun)));
  WKV_RETURN_IF_ERROR(region(&pd.q, static_cast<size_t>(plan.n_seqs) * nq * d * sizeof(float)));
  WKV_RETURN_IF_ERROR(region(&pd.ret_ids, std::max<size_t>(ret, 1) * sizeof(uint32_t)));
  WKV_RETURN_IF_ERROR(region(&pd.ret_pos, std::max<size_t>(ret, 1) * sizeof(uint32_t)));
  WKV_RETURN_IF_ERROR(region(&pd.est_ids, std::max<size_t>(est, 1) * sizeof(uint32_t)));
  WKV_RETURN_IF_ERROR(region(&pd.run_tokens, R * sizeof(uint32_t)));
  WKV_RETURN_IF_ERROR(region(&pd.est_out, static_cast<size_t>(R) * G * d * sizeof(float)));
  WKV_RETURN_IF_ERROR(region(&pd.est_lse, static_cast<size_t>(R) * G * sizeof(float)));
  WKV_RETURN_IF_ERROR(region(&pd.offsets, (R + 1) * sizeof(int32_t)));
  // The logits, then the selection's scores. A graph's kernels keep their
  // pointers, so there the scores start at a bound on lg (decode_bound)
  // rather than at lg, which grows with every growth.
  if (fixed && lg > pd.bound_logits)
    return WKV_ERROR(WKV_ERR_STATE, "the step's %zu logits outgrow the %zu its binding reserved: unbind and bind again",
                     lg, pd.bound_logits);
  if (graph && !fixed) pd.bound_logits = decode_bound(pd.bound_logits, lg);
  const size_t scores_at = graph ? pd.bound_logits : lg;
  WKV_RETURN_IF_ERROR(region(&pd.logits, std::max<size_t>(scores_at, 1) * 2 * sizeof(float)));
  WKV_RETURN_IF_ERROR(region(&pd.zones, std::max<size_t>(lg / G, 1)));
  if (cold) WKV_RETURN_IF_ERROR(region(&pd.est_extra, R * sizeof(uint32_t)));
  WKV_RETURN_IF_ERROR(region(&pd.xk, std::max<uint64_t>(xbuf, 1) * row));
  WKV_RETURN_IF_ERROR(region(&pd.xv, std::max<uint64_t>(xbuf, 1) * row));
  if (!pd.counters.p) {
    if (fixed) return WKV_ERROR(WKV_ERR_INTERNAL, "a bound plan without its counters");
    WKV_RETURN_IF_ERROR(mem_alloc(kCounterWords * sizeof(uint32_t), s, &pd.counters));
    WKV_RETURN_IF_ERROR(mem_fill(pd.counters.p, 0, kCounterWords * sizeof(uint32_t), s));
  }
  z->R = R;
  z->max_clusters = max_clusters;
  z->scores = pd.logits.as<float>() + scores_at;
  z->retrieved = ret;
  z->estimated = est_zone;
  return Status::ok();
}

Status CudaBackend::lookup(Plan &plan) {
  DeviceGuard guard(dev_);
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, G = cfg.group(), nq = cfg.c.n_q_heads;
  PlanDevice &pd = plan.dev;
  PlanSizes z;
  WKV_RETURN_IF_ERROR(size_plan(plan, s, false, &z));
  const uint32_t R = z.R;

  // Enqueue: the query in f32 and the run table in one launch, then
  // scoring, selection and estimation; the estimate's last CTA lays out
  // the offsets and reports the step's end.
  const uint64_t epoch = e_.buffers().begin(plan.tracker());
  const kernels::StepMark mark{reinterpret_cast<unsigned long long *>(plan.tracker().done_device()), epoch,
                               pd.counters.as<unsigned int>() + kLookupCtas};
  Status st = Status::ok();
  cudaError_t err = kernels::stage_lookup(cfg.dtype(), plan.q_src, plan.q_seq_stride, plan.q_head_stride,
                                          plan.n_seqs, nq, d, pd.q.as<float>(), pd.host_runs.data(), R,
                                          pd.runs.as<kernels::DevRun>(), s);
  if (err == cudaSuccess)
    err = kernels::lookup_zones(pd.runs.as<kernels::DevRun>(), R, G, d, cfg.scale(), pd.q.as<float>(), lookup_view(pd),
                                z.scores, z.max_clusters, s, mark);
  if (err != cudaSuccess) st = kernel_status(err, "lookup");
  WKV_RETURN_IF_ERROR(finish(plan.tracker(), epoch, st, s));
  e_.counters().retrieved_clusters.fetch_add(z.retrieved);
  e_.counters().estimated_clusters.fetch_add(z.estimated);
  return Status::ok();
}

// Everything a decode's kernels take after its staging: the plan's buffers
// and the bounds that shape the grids. What changes from step to step is in
// the plan's StepVars, written by the staging, so that a graph of these
// kernels serves every step whose key (below) is the same.
struct CudaBackend::DecodeBody {
  kernels::DevRun *runs = nullptr;  // written by a replay's staging, as q and vars
  uint32_t R = 0, G = 0, H = 0, d = 0, max_clusters = 0, max_ret = 0, max_run = 0;
  float scale = 0.f;
  DType dtype{};
  float *q = nullptr;
  float *scores = nullptr, *scratch = nullptr;
  size_t scratch_floats = 0;
  kernels::DevLookup lookup{};
  uint8_t *xk = nullptr, *xv = nullptr;
  uint32_t *counters = nullptr;
  kernels::StepVars *vars = nullptr;
  unsigned long long *done = nullptr;
  unsigned long long *reading = nullptr;  // the tracker's word after `done` (in the key through it)

  uint32_t split_clusters = 0;  // the real largest run: decides the selection's split
  int priority = 0;             // the caller's stream's, where the graph forks (its nodes keep it)
  // A replay's staging: its ring, and the query rows it converts.
  kernels::StageRing ring{};
  uint32_t n_seqs = 0, nq = 0;

  // What a graph of these kernels fixed: the bounds, the selection's split
  // and every address.
  PlanDevice::GraphKey key() const {
    const auto a = [](const void *p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); };
    return {R,
            max_clusters,
            max_ret,
            max_run,
            scratch_floats,
            kernels::select_split(R, split_clusters),
            a(runs),
            a(q),
            a(scores),
            a(scratch),
            a(lookup.ret_ids),
            a(lookup.ret_pos),
            a(lookup.est_ids),
            a(lookup.run_tokens),
            a(lookup.est_out),
            a(lookup.est_lse),
            a(lookup.offsets),
            a(lookup.logits),
            a(lookup.zones),
            a(xk),
            a(xv),
            a(counters),
            a(vars),
            a(done),
            a(ring.slots),
            ring.slot_bytes,
            static_cast<uint64_t>(static_cast<int64_t>(priority))};
  }
};

CudaBackend::DecodeBody CudaBackend::decode_body(Plan &plan, uint32_t R) const {
  const Config &cfg = e_.config();
  const PlanDevice &pd = plan.dev;
  DecodeBody b;
  b.R = R;
  b.G = cfg.group();
  b.H = cfg.c.n_kv_heads;
  b.d = cfg.c.head_dim;
  b.scale = cfg.scale();
  b.dtype = cfg.dtype();
  b.runs = pd.runs.as<kernels::DevRun>();
  b.q = pd.q.as<float>();
  b.scratch = pd.scratch.as<float>();
  b.lookup = lookup_view(pd);
  b.xk = pd.xk.as<uint8_t>();
  b.xv = pd.xv.as<uint8_t>();
  b.counters = pd.counters.as<uint32_t>();
  b.vars = pd.vars.as<kernels::StepVars>();
  b.done = reinterpret_cast<unsigned long long *>(plan.tracker().done_device());
  b.reading = reinterpret_cast<unsigned long long *>(plan.tracker().reading_device());
  return b;
}

cudaError_t CudaBackend::launch_decode(const DecodeBody &b, cudaStream_t s, cudaStream_t side, bool fail_in_fork,
                                       cudaEvent_t fork_ev, cudaEvent_t join_ev) {
  if (!fork_ev) fork_ev = fork_ev_;
  if (!join_ev) join_ev = join_ev_;
  cudaError_t err = cudaSuccess;
  bool forked = false;
  if (side) {
    // The selection, whose last CTA lays out the offsets; then the
    // estimate on `side`, which only the attention's combine reads, while
    // the gather (which waits on PCIe) runs on `s`.
    err = kernels::lookup_select(b.runs, b.R, b.G, b.d, b.scale, b.q, b.lookup, b.scores, b.max_clusters,
                                 reinterpret_cast<unsigned int *>(b.counters) + kSelectCtas, s, b.split_clusters);
    if (err == cudaSuccess) err = cudaEventRecord(fork_ev, s);
    if (err == cudaSuccess) {
      // From here `side` may be in the capture: it is joined whatever fails.
      forked = true;
      err = cudaStreamWaitEvent(side, fork_ev, 0);
    }
    if (err == cudaSuccess) err = kernels::lookup_estimate(b.runs, b.R, b.G, b.d, b.lookup, side);
    if (err == cudaSuccess && fail_in_fork) err = cudaErrorLaunchFailure;
  } else {
    // The lookup: its last CTA lays out the offsets (no mark: the step
    // ends with the attention).
    const kernels::StepMark lookup_end{nullptr, 0, reinterpret_cast<unsigned int *>(b.counters) + kLookupCtas};
    err = kernels::lookup_zones(b.runs, b.R, b.G, b.d, b.scale, b.q, b.lookup, b.scores, b.max_clusters, s,
                                lookup_end, b.split_clusters);
  }
  if (err == cudaSuccess) {
    kernels::GatherArgs a = gather_args(b.runs, b.R, b.lookup, b.max_ret, b.xk, b.xv, b.counters);
    a.vars = b.vars;
    // From frames: the execution buffer's K rows hold where each row lives
    // (16 bytes a row, within a row of it).
    if (from_frames()) a.row_src = reinterpret_cast<kernels::RowSource *>(b.xk);
    if (frames_) {
      a.pool = e_.buffers().pool();
      a.reading.done = b.reading;  // frames are read: said before the entries (buffer_manager.hpp)
      a.reading.epoch_at = &b.vars->epoch;
    }
    err = kernels::gather_cuda(a, s);
  }
  if (forked) {
    // The join, also after a failure, so that a capture ends with every
    // stream it forked into joined (its error is the failure's).
    cudaError_t joined = cudaEventRecord(join_ev, side);
    if (joined == cudaSuccess) joined = cudaStreamWaitEvent(s, join_ev, 0);
    if (err == cudaSuccess) err = joined;
  }
  if (err != cudaSuccess) return err;
  kernels::StepMark end{b.done, 0, reinterpret_cast<unsigned int *>(b.counters) + kAttendCtas};
  end.epoch_at = &b.vars->epoch;
  kernels::AttendRows rows;
  if (from_frames()) {
    const Config &cfg = e_.config();
    rows.src = reinterpret_cast<const kernels::RowSource *>(b.xk);
    rows.vs_floats = cfg.page_tokens();
    rows.v_bytes = cfg.int8_pages() ? cfg.page_tokens() * cfg.c.head_dim : 0;
  }
  return kernels::attend_ragged(b.dtype, b.lookup.offsets, b.xk, b.xv, b.q, b.R, b.H, b.G, b.d, b.scale, b.max_run,
                                b.lookup.est_out, b.lookup.est_lse, nullptr, 0, 0, nullptr, b.scratch,
                                b.scratch_floats, s, end, b.vars, rows);
}

cudaError_t CudaBackend::capture_decode(const DecodeBody &b, cudaGraphExec_t *out, bool fail) {
  std::lock_guard<std::mutex> lock(cap_mu_);
  // Relaxed: the launches' wrappers may ask the device's attributes.
  cudaStream_t cap = cap_;
  if (fork_ && b.priority != least_priority_) {
    // A capture stream of the caller's priority (between the device's
    // least and greatest, as cudaStreamGetPriority reports them).
    const size_t at = static_cast<size_t>(least_priority_ - b.priority);
    if (at >= cap_priority_.size()) cap_priority_.resize(at + 1, nullptr);
    if (!cap_priority_[at]) {
      const cudaError_t made = cudaStreamCreateWithPriority(&cap_priority_[at], cudaStreamNonBlocking, b.priority);
      if (made != cudaSuccess) {
        cap_priority_[at] = nullptr;
        (void)cudaGetLastError();
        return made;
      }
    }
    cap = cap_priority_[at];
  }
  if (fail && !fork_) return cudaErrorLaunchFailure;
  cudaError_t err = cudaStreamBeginCapture(cap, cudaStreamCaptureModeRelaxed);
  if (err != cudaSuccess) return err;
  // The staging from the ring's next slot (where the plan has a ring),
  // then the step's kernels.
  if (b.ring.slots) err = kernels::stage_from_ring(b.dtype, b.ring, b.R, b.n_seqs, b.nq, b.d, b.q, b.runs, b.vars, cap);
  // (Without the fork, an injected failure refuses the capture before it
  // begins, as it always did.)
  if (err == cudaSuccess) err = launch_decode(b, cap, fork_ ? cap_side_ : nullptr, fail);
  cudaGraph_t g = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(cap, &g);
  if (err == cudaSuccess) err = ended;
  // With the fork, each kernel runs at its node's priority, copied from its
  // capture stream's: the estimate's cap_side_'s, the others' that of the
  // stream the step was captured for (part of the graph's key).
  if (err == cudaSuccess) err = cudaGraphInstantiate(out, g, fork_ ? cudaGraphInstantiateFlagUseNodePriority : 0);
  if (g) cudaGraphDestroy(g);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

size_t CudaBackend::stage_slot_bytes(uint32_t R) {
  return (sizeof(kernels::StageSlot) + size_t(R) * sizeof(kernels::DevRun) + 63) & ~size_t{63};
}

Status CudaBackend::stage_ring(PlanDevice &pd, uint32_t R) {
  const size_t need = stage_slot_bytes(R);
  if (need <= pd.stage_slot_bytes) return Status::ok();
  // Slots half again as large as the last ring's, so that a batch that
  // grows a sequence at a time does not replace its ring at every step.
  const size_t slot_bytes = std::max(need, (pd.stage_slot_bytes + pd.stage_slot_bytes / 2 + 63) & ~size_t{63});
  const size_t bytes = slot_bytes * PlanDevice::kStageSlots;
  StageBlock blk;
  WKV_RETURN_IF_ERROR(take_stage_block(bytes, &blk));
  release_stage(pd);
  pd.stage_host = blk.host;
  pd.stage_dev = blk.dev;
  pd.stage_bytes = blk.bytes;
  pd.stage_slot_bytes = slot_bytes;
  pd.stage_epochs.fill(0);  // slots no step of this plan has written
  return Status::ok();
}

Status CudaBackend::take_stage_block(size_t bytes, StageBlock *out) {
  {
    // The smallest free block that holds it.
    std::lock_guard<std::mutex> lock(stage_mu_);
    size_t best = stage_free_.size();
    for (size_t i = 0; i < stage_free_.size(); ++i)
      if (stage_free_[i].bytes >= bytes && (best == stage_free_.size() || stage_free_[i].bytes < stage_free_[best].bytes))
        best = i;
    if (best < stage_free_.size()) {
      *out = stage_free_[best];
      stage_free_.erase(stage_free_.begin() + static_cast<ptrdiff_t>(best));
      return Status::ok();
    }
  }
  void *h = nullptr, *dv = nullptr;
  WKV_RETURN_IF_ERROR(pinned_.alloc(bytes, &h, &dv));
  *out = StageBlock{static_cast<uint8_t *>(h), static_cast<uint8_t *>(dv), bytes};
  return Status::ok();
}

void CudaBackend::give_stage_block(const StageBlock &blk) {
  std::lock_guard<std::mutex> lock(stage_mu_);
  try {
    stage_free_.push_back(blk);
  } catch (...) {
    // Kept (freed at close) rather than reused.
  }
}

void CudaBackend::release_stage(PlanDevice &pd) {
  if (!pd.stage_host) return;
  const StageBlock blk{pd.stage_host, pd.stage_dev, pd.stage_bytes};
  pd.stage_host = pd.stage_dev = nullptr;
  pd.stage_bytes = pd.stage_slot_bytes = 0;
  try {
    // Back to the free blocks once no step that may read it is in flight.
    e_.buffers().defer([this, blk] { give_stage_block(blk); });
  } catch (...) {
    // Out of memory for the release itself: kept until close.
  }
}

Status CudaBackend::decode(Plan &plan, const DecodeOut &out) {
  DeviceGuard guard(dev_);
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, G = cfg.group(), nq = cfg.c.n_q_heads;
  PlanDevice &pd = plan.dev;
  PlanSizes z;
  WKV_RETURN_IF_ERROR(size_plan(plan, s, true, &z));
  const uint32_t R = z.R;
  if (R == 0) return WKV_ERROR(WKV_ERR_INTERNAL, "a decode of no runs");

  // 1. The kernels' bounds, rounded up so that a graph serves many steps,
  //    and their buffers.
  uint32_t max_ret = 0;
  for (const RunPlan &rp : plan.runs) max_ret = std::max(max_ret, rp.n_ret);
  const uint32_t max_run = pd.bound_run = decode_bound32(pd.bound_run, pd.max_run_tokens);
  const size_t scratch_floats = kernels::attend_ragged_scratch_floats(R, G, d, max_run);
  WKV_RETURN_IF_ERROR(plan_region(pd, &pd.scratch, scratch_floats * sizeof(float), s));
  WKV_RETURN_IF_ERROR(plan_region(pd, &pd.vars, sizeof(kernels::StepVars), s));
  DecodeBody b = decode_body(plan, R);
  b.max_clusters = pd.bound_clusters = decode_bound32(pd.bound_clusters, z.max_clusters);
  b.max_ret = pd.bound_ret = decode_bound32(pd.bound_ret, max_ret);
  b.max_run = max_run;
  b.scratch_floats = scratch_floats;
  b.scores = z.scores;
  b.split_clusters = z.max_clusters;
  b.priority = least_priority_;
  if (fork_ && cudaStreamGetPriority(s, &b.priority) != cudaSuccess) {
    (void)cudaGetLastError();
    b.priority = least_priority_;
  }
  b.priority = std::min(least_priority_, std::max(greatest_priority_, b.priority));
  // The ring a replay stages from; without one (WKV_DECODE_RING=0, or no
  // pinned memory for it), a replay follows a staging launch. It is had at
  // the plan's first decode (and grown with its batch), not first at a
  // later step, where a runtime may be holding its stream: pinned memory's
  // allocation may wait for the device. One that could not be had is asked
  // for again 256 of the plan's decodes later, not at every step.
  b.n_seqs = plan.n_seqs;
  b.nq = nq;
  bool ring = rings_ && pd.stage_slot_bytes >= stage_slot_bytes(R);
  if (rings_ && !ring) {
    if (pd.stage_retry_in > 0) {
      --pd.stage_retry_in;
    } else {
      ring = stage_ring(pd, R).is_ok();
      if (!ring) pd.stage_retry_in = 256;
    }
  }
  if (ring) {
    b.ring.slots = pd.stage_dev;
    b.ring.slot_bytes = pd.stage_slot_bytes;
    b.ring.n_slots = PlanDevice::kStageSlots;
    b.ring.taken = pd.counters.as<unsigned int>() + kStageTaken;
    b.ring.ctas = pd.counters.as<unsigned int>() + kStageCtas;
  }
  const PlanDevice::GraphKey key = b.key();

  // 2. The step's variables: its epoch (one for the whole step, reported
  //    by the attention's last CTA), its access record and the output.
  const uint64_t epoch = e_.buffers().begin(plan.tracker());
  const kernels::StepVars v =
      step_vars(epoch, open_step_record(plan, epoch), out.out, out.seq_stride, out.head_stride);

  // 3. A replay where the plan has a graph for this key (made when the same
  //    key comes twice in a row) and the ring's next slot is free: the
  //    step's staging (variables, query, run table) written to the slot,
  //    then one launch, the graph's first kernel staging from the slot
  //    (without a ring: a staging launch, then the graph). Else the
  //    staging launch and the kernels one by one.
  //    A key whose graph could not be made or launched is tried again once
  //    another key has come (and then this one twice in a row), or once its
  //    backoff has passed (PlanDevice::retry_in).
  if (pd.refused_key != key || --pd.retry_in == 0) pd.refused_key = PlanDevice::GraphKey{};
  auto refuse = [&pd, &key] {
    pd.refused_key = key;
    pd.backoff = std::min<uint32_t>(pd.backoff ? 2 * pd.backoff : 64, 4096);
    pd.retry_in = pd.backoff;
  };
  const uint32_t slot = pd.stage_next % PlanDevice::kStageSlots;
  PlanDevice::Graph *g = nullptr;
  if (!ring || plan.tracker().done() >= pd.stage_epochs[slot]) {
    g = find_graph(pd, key);
    if (!g && pd.seen_key == key && pd.refused_key != key) {
      cudaGraphExec_t exec = nullptr;
      // An injected refusal fails the capture from inside (after the fork,
      // where the graph forks): the path of a launch that fails there.
      if (capture_decode(b, &exec, e_.faults().fail(FaultInjector::kGraph)) == cudaSuccess) {
        g = add_graph(pd, key, exec);
      } else {
        refuse();
      }
    }
  }
  pd.seen_key = key;
  auto stage_launch = [&] {
    return kernels::stage_lookup(cfg.dtype(), plan.q_src, plan.q_seq_stride, plan.q_head_stride, plan.n_seqs, nq, d,
                                 pd.q.as<float>(), pd.host_runs.data(), R, pd.runs.as<kernels::DevRun>(), s, &v,
                                 pd.vars.as<kernels::StepVars>());
  };
  bool replayed = false, staged = false;
  cudaError_t err = cudaSuccess;
  if (g) {
    if (ring) {
      uint8_t *at = pd.stage_host + size_t(slot) * pd.stage_slot_bytes;
      kernels::StageSlot head;
      head.vars = v;
      head.q = plan.q_src;
      head.q_seq_stride = plan.q_seq_stride;
      head.q_head_stride = plan.q_head_stride;
      head.n_runs = R;
      head.n_seqs = plan.n_seqs;
      std::memcpy(at, &head, sizeof head);
      std::memcpy(at + sizeof head, pd.host_runs.data(), size_t(R) * sizeof(kernels::DevRun));
    } else {
      err = stage_launch();
      staged = true;
    }
    if (err == cudaSuccess) {
      err = e_.faults().fail(FaultInjector::kGraph) ? cudaErrorLaunchFailure
                                                    : cudaGraphLaunch(static_cast<cudaGraphExec_t>(g->exec), s);
      replayed = err == cudaSuccess;
      if (replayed) {
        if (ring) {
          pd.stage_epochs[slot] = epoch;
          ++pd.stage_next;  // as the device's count will be once the staging has run
        }
        pd.backoff = 0;
      } else {
        // Not launched (nothing of it enqueued, no slot taken): dropped,
        // and the step's kernels launched one by one.
        (void)cudaGetLastError();
        drop_graph(g);
        refuse();
        err = cudaSuccess;
      }
    }
  }
  if (!replayed && err == cudaSuccess) {
    if (!staged) err = stage_launch();
    if (err == cudaSuccess) err = launch_decode(b, s);
  }
  // On a failure, the stream is waited for and the step ended on the host
  // (finish); the record is then taken as the kernels that ran left it (its
  // counts are zero where the gather did not run), never cancelled under a
  // gather that might still write it.
  if (err != cudaSuccess) return finish(plan.tracker(), epoch, kernel_status(err, "decode"), s);
  if (replayed) e_.counters().decode_graphs.fetch_add(1, std::memory_order_relaxed);
  e_.counters().retrieved_clusters.fetch_add(z.retrieved);
  e_.counters().estimated_clusters.fetch_add(z.estimated);
  return Status::ok();
}

StepRecord CudaBackend::open_step_record(Plan &plan, uint64_t epoch) {
  const PlanDevice &pd = plan.dev;
  return open_step_record(plan, epoch, pd.run_heads.data(), static_cast<uint32_t>(plan.runs.size()), pd.want_units,
                          plan.layer);
}

StepRecord CudaBackend::open_step_record(Plan &plan, uint64_t epoch, const uint64_t *heads, uint32_t n_runs,
                                         uint32_t want_units, uint32_t layer) {
  if (!frames_) return StepRecord{};
  return e_.buffers().open_record(plan.tracker(), epoch, heads, n_runs, want_units,
                                  std::min<uint32_t>(want_units, 16384), layer + 1);
}


kernels::GatherArgs CudaBackend::gather_args(const kernels::DevRun *runs, uint32_t R, const kernels::DevLookup &lookup,
                                             uint32_t max_ret, uint8_t *xk, uint8_t *xv, uint32_t *counters) const {
  const Config &cfg = e_.config();
  kernels::GatherArgs a;
  a.runs = runs;
  a.n_runs = R;
  a.lookup = lookup;
  a.max_ret = max_ret;
  a.row_bytes = cfg.row_bytes();
  a.page_tokens = cfg.page_tokens();
  if (cfg.int8_pages()) {
    a.int8_dim = cfg.c.head_dim;
    a.scales_at = cfg.page_scales_at();
    a.dtype = cfg.dtype();
    a.centered = cfg.centered_keys();
  }
  a.xk = xk;
  a.xv = xv;
  a.cache = cache_;
  a.frame_bytes = frame_bytes_;
  a.frames = frames_;
  a.work = counters + kGatherWork;
  a.stats = d_stats_;
  return a;
}

Status CudaBackend::assemble(Plan &plan) {
  DeviceGuard guard(dev_);
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  PlanDevice &pd = plan.dev;
  const uint32_t R = static_cast<uint32_t>(plan.runs.size());
  const uint64_t epoch = e_.buffers().begin(plan.tracker());
  const StepRecord rec = open_step_record(plan, epoch);
  uint32_t max_ret = 0;
  for (const RunPlan &rp : plan.runs) max_ret = std::max(max_ret, rp.n_ret);
  kernels::GatherArgs a = gather_args(pd.runs.as<kernels::DevRun>(), R, lookup_view(pd), max_ret,
                                      pd.xk.as<uint8_t>(), pd.xv.as<uint8_t>(), pd.counters.as<uint32_t>());
  if (rec.header) {
    a.pool = e_.buffers().pool();
    a.admit_cap = rec.admit_cap;
    a.admits = rec.admits;
    a.hits = rec.hits;
    a.hit_cap = rec.hit_cap;
    a.record_counts = &rec.header->used;
  }
  a.mark = kernels::StepMark{reinterpret_cast<unsigned long long *>(plan.tracker().done_device()), epoch, nullptr};
  if (frames_)
    a.reading = kernels::StepMark{reinterpret_cast<unsigned long long *>(plan.tracker().reading_device()), epoch,
                                  nullptr};
  // On a failure the step is ended on the host once the stream is idle
  // (finish) and the record taken as the gather left it: never cancelled,
  // since a launch's error may be an earlier call's, the gather enqueued.
  const cudaError_t err = kernels::gather_cuda(a, s);
  return finish(plan.tracker(), epoch, err == cudaSuccess ? Status::ok() : kernel_status(err, "gather"), s);
}

Status CudaBackend::attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) {
  DeviceGuard guard(dev_);
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  const Config &cfg = e_.config();
  PlanDevice &pd = plan.dev;
  const uint32_t R = static_cast<uint32_t>(plan.runs.size());
  const size_t sf = kernels::attend_ragged_scratch_floats(R, cfg.group(), cfg.c.head_dim, pd.max_run_tokens);
  WKV_RETURN_IF_ERROR(plan_region(pd, &pd.scratch, sf * sizeof(float), s));
  const uint64_t epoch = e_.buffers().begin(plan.tracker());
  const kernels::StepMark mark{reinterpret_cast<unsigned long long *>(plan.tracker().done_device()), epoch,
                               pd.counters.as<unsigned int>() + kAttendCtas};
  const cudaError_t err = kernels::attend_ragged(
      cfg.dtype(), pd.offsets.as<int32_t>(), pd.xk.p, pd.xv.p, pd.q.as<float>(), R, cfg.c.n_kv_heads, cfg.group(),
      cfg.c.head_dim, cfg.scale(), pd.max_run_tokens, pd.est_out.as<float>(), pd.est_lse.as<float>(), out, seq_stride,
      head_stride, lse, pd.scratch.as<float>(), pd.scratch.bytes / sizeof(float), s, mark);
  return finish(plan.tracker(), epoch, err == cudaSuccess ? Status::ok() : kernel_status(err, "attend"), s);
}

Status CudaBackend::merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                          int64_t lse_seq_stride) {
  DeviceGuard guard(dev_);
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  const Config &cfg = e_.config();
  PlanDevice &pd = plan.dev;
  const uint64_t epoch = e_.buffers().begin(plan.tracker());
  const kernels::StepMark mark{reinterpret_cast<unsigned long long *>(plan.tracker().done_device()), epoch,
                               pd.counters.as<unsigned int>() + kMergeCtas};
  const cudaError_t err =
      kernels::merge_estimate(cfg.dtype(), out, seq_stride, head_stride, lse, lse_seq_stride, pd.est_out.as<float>(),
                              pd.est_lse.as<float>(), plan.n_seqs, cfg.c.n_q_heads, cfg.c.head_dim, s, mark);
  return finish(plan.tracker(), epoch, err == cudaSuccess ? Status::ok() : kernel_status(err, "merge"), s);
}

void CudaBackend::fill_stats(wkv_stats *out) {
  unsigned long long c[3] = {0, 0, 0};
  {
    DeviceGuard guard(dev_);
    std::lock_guard<std::mutex> lock(side_mu_);
    // On the side stream, which synchronizes with no other: reading the
    // counters never waits for the caller's work, nor disturbs a capture.
    if (cudaMemcpyAsync(c, d_stats_, sizeof c, cudaMemcpyDeviceToHost, side_) != cudaSuccess ||
        cudaStreamSynchronize(side_) != cudaSuccess)
      (void)cudaGetLastError();
  }
  out->cache_hits = c[0];
  out->cache_misses = c[1];
  out->attended_tokens = c[2];  // counted on the device: the host knows only a bound
  out->device_cache_bytes = static_cast<uint64_t>(frames_) * frame_bytes_;
  // Memory by where it lives: the pools' own figures (the reservation
  // keeps its peak, as the pools are told to) and what was allocated
  // outside them at open. A pool attribute that cannot be read counts 0.
  auto pool_bytes = [](cudaMemPool_t pool, cudaMemPoolAttr attr) -> uint64_t {
    uint64_t v = 0;
    if (!pool || cudaMemPoolGetAttribute(pool, attr, &v) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return static_cast<uint64_t>(v);
  };
  const uint64_t fixed = out->device_cache_bytes + d_block_bytes_.load(std::memory_order_relaxed) + kStatsBytes;
  out->device_bytes_reserved = fixed + pool_bytes(mempool_, cudaMemPoolAttrReservedMemCurrent);
  out->device_bytes_used = fixed + pool_bytes(mempool_, cudaMemPoolAttrUsedMemCurrent);
  out->meta_host_rows_reserved = pool_bytes(host_rows_pool_, cudaMemPoolAttrReservedMemCurrent);
}


// Steps a runtime captures (lib/engine/binding.hpp) ---------------------------

Status CudaBackend::device_sync() {
  DeviceGuard guard(dev_);
  const cudaError_t err = cudaDeviceSynchronize();
  return err == cudaSuccess ? Status::ok() : kernel_status(err, "cudaDeviceSynchronize");
}

Status CudaBackend::capturing(void *stream, bool *yes) {
  *yes = false;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &cap);
  if (err == cudaErrorStreamCaptureImplicit) {
    // The legacy stream while another is captured: not this capture's.
    (void)cudaGetLastError();
    return Status::ok();
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "the stream is not one CUDA knows (%s)", cudaGetErrorString(err));
  }
  *yes = cap == cudaStreamCaptureStatusActive;
  return Status::ok();
}

size_t CudaBackend::bound_slot_bytes(uint32_t n_seqs) const {
  const Config &cfg = e_.config();
  const size_t R = static_cast<size_t>(n_seqs) * cfg.c.n_kv_heads;
  const size_t decode = sizeof(kernels::StageSlot) + R * sizeof(kernels::DevRun);
  // An append: at most two copies a head (sink and tail), a mark a sequence.
  const size_t append = 2 * R * sizeof(kernels::RowCopyDesc) + size_t(n_seqs) * 16;
  return (sizeof(kernels::BoundSlotHead) + std::max(decode, append) + 63) & ~size_t{63};
}

Status CudaBackend::take_bind_words(kernels::BindWords **host, kernels::BindWords **dev) {
  std::lock_guard<std::mutex> lock(words_mu_);
  if (free_words_.empty()) {
    constexpr size_t kBlock = 256;
    void *h = nullptr, *d = nullptr;
    WKV_RETURN_IF_ERROR(pinned_.alloc(kBlock * sizeof(kernels::BindWords), &h, &d));
    try {
      free_words_.reserve(free_words_.size() + kBlock);
    } catch (const std::bad_alloc &) {
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for a plan's binding words");
    }
    for (size_t i = kBlock; i-- > 0;)
      free_words_.emplace_back(static_cast<kernels::BindWords *>(h) + i, static_cast<kernels::BindWords *>(d) + i);
  }
  *host = free_words_.back().first;
  *dev = free_words_.back().second;
  free_words_.pop_back();
  return Status::ok();
}

Status CudaBackend::bind(Plan &plan, Binding &b) {
  DeviceGuard guard(dev_);
  const Config &cfg = e_.config();
  PlanDevice &pd = plan.dev;
  const uint32_t n = static_cast<uint32_t>(b.seqs.size());
  const uint32_t H = cfg.c.n_kv_heads, G = cfg.group(), d = cfg.c.head_dim, nq = cfg.c.n_q_heads;
  const uint32_t R = n * H;
  if (b.max_calls > kernels::kMaxBoundCalls)
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "a binding holds at most %u calls", kernels::kMaxBoundCalls);
  cudaStream_t s = io_;
  // 1. The plan's own words and counts, for its life.
  if (!pd.bind_words) WKV_RETURN_IF_ERROR(take_bind_words(&pd.bind_words, &pd.bind_words_dev));
  if (!pd.bind_counts.p) {
    WKV_RETURN_IF_ERROR(mem_alloc((2 * kernels::kMaxBoundCalls + 1) * sizeof(uint32_t), s, &pd.bind_counts));
  }
  if (const cudaError_t err = kernels::bound_load(); err != cudaSuccess) return kernel_status(err, "bound_load");
  if (!pd.bind_side) {
    cudaStream_t side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    cudaError_t err = cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, side_priority());
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      if (side) cudaStreamDestroy(side);
      if (fork) cudaEventDestroy(fork);
      return kernel_status(err, "a bound plan's stream");
    }
    pd.bind_side = side;
    pd.bind_fork = fork;
    pd.bind_join = join;
  }
  // 2. Buffers for the largest layer's reserve (a buffer replaced now or
  //    later stays until the plan goes: PlanDevice::retired).
  pd.ever_bound = true;
  BoundReserve top;
  for (const BoundReserve &r : b.reserve) {
    top.max_clusters = std::max(top.max_clusters, r.max_clusters);
    top.max_ret = std::max(top.max_ret, r.max_ret);
    top.max_run = std::max(top.max_run, r.max_run);
    top.xbuf = std::max(top.xbuf, r.xbuf);
    top.clusters = std::max(top.clusters, r.clusters);
    top.ret = std::max(top.ret, r.ret);
    top.est = std::max(top.est, r.est);
  }
  if (top.xbuf > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
    return WKV_ERROR(WKV_ERR_BUDGET, "the binding's execution buffer would exceed 2^31 tokens");
  const size_t row = cfg.row_bytes(), lg = static_cast<size_t>(G) * top.clusters;
  struct Want {
    Region *r;
    size_t bytes;
  } wants[] = {
      {&pd.runs, R * sizeof(kernels::DevRun)},
      {&pd.q, static_cast<size_t>(n) * nq * d * sizeof(float)},
      {&pd.ret_ids, std::max<size_t>(top.ret, 1) * sizeof(uint32_t)},
      {&pd.ret_pos, std::max<size_t>(top.ret, 1) * sizeof(uint32_t)},
      {&pd.est_ids, std::max<size_t>(top.est, 1) * sizeof(uint32_t)},
      {&pd.run_tokens, R * sizeof(uint32_t)},
      {&pd.est_out, static_cast<size_t>(R) * G * d * sizeof(float)},
      {&pd.est_lse, static_cast<size_t>(R) * G * sizeof(float)},
      {&pd.offsets, (R + 1) * sizeof(int32_t)},
      {&pd.logits, std::max<size_t>(std::max(lg, pd.bound_logits), 1) * 2 * sizeof(float)},
      {&pd.zones, std::max<size_t>(top.clusters, 1)},
      {&pd.xk, std::max<uint64_t>(top.xbuf, 1) * row},
      {&pd.xv, std::max<uint64_t>(top.xbuf, 1) * row},
      {&pd.scratch, kernels::attend_ragged_scratch_floats(R, G, d, top.max_run) * sizeof(float)},
      {&pd.vars, sizeof(kernels::StepVars)},
  };
  for (const Want &w : wants) WKV_RETURN_IF_ERROR(plan_region(pd, w.r, w.bytes, s));
  pd.bound_logits = std::max(pd.bound_logits, lg);
  if (!pd.counters.p) {
    WKV_RETURN_IF_ERROR(mem_alloc(kCounterWords * sizeof(uint32_t), s, &pd.counters));
    WKV_RETURN_IF_ERROR(mem_fill(pd.counters.p, 0, kCounterWords * sizeof(uint32_t), s));
  }
  // 3. The rings, every slot unstamped.
  const size_t slot_bytes = bound_slot_bytes(n);
  const size_t bytes = slot_bytes * kBoundSlots * b.max_calls;
  StageBlock blk;
  WKV_RETURN_IF_ERROR(take_stage_block(bytes, &blk));
  std::memset(blk.host, 0, bytes);
  // 4. Counts zero, on the device before any replay (the allocations and
  //    the fill are ordered on `s`, which is waited for).
  Status st = mem_fill(pd.bind_counts.p, 0, pd.bind_counts.bytes, s);
  if (st.is_ok()) st = mem_sync(s);
  if (!st.is_ok()) {
    give_stage_block(blk);
    return st;
  }
  pd.bound_rings = blk.host;
  pd.bound_rings_dev = blk.dev;
  pd.bound_rings_bytes = blk.bytes;
  pd.bound_slot_bytes = slot_bytes;
  volatile kernels::BindWords *w = pd.bind_words;
  w->error = 0;
  w->n_calls = 0;
  w->generation = ++pd.bind_generation;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return Status::ok();
}

void CudaBackend::bound_ring(Plan &plan, uint32_t i, BoundRing *out) {
  const PlanDevice &pd = plan.dev;
  const size_t at = static_cast<size_t>(i) * kBoundSlots * pd.bound_slot_bytes;
  out->host = pd.bound_rings + at;
  out->dev = pd.bound_rings_dev + at;
  out->slot_bytes = pd.bound_slot_bytes;
}

void CudaBackend::unbind(Plan &plan) {
  PlanDevice &pd = plan.dev;
  if (pd.bind_words) {
    volatile kernels::BindWords *w = pd.bind_words;
    w->generation = ++pd.bind_generation;  // a graph of this binding faults from now on
    w->n_calls = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  if (!pd.bound_rings) return;
  const StageBlock blk{pd.bound_rings, pd.bound_rings_dev, pd.bound_rings_bytes};
  pd.bound_rings = pd.bound_rings_dev = nullptr;
  pd.bound_rings_bytes = pd.bound_slot_bytes = 0;
  // No replay is in flight (the engine waited for the replays' stream); a
  // graph replayed later reads a stamp of the old ring (pinned blocks are
  // freed at close only, so it reads live memory) and fails its generation
  // check, using nothing it read.
  give_stage_block(blk);
}

uint32_t CudaBackend::bound_fault(const Plan &plan) {
  const volatile kernels::BindWords *w = plan.dev.bind_words;
  return w ? w->error : 0;
}

void CudaBackend::bound_seal(Plan &plan, uint32_t n_calls) {
  volatile kernels::BindWords *w = plan.dev.bind_words;
  if (!w) return;
  w->n_calls = n_calls;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

Status CudaBackend::bound_counts(Plan &plan, uint32_t n, uint32_t *out) {
  DeviceGuard guard(dev_);
  const PlanDevice &pd = plan.dev;
  if (n == 0) return Status::ok();
  if (!pd.bind_counts.p || n > kernels::kMaxBoundCalls)
    return WKV_ERROR(WKV_ERR_INTERNAL, "no binding counts to read");
  std::lock_guard<std::mutex> lock(side_mu_);
  cudaError_t err = cudaMemcpyAsync(out, pd.bind_counts.as<uint32_t>() + kernels::kMaxBoundCalls,
                                    n * sizeof(uint32_t), cudaMemcpyDeviceToHost, side_);
  if (err == cudaSuccess) err = cudaStreamSynchronize(side_);
  if (err != cudaSuccess) return kernel_status(err, "reading a binding's counts");
  return Status::ok();
}

Status CudaBackend::capture_bound(Plan &plan, Binding &b, uint32_t i, void *stream) {
  DeviceGuard guard(dev_);
  const Config &cfg = e_.config();
  PlanDevice &pd = plan.dev;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const BoundCallState &c = b.calls[i];
  const uint32_t n = static_cast<uint32_t>(b.seqs.size()), H = cfg.c.n_kv_heads, R = n * H;
  kernels::BoundCall bc;
  bc.slots = c.ring.dev;
  bc.slot_bytes = c.ring.slot_bytes;
  bc.n_slots = kBoundSlots;
  bc.index = i;
  bc.generation = pd.bind_generation;
  bc.taken = pd.bind_counts.as<unsigned int>();
  bc.worked = bc.taken + kernels::kMaxBoundCalls;
  bc.ctas = bc.taken + 2 * kernels::kMaxBoundCalls;
  bc.words = pd.bind_words_dev;
  if (c.kind == BoundCallState::Kind::kAppend) {
    const uint32_t row = static_cast<uint32_t>(cfg.row_bytes());
    const uint32_t width = kernels::copy_width(reinterpret_cast<uintptr_t>(c.k) | reinterpret_cast<uintptr_t>(c.v) |
                                               c.seq_pitch | c.token_pitch | c.head_pitch | row);
    const cudaError_t err = kernels::bound_copy(bc, 2 * R, c.k, c.v, c.token_pitch, row, width, s);
    return err == cudaSuccess ? Status::ok() : kernel_status(err, "a captured append");
  }
  // A decode: the step's kernels for the layer's reserve, after a staging
  // from the call's ring; the estimate beside the gather on the plan's own
  // stream (the fork), which the capture joins back.
  const BoundReserve &rs = b.reserve[c.layer];
  DecodeBody body = decode_body(plan, R);
  body.max_clusters = rs.max_clusters;
  body.max_ret = rs.max_ret;
  body.max_run = rs.max_run;
  body.scratch_floats = kernels::attend_ragged_scratch_floats(R, body.G, body.d, body.max_run);
  if (body.scratch_floats * sizeof(float) > pd.scratch.bytes)
    return WKV_ERROR(WKV_ERR_INTERNAL, "a bound plan's scratch is smaller than its reserve");
  body.scores = pd.logits.as<float>() + pd.bound_logits;
  // The selection's split: the layer's largest run now, kept by the graph.
  uint32_t split = 0;
  for (const auto &sq : b.seqs)
    for (const HeadState &hs : sq->layer(c.layer).heads) split = std::max(split, hs.clusters());
  body.split_clusters = split;
  cudaError_t err = kernels::bound_stage(cfg.dtype(), bc, R, n, cfg.c.n_q_heads, body.d, body.q, body.runs,
                                         body.vars, c.out, c.out_seq_stride, c.out_head_stride, s);
  if (err == cudaSuccess)
    err = launch_decode(body, s, fork_ ? static_cast<cudaStream_t>(pd.bind_side) : nullptr, false,
                        static_cast<cudaEvent_t>(pd.bind_fork), static_cast<cudaEvent_t>(pd.bind_join));
  return err == cudaSuccess ? Status::ok() : kernel_status(err, "a captured decode");
}

Status CudaBackend::bound_expect(Plan &plan, uint32_t i, uint32_t want, void *stream) {
  DeviceGuard guard(dev_);
  const PlanDevice &pd = plan.dev;
  const cudaError_t err = kernels::bound_expect(pd.bind_counts.as<unsigned int>() + i, want, pd.bind_words_dev,
                                                static_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? Status::ok() : kernel_status(err, "a binding's check");
}

Status CudaBackend::prepare_decode(Plan &plan, Binding &b, uint32_t i, uint8_t *body) {
  BoundCallState &c = b.calls[i];
  PlanDevice &pd = plan.dev;
  PlanSizes z;
  WKV_RETURN_IF_ERROR(size_plan(plan, nullptr, true, &z, true));
  const BoundReserve &rs = b.reserve[c.layer];
  uint32_t max_ret = 0;
  for (const RunPlan &rp : plan.runs) max_ret = std::max(max_ret, rp.n_ret);
  if (z.max_clusters > rs.max_clusters || max_ret > rs.max_ret || pd.max_run_tokens > rs.max_run)
    return WKV_ERROR(WKV_ERR_STATE,
                     "layer %u's step outgrows what its binding reserved (clusters %u of %u, retrieved %u of %u, "
                     "tokens a run %u of %u): unbind and bind again",
                     c.layer, z.max_clusters, rs.max_clusters, max_ret, rs.max_ret, pd.max_run_tokens, rs.max_run);
  try {
    c.run_heads.assign(pd.run_heads.begin(), pd.run_heads.end());
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory preparing a step");
  }
  c.want_units = pd.want_units;
  c.retrieved = z.retrieved;
  c.estimated = z.estimated;
  kernels::StageSlot head;
  head.q = c.q;
  head.q_seq_stride = c.q_seq_stride;
  head.q_head_stride = c.q_head_stride;
  head.n_runs = z.R;
  head.n_seqs = plan.n_seqs;
  std::memcpy(body, &head, sizeof head);
  std::memcpy(body + sizeof head, pd.host_runs.data(), size_t(z.R) * sizeof(kernels::DevRun));
  return Status::ok();
}

void CudaBackend::seal_decode(Plan &plan, BoundCallState &c, uint64_t epoch, uint8_t *body) {
  const StepRecord rec = open_step_record(plan, epoch, c.run_heads.data(), static_cast<uint32_t>(c.run_heads.size()),
                                          c.want_units, c.layer);
  const kernels::StepVars v = step_vars(epoch, rec, c.out, c.out_seq_stride, c.out_head_stride);
  std::memcpy(body + offsetof(kernels::StageSlot, vars), &v, sizeof v);
}

}  // namespace

Status make_cuda_backend(Engine &engine, std::unique_ptr<Backend> *out, HostArena::Options *arena_opts) {
  auto b = std::make_unique<CudaBackend>(engine);
  WKV_RETURN_IF_ERROR(b->init(arena_opts));
  *out = std::move(b);
  return Status::ok();
}

}  // namespace wkv

#endif  // WKV_WITH_CUDA
