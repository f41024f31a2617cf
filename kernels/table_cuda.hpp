// Small device-side table updates of the CUDA backend. Every value travels
// as a kernel parameter, never through a host staging buffer, so that the
// host may reuse its memory at once and a captured graph replays the same
// values: no host wait, no staging hazard.
#pragma once

#include <cstdint>

#include "kernels/device_layout.hpp"
#include "lib/common/dtype.hpp"
#include "lib/common/status.hpp"

namespace wkv::kernels {

// Copies n DevRun structs from host memory into dst (device), in launches of
// up to 32 runs passed by value.
Status upload_runs(const DevRun *host_runs, uint32_t n, DevRun *dst, void *stream);

// One 8-byte store to the device: *addr = value.
struct PtrStore {
  const uint8_t **addr;
  const uint8_t *value;
};
// Applies n stores (host array) in launches of up to 240 stores by value.
Status apply_ptr_stores(const PtrStore *stores, uint32_t n, void *stream);

// One page copy: `bytes` from src (device memory, or pinned and mapped host
// memory) to dst (device memory).
struct PageCopy {
  const uint8_t *src;
  uint8_t *dst;
};
// Applies n copies of `bytes` each (host array) in launches of up to 240
// copies by value, one CTA a page, 16-byte loads. Pre: bytes, every src and
// every dst are multiples of 16 (checked: WKV_ERR_INVALID_ARGUMENT).
Status copy_pages(const PageCopy *copies, uint32_t n, uint32_t bytes, void *stream);

// Converts q [n_seqs][n_q_heads][d] of storage type t with strides in
// elements into dst, f32 [n_seqs][n_q_heads][d] contiguous.
Status convert_q(DType t, const void *src, int64_t seq_stride, int64_t head_stride, uint32_t n_seqs,
                 uint32_t n_q_heads, uint32_t d, float *dst, void *stream);

}  // namespace wkv::kernels
