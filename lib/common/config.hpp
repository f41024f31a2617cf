// The engine's configuration, validated, with derived sizes. Built from the
// caller's wkv_config (reading only the prefix its size covers); environment
// variables WKV_<FIELD> override numeric fields (e.g. WKV_THREADS=4).
#pragma once

#include <cstdint>

#include "kernels/dtype.hpp"
#include "lib/common/status.hpp"
#include "wavekv/wavekv.h"

namespace wkv {

// Head dimensions the engine serves: one entry per compiled instantiation.
constexpr uint32_t kHeadDims[] = {64, 80, 96, 128, 256};
bool head_dim_supported(uint32_t d);

// A page format's name (WKV_PAGE_FORMAT_*), as the engine's statistics,
// `wavekv inspect`, the error messages and the Python binding spell it.
inline const char *page_format_name(uint32_t f) {
  return f == WKV_PAGE_FORMAT_INT8            ? "int8"
         : f == WKV_PAGE_FORMAT_INT8_CENTERED ? "int8-centered"
         : f == WKV_PAGE_FORMAT_STORAGE       ? "storage"
                                              : "unknown";
}

struct Config {
  wkv_config c{};  // resolved: size = sizeof(wkv_config), defaults applied
  uint32_t env_overrides = 0;  // bit i: env_override_name(i) set a field

  DType dtype() const { return static_cast<DType>(c.dtype); }
  uint32_t group() const { return c.n_q_heads / c.n_kv_heads; }
  // Bytes of one row in the storage dtype: sink and window rows, the
  // execution buffer, every input and output.
  uint32_t row_bytes() const { return c.head_dim * dtype_bytes(dtype()); }
  // Whether pages hold 8-bit rows with an f32 scale each (WKV_PAGE_FORMAT_INT8,
  // and WKV_PAGE_FORMAT_INT8_CENTERED, whose K rows are kept as differences
  // from their clusters' centroids: centered_keys).
  bool int8_pages() const {
    return c.page_format == WKV_PAGE_FORMAT_INT8 || c.page_format == WKV_PAGE_FORMAT_INT8_CENTERED;
  }
  bool centered_keys() const { return c.page_format == WKV_PAGE_FORMAT_INT8_CENTERED; }
  // Bytes of one row inside a page: the row stride of its K and V rows.
  uint32_t page_row_bytes() const { return int8_pages() ? c.head_dim : row_bytes(); }
  // Bytes a token takes in a page: its row, and its scale where pages have
  // them (K and V each).
  uint32_t page_token_bytes() const { return page_row_bytes() + (int8_pages() ? 4u : 0u); }
  // Token slots in one page: as many tokens as fit in page_bytes (their
  // rows and scales), at least one.
  uint32_t page_tokens() const {
    uint32_t t = c.page_bytes / page_token_bytes();
    return t == 0 ? 1 : t;
  }
  // Where a page's scales begin: K rows, V rows, then the page_tokens K
  // scales and the page_tokens V scales (f32). Pages of the storage format
  // have none.
  uint32_t page_scales_at() const { return 2 * page_tokens() * page_row_bytes(); }
  // Bytes of one page slot: K rows, V rows (and their scales), rounded up
  // to 64 bytes; to the next 4 KiB where that costs at most a quarter more,
  // so that a slot 8-bit rows leave short of a 4 KiB block is still read
  // from the spill file straight into its place (docs/spill.md).
  uint32_t page_slot_bytes() const {
    const uint32_t b = 2 * page_tokens() * page_token_bytes();
    const uint32_t blocks = (b + 4095u) & ~4095u;
    if (int8_pages() && blocks - b <= b / 4) return blocks;
    return (b + 63u) & ~63u;
  }
  float scale() const;
  // Whether pages of live sequences may leave for the spill file: a spill
  // directory and a host budget (lib/engine/cold.hpp).
  bool cold_pages() const { return c.spill_dir != nullptr && c.host_budget_bytes > 0; }
};

// The defaults of every field (shape left zero).
wkv_config default_config();

// The environment variable of bit `bit` of Config::env_overrides, or null.
const char *env_override_name(unsigned bit);

// Copies the prefix of *user that user->size covers over the defaults,
// applies environment overrides and validates.
Status resolve_config(const wkv_config *user, Config *out);

// Zone sizes for a head of `clusters` clusters: retrieval is ceil(r * C),
// estimation round(e * C), never more than C together.
void zone_sizes(const Config &cfg, uint32_t clusters, uint32_t *n_ret, uint32_t *n_est);
// The same for a head with `ones` clusters of one member: with
// WKV_METHOD_ONES and ones > 0 they are ranked apart, and n_one of the n_ret
// retrieval clusters are of one member (0 otherwise).
void zone_sizes(const Config &cfg, uint32_t clusters, uint32_t ones, uint32_t *n_ret, uint32_t *n_one,
                uint32_t *n_est);

}  // namespace wkv
