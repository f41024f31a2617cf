// Device-side state of the CUDA backend: growable device buffers, the
// per-head device mirror (meta index, mapping table, steady zone) and the
// per-plan device buffers.
#pragma once

#if defined(WKV_WITH_CUDA)

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/device_layout.hpp"
#include "lib/common/status.hpp"
#include "lib/store/host_arena.hpp"

namespace wkv {

// A CUDA error as a Status naming the statement, file and line.
Status cuda_error(cudaError_t err, const char *stmt, const char *file, int line);

#define WKV_CU(stmt)                                                              \
  do {                                                                            \
    cudaError_t wkv_cu_err_ = (stmt);                                             \
    if (wkv_cu_err_ != cudaSuccess) return ::wkv::cuda_error(wkv_cu_err_, #stmt, __FILE__, __LINE__); \
  } while (0)

// A device buffer that grows geometrically, in stream order: the old
// contents are copied on the stream and the old block freed after the copy,
// so no host wait is needed.
class DevBuf {
 public:
  DevBuf() = default;
  ~DevBuf();
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;

  // Ensures capacity for `bytes`, keeping the first `keep` bytes.
  Status reserve(size_t bytes, size_t keep, cudaStream_t s);
  void swap(DevBuf &o) noexcept {
    std::swap(p_, o.p_);
    std::swap(cap_, o.cap_);
  }
  // Frees the block in stream order (after the work already on s).
  void release_async(cudaStream_t s) {
    if (p_) cudaFreeAsync(p_, s);
    p_ = nullptr;
    cap_ = 0;
  }
  template <typename T> T *as() const { return static_cast<T *>(p_); }
  void *get() const { return p_; }
  size_t capacity() const { return cap_; }

 private:
  void *p_ = nullptr;
  size_t cap_ = 0;
};

// A pinned host staging buffer that grows geometrically (contents not kept):
// device-to-host copies into it run at the link's speed, where pageable
// destinations go through the driver's bounce buffers.
class PinnedBuf {
 public:
  PinnedBuf() = default;
  ~PinnedBuf() {
    if (p_) cudaFreeHost(p_);
  }
  PinnedBuf(const PinnedBuf &) = delete;
  PinnedBuf &operator=(const PinnedBuf &) = delete;

  // Ensures capacity for `bytes`. Pre: nothing in flight reads or writes it.
  Status reserve(size_t bytes);
  template <typename T> T *as() const { return static_cast<T *>(p_); }

 private:
  void *p_ = nullptr;
  size_t cap_ = 0;
};

// Two timing events, created on first use and destroyed with the pair.
struct EventPair {
  cudaEvent_t begin = nullptr, end = nullptr;
  EventPair() = default;
  EventPair(const EventPair &) = delete;
  EventPair &operator=(const EventPair &) = delete;
  ~EventPair() {
    if (begin) cudaEventDestroy(begin);
    if (end) cudaEventDestroy(end);
  }
  Status create();
};

// What the buffer manager needs of a head, shared with it.
//
// `clusters` is immutable once published (a new snapshot replaces it at
// each index growth); `d_pages` and `dead` change under the backend's lock.
struct HeadClusters {
  std::vector<uint32_t> first_slot;  // [clusters]
  std::vector<uint32_t> size;        // [clusters]
  std::vector<PageId> pages;         // the head's page list
};
struct HeadShared {
  uint64_t seq_id = 0;
  uint32_t layer_head = 0;
  std::shared_ptr<const HeadClusters> clusters;
  const uint8_t **d_pages = nullptr;  // the device page table (guarded)
  bool dead = false;                  // the sequence was destroyed (guarded)
};

// One (sequence, layer, KV head) on the device.
struct DeviceHead {
  DevBuf centroid, value_sum, size, first_slot;  // meta index + mapping mirror
  DevBuf pages;                                  // const uint8_t *[pages]
  DevBuf sink_k, sink_v, tail_k, tail_v;         // steady zone rows
  uint32_t sink_rows = 0, tail_rows = 0;
  uint32_t clusters = 0, n_pages = 0;
  uint32_t max_cluster = 0;
  uint64_t clustered_tokens = 0;
  std::shared_ptr<HeadShared> shared;
};

// A plan's device buffers.
struct PlanDevice {
  DevBuf runs, q, ret_ids, ret_pos, est_ids, run_tokens, est_out, est_lse, offsets, logits;
  DevBuf xk, xv, scratch;
  std::vector<kernels::DevRun> host_runs;
  uint64_t xbuf_tokens_bound = 0;  // capacity of xk/xv in tokens
  uint32_t max_run_tokens = 0;     // bound on any run's tokens
  uint32_t total_ret = 0, total_est = 0;
  size_t logits_floats = 0;
  uint64_t open_epoch = 0;  // an epoch looked up and not yet updated (0: none)
  cudaEvent_t done = nullptr;
  ~PlanDevice() {
    if (done) cudaEventDestroy(done);
  }
};

}  // namespace wkv

#endif  // WKV_WITH_CUDA
