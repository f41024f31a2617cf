// The CUDA backend: the meta index, the mapping-table mirror and the steady
// zone live on the device; pages live in pinned, mapped host arenas and, when
// hot, in the shared device block cache. A decoding step (lookup, assemble,
// attend, update) is enqueued on the caller's stream with no host wait; the
// buffer manager runs on its own thread and side stream.
//
// Lock order: growth_mu_, cache_mu_, then mu_. None is held while calling
// into the engine or a sequence.
// - growth_mu_ (the k-means workspace and outputs, km_*, which every
//   sequence's index growth uses) is held by a growth from its k-means to
//   its last enqueue; the next growth's stream then waits for km_done_, the
//   event recorded after the last one's device reads of those buffers.
// - mu_ (the in-flight epochs, the manager queue and record pool, every
//   HeadShared) is taken by the decoding path, so it is held only for a few
//   bookkeeping instructions, never across a device wait or a walk over a
//   step's pages.
// - cache_mu_ (the block cache and its slot owners) is held by the manager
//   while it processes a step, from choosing the step's copies until they
//   completed on the side stream, and by whoever frees or moves what those
//   copies write (a sequence's destruction, a page table's growth), so a
//   HeadShared is stable under either lock.
// A sequence's own state takes neither: its appends and decodes are ordered
// on one stream (or by the caller).
#if defined(WKV_WITH_CUDA)

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "kernels/attention_cuda.hpp"
#include "kernels/gather_cuda.hpp"
#include "kernels/kmeans_cuda.hpp"
#include "kernels/lookup_cuda.hpp"
#include "kernels/table_cuda.hpp"
#include "lib/backend/cuda/device_state.hpp"
#include "lib/buffer/block_cache.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"

namespace wkv {

Status cuda_error(cudaError_t err, const char *stmt, const char *file, int line) {
  // Consumed here, so that a later launch check does not report it again
  // (the engine stays usable after, say, a failed allocation).
  (void)cudaGetLastError();
  int code = err == cudaErrorMemoryAllocation ? WKV_ERR_OUT_OF_MEMORY : WKV_ERR_DEVICE;
  return Status(code, format("CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(err),
                             cudaGetErrorString(err), stmt, file, line));
}

DevBuf::~DevBuf() {
  if (p_) cudaFree(p_);
}

Status DevBuf::reserve(size_t bytes, size_t keep, cudaStream_t s) {
  if (bytes <= cap_) return Status::ok();
  size_t n = std::max(bytes, cap_ + cap_ / 2);
  n = (n + 255) & ~size_t{255};
  void *q = nullptr;
  WKV_CU(cudaMallocAsync(&q, n, s));
  if (p_ && keep) {
    cudaError_t e = cudaMemcpyAsync(q, p_, std::min(keep, cap_), cudaMemcpyDeviceToDevice, s);
    if (e != cudaSuccess) {
      cudaFreeAsync(q, s);
      return cuda_error(e, "cudaMemcpyAsync(grow)", __FILE__, __LINE__);
    }
  }
  if (p_) cudaFreeAsync(p_, s);
  p_ = q;
  cap_ = n;
  return Status::ok();
}

Status PinnedBuf::reserve(size_t bytes) {
  if (bytes <= cap_) return Status::ok();
  const size_t n = std::max(bytes, cap_ + cap_ / 2);
  void *q = nullptr;
  WKV_CU(cudaHostAlloc(&q, n, cudaHostAllocDefault));
  if (p_) cudaFreeHost(p_);
  p_ = q;
  cap_ = n;
  return Status::ok();
}

Status EventPair::create() {
  if (!begin) WKV_CU(cudaEventCreate(&begin));
  if (!end) WKV_CU(cudaEventCreate(&end));
  return Status::ok();
}

bool cuda_device_usable(int device_id) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
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

// One step's access record, handed from wkv_update to the manager thread.
struct AccessRecord {
  uint64_t epoch = 0;
  cudaEvent_t event = nullptr;  // recorded on the caller's stream after the step
  uint32_t *ids = nullptr;      // pinned: the retrieval ids of all runs
  uint32_t ids_cap = 0;
  struct Run {
    std::shared_ptr<HeadShared> head;
    std::shared_ptr<const HeadClusters> clusters;
    uint32_t ret_off, n_ret;
  };
  std::vector<Run> runs;
  bool end_only = false;  // only ends the epoch (a step that was never updated)
};

// A slot of the device cache: whose page it holds.
struct SlotOwner {
  std::weak_ptr<HeadShared> head;
  uint32_t page = 0;
  const uint8_t *host = nullptr;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(Engine &e) : e_(e) {}
  ~CudaBackend() override;
  Status init(HostArena::Options *ao);

  uint32_t device() const override { return WKV_DEVICE_CUDA; }
  Status append(Sequence &seq, uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                int64_t token_stride, int64_t head_stride, void *stream) override;
  Status finish_prompt(Sequence &seq, uint32_t layer, void *stream) override;
  void on_destroy(Sequence &seq) override;
  Status lookup(Plan &plan) override;
  Status assemble(Plan &plan) override;
  Status attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) override;
  Status merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
               int64_t lse_seq_stride) override;
  Status update(Plan &plan) override;
  void fill_stats(wkv_stats *out) override;
  void xbuf(const Plan &plan, wkv_xbuf_view *view) override {
    // The exact token count is offsets[n_runs] on the device; the host knows
    // the capacity, which bounds it.
    const PlanDevice &pd = *static_cast<const PlanDevice *>(plan.dev.get());
    view->n_runs = static_cast<uint32_t>(plan.runs.size());
    view->n_tokens = pd.xbuf_tokens_bound;
    view->k = pd.xk.get();
    view->v = pd.xv.get();
    view->offsets = pd.offsets.as<int32_t>();
  }

 private:
  DeviceHead &dev_head(Sequence &seq, uint32_t layer, uint32_t head);
  Status cluster_front(Sequence &seq, uint32_t layer, uint32_t count, uint32_t seg_tokens,
                       uint32_t last_tokens, bool generated, cudaStream_t s);
  PlanDevice &plan_dev(Plan &plan);
  Status end_open_epoch(PlanDevice &pd, cudaStream_t s);
  void manager_loop();
  void process(AccessRecord &rec);
  Status check_pointer(const void *p, const char *what);
  Status check_stream(void *stream);

  Engine &e_;
  int dev_ = 0;
  cudaStream_t side_ = nullptr;
  uint8_t *cache_base_ = nullptr;
  size_t slot_bytes_ = 0, cache_bytes_ = 0;
  unsigned long long *d_counters_ = nullptr;  // [0] hits, [1] misses, in pages
  DevBuf km_ws_, km_n_, km_begin_, km_order_, km_size_, km_cent_, km_vsum_;  // k-means, grow only
  PinnedBuf km_host_;    // the k-means results read back, grow only
  EventPair km_events_;  // the k-means's device time
  std::mutex growth_mu_;  // one index growth at a time (lock order above)
  cudaEvent_t km_done_ = nullptr;  // after the last growth's reads of km_*

  std::mutex cache_mu_;  // guards the cache state below (lock order above)
  std::unique_ptr<BlockCache> cache_;
  std::vector<SlotOwner> slot_owner_;
  std::atomic<uint64_t> admissions_{0}, evictions_{0};  // written under cache_mu_, read by stats

  std::mutex mu_;  // guards everything below
  std::multiset<uint64_t> inflight_;
  std::deque<AccessRecord> queue_;
  std::vector<AccessRecord> record_pool_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool processing_ = false;  // the manager holds a step's record taken from queue_
  bool captured_ = false;  // a step was captured in a graph: never evict
  std::thread manager_;

  std::atomic<uint64_t> epoch_{0};
};

// 1. Set-up -------------------------------------------------------------------

Status CudaBackend::init(HostArena::Options *ao) {
  const Config &cfg = e_.config();
  dev_ = cfg.c.device_id;
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || dev_ < 0 || dev_ >= n) {
    cudaGetLastError();
    return WKV_ERROR(WKV_ERR_NO_DEVICE, "no usable CUDA device %d (%d found%s%s)", dev_, err == cudaSuccess ? n : 0,
                     err == cudaSuccess ? "" : ": ", err == cudaSuccess ? "" : cudaGetErrorString(err));
  }
  WKV_CU(cudaSetDevice(dev_));
  char bus[32] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, dev_) == cudaSuccess) {
    for (char &c : bus) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (!(cfg.c.flags & WKV_CONFIG_NO_NUMA)) ao->numa_node = numa_node_of_pci(bus);
  }
  // Pages are pinned and mapped so that the copy kernel reads them over PCIe;
  // pageable memory is the switchable fallback (admissions only, slower).
  if (!(cfg.c.flags & WKV_CONFIG_NO_PINNED)) {
    int dev = dev_;
    ao->on_register = [dev](void *base, size_t bytes) -> Status {
      cudaSetDevice(dev);
      WKV_CU(cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
      return Status::ok();
    };
    ao->on_unregister = [dev](void *base, size_t) {
      cudaSetDevice(dev);
      cudaHostUnregister(base);
    };
  }
  WKV_CU(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  WKV_CU(cudaMalloc(&d_counters_, 2 * sizeof(unsigned long long)));
  WKV_CU(cudaMemset(d_counters_, 0, 2 * sizeof(unsigned long long)));

  // The shared block cache: device_cache_bytes, or 5% of the device's memory
  // while the KV held is unknown at open time (the DESIGN's 5% of KV held).
  slot_bytes_ = cfg.page_slot_bytes();
  size_t want = cfg.c.device_cache_bytes;
  if (want == 0) {
    size_t free_b = 0, total_b = 0;
    WKV_CU(cudaMemGetInfo(&free_b, &total_b));
    want = total_b / 20;
  }
  uint32_t slots = static_cast<uint32_t>(std::min<size_t>(want / slot_bytes_, 1u << 30));
  cache_bytes_ = static_cast<size_t>(slots) * slot_bytes_;
  if (slots > 0) WKV_CU(cudaMalloc(&cache_base_, cache_bytes_));
  cache_ = std::make_unique<BlockCache>(slots, std::make_unique<LruPolicy>(slots));
  slot_owner_.resize(slots);
  manager_ = std::thread([this] { manager_loop(); });
  return Status::ok();
}

CudaBackend::~CudaBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (manager_.joinable()) manager_.join();
  for (AccessRecord &r : record_pool_) {
    if (r.event) cudaEventDestroy(r.event);
    if (r.ids) cudaFreeHost(r.ids);
  }
  for (AccessRecord &r : queue_) {
    if (r.event) cudaEventDestroy(r.event);
    if (r.ids) cudaFreeHost(r.ids);
  }
  if (side_) cudaStreamDestroy(side_);
  if (km_done_) cudaEventDestroy(km_done_);
  if (cache_base_) cudaFree(cache_base_);
  if (d_counters_) cudaFree(d_counters_);
}

Status CudaBackend::check_stream(void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The default streams are the current device's, which every verb sets to
  // the engine's before it enqueues.
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return Status::ok();
  // Asking a capturing stream for its device invalidates the capture: a
  // stream being captured is taken as the caller's to vouch for.
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(s, &cap);
  if (err == cudaSuccess && cap != cudaStreamCaptureStatusNone) return Status::ok();
  int dev = -1;
  if (err == cudaSuccess) err = cudaStreamGetDevice(s, &dev);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "the stream is not one CUDA knows (%s)", cudaGetErrorString(err));
  }
  if (dev != dev_)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "the stream belongs to CUDA device %d, the engine to device %d", dev,
                     dev_);
  return Status::ok();
}

Status CudaBackend::check_pointer(const void *p, const char *what) {
  const size_t align = what[0] == 'l' ? sizeof(float) : dtype_bytes(e_.config().dtype());
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s (%p) is not aligned to its %zu-byte elements", what, p, align);
  cudaPointerAttributes a;
  cudaError_t err = cudaPointerGetAttributes(&a, p);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s is not a pointer CUDA knows", what);
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) {
    if (a.device != dev_)
      return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s is on CUDA device %d, the engine on device %d", what,
                       a.device, dev_);
    return Status::ok();
  }
  if (a.type == cudaMemoryTypeHost && a.devicePointer) return Status::ok();  // mapped host memory
  return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                   "%s is a host pointer; a CUDA engine needs device (or mapped) memory", what);
}

DeviceHead &CudaBackend::dev_head(Sequence &seq, uint32_t layer, uint32_t head) {
  HeadState &hs = seq.layer(layer).heads[head];
  if (!hs.dev) {
    auto dh = std::make_shared<DeviceHead>();
    dh->shared = std::make_shared<HeadShared>();
    dh->shared->seq_id = seq.id();
    dh->shared->layer_head = layer * e_.config().c.n_kv_heads + head;
    dh->shared->clusters = std::make_shared<HeadClusters>();
    hs.dev = dh;
  }
  return *static_cast<DeviceHead *>(hs.dev.get());
}

// 2. Appends and index growth --------------------------------------------------

Status CudaBackend::append(Sequence &seq, uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                           int64_t token_stride, int64_t head_stride, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WKV_RETURN_IF_ERROR(check_stream(stream));
  WKV_RETURN_IF_ERROR(check_pointer(k, "k"));
  WKV_RETURN_IF_ERROR(check_pointer(v, "v"));
  WKV_CU(cudaSetDevice(dev_));
  const Config &cfg = e_.config();
  LayerState &L = seq.layer(layer);
  const uint32_t sink = cfg.c.sink_tokens, H = cfg.c.n_kv_heads;
  const size_t row = cfg.row_bytes(), esz = dtype_bytes(cfg.dtype());
  const uint32_t to_sink = L.tokens < sink ? static_cast<uint32_t>(std::min<uint64_t>(sink - L.tokens, n)) : 0;
  const uint32_t to_tail = n - to_sink;

  // 1. Room and copies, per head (strided rows, device to device).
  for (uint32_t h = 0; h < H; ++h) {
    DeviceHead &dh = dev_head(seq, layer, h);
    WKV_RETURN_IF_ERROR(dh.sink_k.reserve((dh.sink_rows + to_sink) * row, dh.sink_rows * row, s));
    WKV_RETURN_IF_ERROR(dh.sink_v.reserve((dh.sink_rows + to_sink) * row, dh.sink_rows * row, s));
    WKV_RETURN_IF_ERROR(dh.tail_k.reserve((dh.tail_rows + to_tail) * row, dh.tail_rows * row, s));
    WKV_RETURN_IF_ERROR(dh.tail_v.reserve((dh.tail_rows + to_tail) * row, dh.tail_rows * row, s));
  }
  for (uint32_t h = 0; h < H; ++h) {
    DeviceHead &dh = dev_head(seq, layer, h);
    const size_t pitch = static_cast<size_t>(token_stride) * esz, hoff = static_cast<size_t>(h) * head_stride * esz;
    if (to_sink) {
      WKV_CU(cudaMemcpy2DAsync(dh.sink_k.as<uint8_t>() + dh.sink_rows * row, row, k + hoff, pitch, row, to_sink,
                               cudaMemcpyDefault, s));
      WKV_CU(cudaMemcpy2DAsync(dh.sink_v.as<uint8_t>() + dh.sink_rows * row, row, v + hoff, pitch, row, to_sink,
                               cudaMemcpyDefault, s));
    }
    if (to_tail) {
      const size_t skip = static_cast<size_t>(to_sink) * pitch;
      WKV_CU(cudaMemcpy2DAsync(dh.tail_k.as<uint8_t>() + dh.tail_rows * row, row, k + hoff + skip, pitch, row,
                               to_tail, cudaMemcpyDefault, s));
      WKV_CU(cudaMemcpy2DAsync(dh.tail_v.as<uint8_t>() + dh.tail_rows * row, row, v + hoff + skip, pitch, row,
                               to_tail, cudaMemcpyDefault, s));
    }
  }
  for (uint32_t h = 0; h < H; ++h) {
    DeviceHead &dh = dev_head(seq, layer, h);
    dh.sink_rows += to_sink;
    dh.tail_rows += to_tail;
  }
  if (L.tokens < sink) L.tail_begin = std::min<uint64_t>(sink, L.tokens + n);

  // 2. Cluster every complete segment beyond the window. A prompt's
  //    segments wait until kPromptBatchSegments per head are pending, so
  //    that a layer's prompt is clustered in one launch sequence (the end
  //    of the prompt clusters what waits): a batch of a few segments costs
  //    its rounds' latency, not its work. Segment boundaries and seeds do
  //    not depend on when a segment is clustered.
  const uint64_t tail = L.tokens + n - L.tail_begin;
  const uint32_t seg = L.generating ? cfg.c.update_segment_tokens : cfg.c.segment_tokens;
  const uint64_t ready = tail > cfg.c.window_tokens ? tail - cfg.c.window_tokens : 0;
  uint32_t count = static_cast<uint32_t>(ready / seg);
  if (!L.generating && count < kPromptBatchSegments) count = 0;
  if (count > 0) {
    Status st = cluster_front(seq, layer, count, seg, seg, L.generating, s);
    if (!st.is_ok()) {
      for (uint32_t h = 0; h < H; ++h) {
        DeviceHead &dh = dev_head(seq, layer, h);
        dh.sink_rows -= to_sink;
        dh.tail_rows -= to_tail;
      }
      if (L.tokens < sink) L.tail_begin = L.tokens;
      return st;
    }
  }
  L.tokens += n;
  L.version++;
  e_.counters().tokens.fetch_add(n);
  e_.counters().steady_rows.fetch_add(static_cast<uint64_t>(n) * H);
  if (count > 0) e_.counters().steady_rows.fetch_sub(static_cast<uint64_t>(count) * seg * H);
  return Status::ok();
}

Status CudaBackend::finish_prompt(Sequence &seq, uint32_t layer, void *stream) {
  LayerState &L = seq.layer(layer);
  if (L.generating) return Status::ok();
  WKV_RETURN_IF_ERROR(check_stream(stream));
  WKV_CU(cudaSetDevice(dev_));
  const Config &cfg = e_.config();
  const uint64_t tail = L.tokens - L.tail_begin;
  const uint64_t ready = tail > cfg.c.window_tokens ? tail - cfg.c.window_tokens : 0;
  if (ready > 0) {
    const uint32_t seg = cfg.c.segment_tokens;
    uint32_t count = static_cast<uint32_t>((ready + seg - 1) / seg);
    uint32_t last = static_cast<uint32_t>(ready - static_cast<uint64_t>(count - 1) * seg);
    WKV_RETURN_IF_ERROR(cluster_front(seq, layer, count, seg, last, false, static_cast<cudaStream_t>(stream)));
    e_.counters().steady_rows.fetch_sub(ready * L.heads.size());
  }
  L.generating = true;
  L.version++;
  return Status::ok();
}

// An index growth: k-means on the device for every (head, segment), then the
// host learns the cluster sizes (one wait: growths are off the per-step path),
// pages are allocated and written by the device straight into pinned host
// memory, and the device meta index and mirror are appended in place.
Status CudaBackend::cluster_front(Sequence &seq, uint32_t layer, uint32_t count, uint32_t seg_tokens,
                                  uint32_t last_tokens, bool generated, cudaStream_t s) {
  const Config &cfg = e_.config();
  LayerState &L = seq.layer(layer);
  const uint32_t H = cfg.c.n_kv_heads, d = cfg.c.head_dim, pt = cfg.page_tokens();
  const size_t row = cfg.row_bytes();
  const uint64_t consumed = static_cast<uint64_t>(count - 1) * seg_tokens + last_tokens;
  const uint32_t S = count * H;

  // 0. The k-means buffers are the engine's: one growth at a time, and this
  //    stream starts after the previous growth's reads of them.
  std::lock_guard<std::mutex> growth_lock(growth_mu_);
  if (!km_done_) {
    WKV_CU(cudaEventCreateWithFlags(&km_done_, cudaEventDisableTiming));
  } else {
    WKV_CU(cudaStreamWaitEvent(s, km_done_, 0));
  }
  struct RecordDone {  // at every exit: after the last enqueued read of km_*
    cudaEvent_t e;
    cudaStream_t s;
    ~RecordDone() { cudaEventRecord(e, s); }
  } record_done{km_done_, s};

  // 1. Describe the batch: segment i of head h is segs[h * count + i].
  std::vector<kernels::KMeansSegmentDesc> segs(S);
  std::vector<uint32_t> seg_row(S);  // first tail row of each segment
  for (uint32_t h = 0; h < H; ++h) {
    DeviceHead &dh = dev_head(seq, layer, h);
    uint32_t first = 0;
    for (uint32_t i = 0; i < count; ++i) {
      kernels::KMeansSegmentDesc &g = segs[h * count + i];
      g.tokens = i + 1 == count ? last_tokens : seg_tokens;
      g.keys = dh.tail_k.as<uint8_t>() + static_cast<size_t>(first) * row;
      g.values = dh.tail_v.as<uint8_t>() + static_cast<size_t>(first) * row;
      g.clusters = std::max<uint32_t>(1, (g.tokens + cfg.c.cluster_tokens - 1) / cfg.c.cluster_tokens);
      uint64_t z = cfg.c.seed ^ (static_cast<uint64_t>(layer) << 40) ^ (static_cast<uint64_t>(h) << 32) ^
                   (L.tail_begin + first);
      g.seed = z * 0x9e3779b97f4a7c15ull;
      seg_row[h * count + i] = first;
      first += g.tokens;
    }
  }
  kernels::KMeansBatchParams kp;
  kp.dtype = cfg.dtype();
  kp.head_dim = d;
  kp.iters = cfg.c.kmeans_iters;
  const kernels::KMeansBatchShape shape = kernels::kmeans_batch_shape(segs.data(), S);
  std::vector<uint64_t> tok_off(S), clu_off(S);
  kernels::kmeans_batch_offsets(segs.data(), S, tok_off.data(), clu_off.data());
  uint64_t sum_k = 0;
  for (const auto &g : segs) sum_k += std::min(g.clusters, g.tokens);

  // 2. Workspace and outputs (grow only), then cluster on the device.
  size_t ws_bytes = 0;
  WKV_RETURN_IF_ERROR(kernels::kmeans_batch_workspace_size(kp, shape, &ws_bytes));
  WKV_RETURN_IF_ERROR(km_ws_.reserve(ws_bytes, 0, s));
  WKV_RETURN_IF_ERROR(km_n_.reserve(S * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(km_begin_.reserve((sum_k + S) * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(km_order_.reserve(shape.total_tokens * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(km_size_.reserve(sum_k * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(km_cent_.reserve(sum_k * d * sizeof(float), 0, s));
  WKV_RETURN_IF_ERROR(km_vsum_.reserve(sum_k * d * sizeof(float), 0, s));
  kernels::KMeansBatchOut out;
  out.n_clusters = km_n_.as<uint32_t>();
  out.begin = km_begin_.as<uint32_t>();
  out.order = km_order_.as<uint32_t>();
  out.centroid = km_cent_.as<float>();
  out.value_sum = km_vsum_.as<float>();
  out.size = km_size_.as<uint32_t>();
  // The clustering's device time, between two events on the stream.
  WKV_RETURN_IF_ERROR(km_events_.create());
  WKV_CU(cudaEventRecord(km_events_.begin, s));
  WKV_RETURN_IF_ERROR(kernels::kmeans_batch_cuda(kp, segs.data(), S, out, km_ws_.get(), km_ws_.capacity(),
                                                 nullptr, s));
  WKV_CU(cudaEventRecord(km_events_.end, s));
  // 3. The one wait of a growth: the host needs the cluster counts, their
  //    first members and sizes for its mapping table. Centroids and value
  //    sums stay on the device, where the step reads them. Staged in pinned
  //    memory: [S] counts, [sum_k + S] begins, [sum_k] sizes. (Every growth
  //    waits for its own readback: none is in flight here.)
  WKV_RETURN_IF_ERROR(km_host_.reserve((S + (sum_k + S) + sum_k) * sizeof(uint32_t)));
  uint32_t *const n_clusters = km_host_.as<uint32_t>();
  uint32_t *const begin = n_clusters + S;
  uint32_t *const sizes = begin + sum_k + S;
  WKV_CU(cudaMemcpyAsync(n_clusters, out.n_clusters, S * sizeof(uint32_t), cudaMemcpyDeviceToHost, s));
  WKV_CU(cudaMemcpyAsync(begin, out.begin, (sum_k + S) * sizeof(uint32_t), cudaMemcpyDeviceToHost, s));
  WKV_CU(cudaMemcpyAsync(sizes, out.size, sum_k * sizeof(uint32_t), cudaMemcpyDeviceToHost, s));
  WKV_CU(cudaStreamSynchronize(s));
  float km_ms = 0.f;
  WKV_CU(cudaEventElapsedTime(&km_ms, km_events_.begin, km_events_.end));
  e_.counters().kmeans_ns.fetch_add(static_cast<uint64_t>(static_cast<double>(km_ms) * 1e6));

  // 4. Pages, all or nothing.
  std::vector<uint32_t> seg_pages(S), seg_first_page(S);
  uint32_t npages = 0;
  for (uint32_t i = 0; i < S; ++i) {
    seg_pages[i] = (segs[i].tokens + pt - 1) / pt;
    seg_first_page[i] = npages;
    npages += seg_pages[i];
  }
  std::vector<PageId> ids(npages);
  WKV_RETURN_IF_ERROR(e_.arena().allocate(npages, ids.data()));
  auto give_back = [&] { e_.arena().release(ids.data(), npages); };

  // 5. Room for the growth on every head before any head changes, so that a
  //    failure (device or host memory) leaves the layer as it was: device
  //    arrays grow in place (contents kept), the host tables are built as
  //    copies, and each head's shortened tail gets its new buffer.
  struct HeadGrowth {
    uint32_t add_c = 0, add_p = 0;
    std::vector<const uint8_t *> page_ptrs;
    std::vector<uint32_t> first_slots;
    std::shared_ptr<HeadClusters> clusters;
    DevBuf tail_k, tail_v;
  };
  std::vector<HeadGrowth> grow(H);
  for (uint32_t h = 0; h < H; ++h) {
    DeviceHead &dh = dev_head(seq, layer, h);
    HeadIndex &ix = L.heads[h].index;
    HeadGrowth &g = grow[h];
    for (uint32_t i = 0; i < count; ++i) {
      g.add_c += n_clusters[h * count + i];
      g.add_p += seg_pages[h * count + i];
    }
    const uint32_t C0 = dh.clusters, P0 = dh.n_pages;
    Status st = dh.centroid.reserve((C0 + g.add_c) * d * sizeof(float), C0 * d * sizeof(float), s);
    if (st.is_ok()) st = dh.value_sum.reserve((C0 + g.add_c) * d * sizeof(float), C0 * d * sizeof(float), s);
    if (st.is_ok()) st = dh.size.reserve((C0 + g.add_c) * sizeof(uint32_t), C0 * sizeof(uint32_t), s);
    if (st.is_ok()) st = dh.first_slot.reserve((C0 + g.add_c) * sizeof(uint32_t), C0 * sizeof(uint32_t), s);
    if (st.is_ok() && (P0 + g.add_p) * sizeof(void *) > dh.pages.capacity()) {
      // The manager writes into the page table: drain it, then move the
      // table in stream order and make the side stream wait for the move.
      std::lock_guard<std::mutex> cache_lock(cache_mu_);
      cudaStreamSynchronize(side_);
      st = dh.pages.reserve((P0 + g.add_p) * sizeof(void *), P0 * sizeof(void *), s);
      if (st.is_ok()) {
        cudaEvent_t moved;
        if (cudaEventCreateWithFlags(&moved, cudaEventDisableTiming) == cudaSuccess) {
          cudaEventRecord(moved, s);
          cudaStreamWaitEvent(side_, moved, 0);
          cudaEventDestroy(moved);
        }
        std::lock_guard<std::mutex> lock(mu_);
        dh.shared->d_pages = dh.pages.as<const uint8_t *>();
      }
    }
    // The tail's front will be consumed: the rest moves to the start of a
    // new buffer that holds what a generating sequence gathers before its
    // next growth (the window and an update segment), not the prompt's
    // size: later prompt chunks grow it.
    const size_t rest = dh.tail_rows - consumed;
    const size_t tail_cap = std::max<size_t>(rest, cfg.c.window_tokens + cfg.c.update_segment_tokens + 1) * row;
    if (st.is_ok()) st = g.tail_k.reserve(tail_cap, 0, s);
    if (st.is_ok()) st = g.tail_v.reserve(tail_cap, 0, s);
    if (st.is_ok()) {
      // Host tables sized once: a growth appends tens of thousands of entries.
      try {
        g.page_ptrs.reserve(g.add_p);
        g.first_slots.reserve(g.add_c);
        g.clusters = std::make_shared<HeadClusters>();
        const HeadClusters &prev = *dh.shared->clusters;
        g.clusters->pages.reserve(P0 + g.add_p);
        g.clusters->first_slot.reserve(C0 + g.add_c);
        g.clusters->size.reserve(C0 + g.add_c);
        g.clusters->pages = prev.pages;
        g.clusters->first_slot = prev.first_slot;
        g.clusters->size = prev.size;
        ix.pages.reserve(ix.pages.size() + g.add_p);
        ix.map.reserve(ix.map.size() + g.add_c);
        ix.meta.size.reserve(ix.meta.size.size() + g.add_c);
        ix.segments.reserve(ix.segments.size() + count);
      } catch (const std::bad_alloc &) {
        st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for the mapping table of a growth");
      }
    }
    if (!st.is_ok()) {
      for (HeadGrowth &r : grow) {
        r.tail_k.release_async(s);
        r.tail_v.release_async(s);
      }
      give_back();
      return st;
    }
  }

  // 6. Per head: append meta and mirror, write pages, shorten the tail. From
  //    here only a failed launch (a broken device) can fail.
  uint64_t new_clusters = 0;
  for (uint32_t h = 0; h < H; ++h) {
    DeviceHead &dh = dev_head(seq, layer, h);
    HeadIndex &ix = L.heads[h].index;
    HeadGrowth &g = grow[h];
    const uint32_t C0 = dh.clusters, P0 = dh.n_pages;
    uint32_t p = P0, c = C0;
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t si = h * count + i;
      const uint32_t nc = n_clusters[si];
      const uint64_t co = clu_off[si];
      for (uint32_t j = 0; j < seg_pages[si]; ++j) {
        PageId id = ids[seg_first_page[si] + j];
        g.page_ptrs.push_back(e_.arena().page_ptr(id));
        ix.pages.push_back(id);
        g.clusters->pages.push_back(id);
      }
      const uint32_t *b = begin + co + si;
      for (uint32_t q = 0; q < nc; ++q) {
        const uint32_t sz = sizes[co + q];
        ClusterDesc desc{};
        desc.page = p + b[q] / pt;
        desc.offset = static_cast<uint16_t>(b[q] % pt);
        desc.tier = Tier::kHost;
        desc.size = sz;
        ix.map.push_back(desc);
        ix.meta.size.push_back(sz);
        g.first_slots.push_back(p * pt + b[q]);
        g.clusters->first_slot.push_back(p * pt + b[q]);
        g.clusters->size.push_back(sz);
        dh.max_cluster = std::max(dh.max_cluster, sz);
      }
      SegmentDesc sd{};
      sd.token_begin = L.tail_begin + seg_row[si];
      sd.tokens = segs[si].tokens;
      sd.cluster_begin = c;
      sd.clusters = nc;
      sd.page_begin = p;
      sd.pages = seg_pages[si];
      sd.generated = generated ? 1 : 0;
      ix.segments.push_back(sd);
      WKV_CU(cudaMemcpyAsync(dh.centroid.as<float>() + static_cast<size_t>(c) * d, out.centroid + co * d,
                             static_cast<size_t>(nc) * d * sizeof(float), cudaMemcpyDeviceToDevice, s));
      WKV_CU(cudaMemcpyAsync(dh.value_sum.as<float>() + static_cast<size_t>(c) * d, out.value_sum + co * d,
                             static_cast<size_t>(nc) * d * sizeof(float), cudaMemcpyDeviceToDevice, s));
      WKV_CU(cudaMemcpyAsync(dh.size.as<uint32_t>() + c, out.size + co, nc * sizeof(uint32_t),
                             cudaMemcpyDeviceToDevice, s));
      p += seg_pages[si];
      c += nc;
    }
    // The new entries of the page table: nothing reads them before the
    // clusters are published below, and the manager writes only older ones.
    WKV_CU(cudaMemcpyAsync(dh.pages.as<const uint8_t *>() + P0, g.page_ptrs.data(), g.add_p * sizeof(void *),
                           cudaMemcpyHostToDevice, s));
    WKV_CU(cudaMemcpyAsync(dh.first_slot.as<uint32_t>() + C0, g.first_slots.data(),
                           g.first_slots.size() * sizeof(uint32_t), cudaMemcpyHostToDevice, s));
    uint32_t pp = P0;
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t si = h * count + i;
      kernels::WritePagesJob job;
      job.order = out.order + tok_off[si];
      job.k = static_cast<const uint8_t *>(segs[si].keys);
      job.v = static_cast<const uint8_t *>(segs[si].values);
      job.pages = dh.pages.as<uint8_t *>() + pp;
      job.tokens = segs[si].tokens;
      WKV_RETURN_IF_ERROR(kernels::write_pages_cuda(job, static_cast<uint32_t>(row), pt, s));
      pp += seg_pages[si];
    }
    dh.clusters = c;
    dh.n_pages = p;
    dh.clustered_tokens += consumed;
    new_clusters += c - C0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dh.shared->clusters = std::move(g.clusters);
    }
    // The rest of the tail to its new buffer (the regions may overlap); the
    // old one is freed in stream order after the page writes that read it.
    const uint32_t rest = dh.tail_rows - static_cast<uint32_t>(consumed);
    if (rest) {
      WKV_CU(cudaMemcpyAsync(g.tail_k.get(), dh.tail_k.as<uint8_t>() + consumed * row, rest * row,
                             cudaMemcpyDeviceToDevice, s));
      WKV_CU(cudaMemcpyAsync(g.tail_v.get(), dh.tail_v.as<uint8_t>() + consumed * row, rest * row,
                             cudaMemcpyDeviceToDevice, s));
    }
    dh.tail_k.swap(g.tail_k);
    dh.tail_v.swap(g.tail_v);
    g.tail_k.release_async(s);
    g.tail_v.release_async(s);
    dh.tail_rows = rest;
  }
  // page_ptrs and first_slots above were read by pageable copies, which
  // return once staged: nothing on the host is still in use by the stream.
  L.tail_begin += consumed;
  e_.counters().segments.fetch_add(S);
  e_.counters().clusters.fetch_add(new_clusters);
  return Status::ok();
}

void CudaBackend::on_destroy(Sequence &seq) {
  cudaSetDevice(dev_);
  // Steps in flight may still read this sequence's memory.
  cudaDeviceSynchronize();
  std::lock_guard<std::mutex> cache_lock(cache_mu_);
  cudaStreamSynchronize(side_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t l = 0; l < seq.n_layers(); ++l)
      for (HeadState &hs : seq.layer(l).heads)
        if (hs.dev) static_cast<DeviceHead *>(hs.dev.get())->shared->dead = true;
  }
  std::vector<uint32_t> dropped = cache_->drop_sequence(seq.id(), epoch_.load());
  for (uint32_t sl : dropped) slot_owner_[sl] = SlotOwner{};
}

// 3. The decoding step -------------------------------------------------------------

kernels::DevLookup lookup_view(PlanDevice &pd) {
  kernels::DevLookup lk;
  lk.ret_ids = pd.ret_ids.as<uint32_t>();
  lk.ret_pos = pd.ret_pos.as<uint32_t>();
  lk.est_ids = pd.est_ids.as<uint32_t>();
  lk.run_tokens = pd.run_tokens.as<uint32_t>();
  lk.est_out = pd.est_out.as<float>();
  lk.est_lse = pd.est_lse.as<float>();
  lk.offsets = pd.offsets.as<int32_t>();
  lk.logits = pd.logits.as<float>();
  return lk;
}

PlanDevice &CudaBackend::plan_dev(Plan &plan) {
  if (!plan.dev) plan.dev = std::make_shared<PlanDevice>();
  return *static_cast<PlanDevice *>(plan.dev.get());
}

Status CudaBackend::end_open_epoch(PlanDevice &pd, cudaStream_t s) {
  if (pd.open_epoch == 0) return Status::ok();
  // The plan's previous step was never updated: end it in stream order.
  AccessRecord rec;
  WKV_CU(cudaEventCreateWithFlags(&rec.event, cudaEventDisableTiming));
  WKV_CU(cudaEventRecord(rec.event, s));
  rec.epoch = pd.open_epoch;
  rec.end_only = true;
  pd.open_epoch = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(rec));
  }
  cv_.notify_one();
  return Status::ok();
}

Status CudaBackend::lookup(Plan &plan) {
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  WKV_RETURN_IF_ERROR(check_stream(plan.stream));
  WKV_CU(cudaSetDevice(dev_));
  WKV_RETURN_IF_ERROR(check_pointer(plan.q_src, "q"));
  const Config &cfg = e_.config();
  const uint32_t d = cfg.c.head_dim, G = cfg.group(), nq = cfg.c.n_q_heads;
  PlanDevice &pd = plan_dev(plan);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  WKV_CU(cudaStreamIsCapturing(s, &cap));
  if (cap == cudaStreamCaptureStatusNone) WKV_RETURN_IF_ERROR(end_open_epoch(pd, s));

  // 1. The runs, their zone sizes and the bounds that size the buffers.
  const uint32_t R = static_cast<uint32_t>(plan.runs.size());
  pd.host_runs.resize(R);
  uint64_t xbuf = 0;
  uint32_t max_run = 0;
  size_t ret = 0, est = 0, lg = 0;
  for (uint32_t r = 0; r < R; ++r) {
    RunPlan &rp = plan.runs[r];
    DeviceHead &dh = dev_head(*plan.seqs[rp.seq], plan.layer, rp.head);
    kernels::DevRun &dr = pd.host_runs[r];
    dr.centroid = dh.centroid.as<float>();
    dr.value_sum = dh.value_sum.as<float>();
    dr.size = dh.size.as<uint32_t>();
    dr.first_slot = dh.first_slot.as<uint32_t>();
    dr.pages = dh.pages.as<const uint8_t *const>();
    dr.sink_k = dh.sink_k.as<uint8_t>();
    dr.sink_v = dh.sink_v.as<uint8_t>();
    dr.tail_k = dh.tail_k.as<uint8_t>();
    dr.tail_v = dh.tail_v.as<uint8_t>();
    dr.clusters = dh.clusters;
    dr.n_ret = rp.n_ret;
    dr.n_est = rp.n_est;
    dr.sink_tokens = dh.sink_rows;
    dr.tail_tokens = dh.tail_rows;
    dr.ret_off = static_cast<uint32_t>(ret);
    dr.est_off = static_cast<uint32_t>(est);
    dr.scratch_off = static_cast<uint32_t>(lg);
    ret += rp.n_ret;
    est += rp.n_est;
    lg += static_cast<size_t>(G) * dh.clusters;
    const uint64_t clustered = dh.clustered_tokens;
    const uint64_t bound = dh.sink_rows + dh.tail_rows +
                           std::min<uint64_t>(static_cast<uint64_t>(rp.n_ret) * dh.max_cluster, clustered);
    xbuf += bound;
    max_run = std::max<uint32_t>(max_run, static_cast<uint32_t>(bound));
  }
  if (xbuf > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
    return WKV_ERROR(WKV_ERR_BUDGET, "execution buffer would exceed 2^31 tokens");
  pd.total_ret = static_cast<uint32_t>(ret);
  pd.total_est = static_cast<uint32_t>(est);
  pd.logits_floats = lg;
  pd.xbuf_tokens_bound = xbuf;
  pd.max_run_tokens = max_run;

  // 2. Buffers (grow only).
  const size_t row = cfg.row_bytes();
  WKV_RETURN_IF_ERROR(pd.runs.reserve(R * sizeof(kernels::DevRun), 0, s));
  WKV_RETURN_IF_ERROR(pd.q.reserve(static_cast<size_t>(plan.n_seqs) * nq * d * sizeof(float), 0, s));
  WKV_RETURN_IF_ERROR(pd.ret_ids.reserve(std::max<size_t>(ret, 1) * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(pd.ret_pos.reserve(std::max<size_t>(ret, 1) * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(pd.est_ids.reserve(std::max<size_t>(est, 1) * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(pd.run_tokens.reserve(R * sizeof(uint32_t), 0, s));
  WKV_RETURN_IF_ERROR(pd.est_out.reserve(static_cast<size_t>(R) * G * d * sizeof(float), 0, s));
  WKV_RETURN_IF_ERROR(pd.est_lse.reserve(static_cast<size_t>(R) * G * sizeof(float), 0, s));
  WKV_RETURN_IF_ERROR(pd.offsets.reserve((R + 1) * sizeof(int32_t), 0, s));
  WKV_RETURN_IF_ERROR(pd.logits.reserve(std::max<size_t>(lg, 1) * 2 * sizeof(float), 0, s));
  WKV_RETURN_IF_ERROR(pd.xk.reserve(std::max<uint64_t>(xbuf, 1) * row, 0, s));
  WKV_RETURN_IF_ERROR(pd.xv.reserve(std::max<uint64_t>(xbuf, 1) * row, 0, s));

  // 3. Enqueue: the query in f32, the run table, then scoring, selection
  //    and estimation.
  WKV_RETURN_IF_ERROR(kernels::convert_q(cfg.dtype(), plan.q_src, plan.q_seq_stride, plan.q_head_stride,
                                         plan.n_seqs, nq, d, pd.q.as<float>(), s));
  WKV_RETURN_IF_ERROR(kernels::upload_runs(pd.host_runs.data(), R, pd.runs.as<kernels::DevRun>(), s));
  kernels::DevLookup lk = lookup_view(pd);
  uint32_t max_clusters = 0;
  for (const kernels::DevRun &dr : pd.host_runs) max_clusters = std::max(max_clusters, dr.clusters);
  WKV_RETURN_IF_ERROR(kernels::lookup_zones(pd.runs.as<kernels::DevRun>(), R, G, d, cfg.scale(), pd.q.as<float>(),
                                            lk, pd.logits.as<float>() + lg, max_clusters, s));

  // 4. The step is in flight from now until its update completes.
  if (cap == cudaStreamCaptureStatusNone) {
    pd.open_epoch = plan.epoch + 1ull;  // epochs start at 1 in the manager
    std::lock_guard<std::mutex> lock(mu_);
    inflight_.insert(pd.open_epoch);
    epoch_.store(std::max<uint64_t>(epoch_.load(), pd.open_epoch));
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    captured_ = true;
  }
  for (const RunPlan &rp : plan.runs) {
    e_.counters().retrieved_clusters.fetch_add(rp.n_ret);
    e_.counters().estimated_clusters.fetch_add(rp.n_est);
  }
  return Status::ok();
}

Status CudaBackend::assemble(Plan &plan) {
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  WKV_RETURN_IF_ERROR(check_stream(plan.stream));
  WKV_CU(cudaSetDevice(dev_));
  const Config &cfg = e_.config();
  PlanDevice &pd = plan_dev(plan);
  const uint32_t R = static_cast<uint32_t>(plan.runs.size());
  kernels::GatherArgs a;
  a.runs = pd.runs.as<kernels::DevRun>();
  a.n_runs = R;
  a.lookup = lookup_view(pd);
  a.max_ret = 0;
  for (const RunPlan &rp : plan.runs) a.max_ret = std::max(a.max_ret, rp.n_ret);
  a.row_bytes = cfg.row_bytes();
  a.page_tokens = cfg.page_tokens();
  a.xk = pd.xk.as<uint8_t>();
  a.xv = pd.xv.as<uint8_t>();
  a.cache_base = cache_base_;
  a.cache_bytes = cache_bytes_;
  a.counters = d_counters_;
  return kernels::gather_cuda(a, s);
}

Status CudaBackend::attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse) {
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  WKV_RETURN_IF_ERROR(check_stream(plan.stream));
  WKV_CU(cudaSetDevice(dev_));
  WKV_RETURN_IF_ERROR(check_pointer(out, "out"));
  if (lse) WKV_RETURN_IF_ERROR(check_pointer(lse, "lse"));
  const Config &cfg = e_.config();
  PlanDevice &pd = plan_dev(plan);
  const uint32_t R = static_cast<uint32_t>(plan.runs.size());
  const size_t sf = kernels::attend_ragged_scratch_floats(R, cfg.group(), cfg.c.head_dim, pd.max_run_tokens);
  WKV_RETURN_IF_ERROR(pd.scratch.reserve(sf * sizeof(float), 0, s));
  return kernels::attend_ragged(cfg.dtype(), pd.offsets.as<int32_t>(), pd.xk.get(), pd.xv.get(), pd.q.as<float>(), R,
                                cfg.c.n_kv_heads, cfg.group(), cfg.c.head_dim, cfg.scale(), pd.max_run_tokens,
                                pd.est_out.as<float>(), pd.est_lse.as<float>(), out, seq_stride, head_stride, lse,
                                pd.scratch.as<float>(), pd.scratch.capacity() / sizeof(float), s);
}

Status CudaBackend::merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                          int64_t lse_seq_stride) {
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  WKV_RETURN_IF_ERROR(check_stream(plan.stream));
  WKV_CU(cudaSetDevice(dev_));
  WKV_RETURN_IF_ERROR(check_pointer(out, "out"));
  WKV_RETURN_IF_ERROR(check_pointer(lse, "lse"));
  const Config &cfg = e_.config();
  PlanDevice &pd = plan_dev(plan);
  return kernels::merge_estimate(cfg.dtype(), out, seq_stride, head_stride, lse, lse_seq_stride,
                                 pd.est_out.as<float>(), pd.est_lse.as<float>(), plan.n_seqs, cfg.c.n_q_heads,
                                 cfg.c.head_dim, s);
}

// 4. The access record and the buffer manager ---------------------------------------

Status CudaBackend::update(Plan &plan) {
  cudaStream_t s = static_cast<cudaStream_t>(plan.stream);
  WKV_RETURN_IF_ERROR(check_stream(plan.stream));
  PlanDevice &pd = plan_dev(plan);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  WKV_CU(cudaStreamIsCapturing(s, &cap));
  // A captured step is replayed without the host: the manager cannot see
  // its accesses, so a replay only reads the cache as it is.
  if (cap != cudaStreamCaptureStatusNone || pd.open_epoch == 0) return Status::ok();
  AccessRecord rec;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!record_pool_.empty()) {
      rec = std::move(record_pool_.back());
      record_pool_.pop_back();
    }
  }
  if (!rec.event) WKV_CU(cudaEventCreateWithFlags(&rec.event, cudaEventDisableTiming));
  if (rec.ids_cap < pd.total_ret) {
    if (rec.ids) cudaFreeHost(rec.ids);
    rec.ids = nullptr;
    uint32_t cap_ids = std::max<uint32_t>(pd.total_ret, rec.ids_cap * 2);
    WKV_CU(cudaHostAlloc(reinterpret_cast<void **>(&rec.ids), cap_ids * sizeof(uint32_t), cudaHostAllocDefault));
    rec.ids_cap = cap_ids;
  }
  if (pd.total_ret)
    WKV_CU(cudaMemcpyAsync(rec.ids, pd.ret_ids.get(), pd.total_ret * sizeof(uint32_t), cudaMemcpyDeviceToHost, s));
  WKV_CU(cudaEventRecord(rec.event, s));
  rec.epoch = pd.open_epoch;
  rec.end_only = false;
  rec.runs.clear();
  for (uint32_t r = 0; r < plan.runs.size(); ++r) {
    const RunPlan &rp = plan.runs[r];
    DeviceHead &dh = dev_head(*plan.seqs[rp.seq], plan.layer, rp.head);
    std::shared_ptr<const HeadClusters> snap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      snap = dh.shared->clusters;
    }
    rec.runs.push_back({dh.shared, std::move(snap), pd.host_runs[r].ret_off, rp.n_ret});
  }
  pd.open_epoch = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(rec));
  }
  cv_.notify_one();
  return Status::ok();
}

void CudaBackend::manager_loop() {
  cudaSetDevice(dev_);
  for (;;) {
    AccessRecord rec;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      rec = std::move(queue_.front());
      queue_.pop_front();
      processing_ = !rec.end_only;
    }
    // The step's reads are done and its ids are in pinned memory once its
    // event completes: this thread waits, the caller's stream never does.
    cudaEventSynchronize(rec.event);
    process(rec);
    rec.runs.clear();
    std::lock_guard<std::mutex> lock(mu_);
    processing_ = false;
    if (rec.end_only) {
      cudaEventDestroy(rec.event);
      rec.event = nullptr;
    } else {
      record_pool_.push_back(std::move(rec));
    }
  }
}

void CudaBackend::process(AccessRecord &rec) {
  constexpr uint64_t kPending = std::numeric_limits<uint64_t>::max() - 1;
  const uint32_t pt = e_.config().page_tokens();
  std::vector<kernels::PtrStore> back, fwd;
  std::vector<kernels::PageCopy> copies;
  // Slots this call admits into, to their entries in copies and fwd. A step
  // can touch more pages than the cache holds, so a page admitted here can
  // be this call's victim too: its copy and mirror switch are then dropped
  // (the mirror still holds its host address). Restoring the host address
  // instead would be undone by the switch, which runs after the restores,
  // leaving the mirror on a quarantined slot that a later admission reuses.
  std::unordered_map<uint32_t, size_t> fresh;
  std::lock_guard<std::mutex> cache_lock(cache_mu_);
  // 1. Recency and admissions, in the order the step retrieved them.
  if (!rec.end_only) {
    for (const AccessRecord::Run &run : rec.runs) {
      if (run.head->dead || !run.head->d_pages) continue;
      const HeadClusters &hc = *run.clusters;
      for (uint32_t i = 0; i < run.n_ret; ++i) {
        uint32_t id = rec.ids[run.ret_off + i];
        if (id >= hc.size.size()) continue;
        uint32_t first = hc.first_slot[id], last = first + hc.size[id] - 1;
        for (uint32_t p = first / pt; p <= last / pt; ++p) {
          PageKey key{run.head->seq_id, run.head->layer_head, p};
          if (cache_->find(key, true) >= 0) continue;  // a hit: recency only
          BlockCache::Admission a = cache_->admit(key, kPending);
          if (a.evicted) {
            SlotOwner &o = slot_owner_[a.victim_slot];
            auto f = fresh.find(a.victim_slot);
            if (f != fresh.end()) {
              copies[f->second].dst = nullptr;  // dropped below
              fresh.erase(f);
            } else if (auto vh = o.head.lock(); vh && !vh->dead && vh->d_pages) {
              back.push_back({vh->d_pages + o.page, o.host});
            }
            o = SlotOwner{};
            ++evictions_;
          }
          if (a.slot < 0) continue;
          const uint8_t *host = e_.arena().page_ptr(hc.pages[p]);
          uint8_t *slot = cache_base_ + static_cast<size_t>(a.slot) * slot_bytes_;
          fresh[static_cast<uint32_t>(a.slot)] = copies.size();
          copies.push_back({host, slot});
          fwd.push_back({run.head->d_pages + p, slot});
          slot_owner_[a.slot] = SlotOwner{run.head, p, host};
          ++admissions_;
        }
      }
    }
  }
  // Drop the admissions this call evicted again (see `fresh`).
  size_t kept = 0;
  for (size_t i = 0; i < copies.size(); ++i)
    if (copies[i].dst) {
      copies[kept] = copies[i];
      fwd[kept] = fwd[i];
      ++kept;
    }
  copies.resize(kept);
  fwd.resize(kept);
  // 2. On the side stream, in order: evicted pages back to their host
  //    addresses, admitted pages copied in, then the mirror points at them.
  //    The mirror changes only after the copies: stream order, no waits.
  // A failure here leaves the mirror pointing at host pages, which is always
  // correct; it is reported in the stats as fewer hits, not as an error.
  Status st = kernels::apply_ptr_stores(back.data(), static_cast<uint32_t>(back.size()), side_);
  if (st.is_ok()) st = kernels::copy_pages(copies.data(), static_cast<uint32_t>(copies.size()),
                                           static_cast<uint32_t>(slot_bytes_), side_);
  if (st.is_ok()) st = kernels::apply_ptr_stores(fwd.data(), static_cast<uint32_t>(fwd.size()), side_);
  cudaStreamSynchronize(side_);
  // 3. Evicted slots are free once every step that could have seen them is
  //    done: steps looked up from now on read the switched mirror.
  //    A graph replay is not tracked, so once a step was captured evicted
  //    slots are never reused.
  uint64_t newest, oldest;
  bool captured;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = inflight_.find(rec.epoch);
    if (it != inflight_.end()) inflight_.erase(it);
    newest = epoch_.load();
    oldest = inflight_.empty() ? newest + 1 : *inflight_.begin();
    captured = captured_;
  }
  if (!captured) {
    cache_->restamp_quarantine(kPending, newest);
    cache_->release_quarantine(oldest);
  }
}

void CudaBackend::fill_stats(wkv_stats *out) {
  unsigned long long c[2] = {0, 0};
  cudaSetDevice(dev_);
  if (cudaMemcpy(c, d_counters_, sizeof c, cudaMemcpyDeviceToHost) != cudaSuccess) cudaGetLastError();
  out->cache_hits = c[0];
  out->cache_misses = c[1];
  out->device_cache_bytes = cache_bytes_;
  out->cache_admissions = admissions_.load();
  out->cache_evictions = evictions_.load();
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t steps = processing_ ? 1 : 0;
  for (const AccessRecord &r : queue_) steps += r.end_only ? 0 : 1;
  out->manager_backlog = steps;
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
