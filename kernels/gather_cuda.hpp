// Assembly of the execution buffer on the device: the steady zone and the
// retrieval clusters of every run, read from the device block cache or
// straight from pinned, mapped host pages. Plain C++ (no CUDA header).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/device_layout.hpp"
#include "lib/common/status.hpp"

// The CUDA runtime's stream type, declared exactly as cuda_runtime.h does.
struct CUstream_st;
typedef struct CUstream_st *cudaStream_t;

namespace wkv::kernels {

// Where a gather reads and writes.
//
// Execution buffer (device), K and V each [tokens][row_bytes]; run r owns
// rows [offsets[r], offsets[r + 1]) laid out as
//   sink rows        offsets[r] + t,                      t < sink_tokens
//   tail rows        offsets[r] + sink + t,               t < tail_tokens
//   cluster i rows   offsets[r] + sink + tail + ret_pos[ret_off + i] + m,
//                    m < size[id], id = ret_ids[ret_off + i]
// Member m of cluster id sits in token slot first_slot[id] + m of the run's
// pages: page pages[slot / page_tokens], row slot % page_tokens, K at
// page + row * row_bytes, V at page + (page_tokens + row) * row_bytes.
struct GatherArgs {
  const DevRun *runs = nullptr;  // device [n_runs]
  uint32_t n_runs = 0;
  DevLookup lookup{};            // device arrays; reads ret_ids, ret_pos, offsets
  uint32_t max_ret = 0;          // >= every run's n_ret; sizes the grid only
  uint32_t row_bytes = 0;        // d * dtype bytes, a multiple of 16
  uint32_t page_tokens = 0;      // token slots per page
  uint8_t *xk = nullptr;         // device execution buffer, K rows
  uint8_t *xv = nullptr;         // device execution buffer, V rows
  // The device block cache's address range: a page inside it is a hit.
  const void *cache_base = nullptr;
  size_t cache_bytes = 0;
  // Device counters, in pages touched by retrieval clusters (a cluster over
  // three pages counts three): counters[0] += hits, counters[1] += misses.
  // May be null.
  unsigned long long *counters = nullptr;
};

// Enqueues the gather on `stream` (no host wait). Every row pointer (sink,
// tail, pages, xk, xv) must be 16-byte aligned: rows move in 16-byte loads
// and stores. WKV_ERR_INVALID_ARGUMENT for a null buffer, row_bytes not a
// multiple of 16, page_tokens 0, unaligned xk/xv; WKV_ERR_DEVICE on a launch
// failure.
Status gather_cuda(const GatherArgs &a, cudaStream_t stream);

}  // namespace wkv::kernels
