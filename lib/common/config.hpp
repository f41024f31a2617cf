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

struct Config {
  wkv_config c{};  // resolved: size = sizeof(wkv_config), defaults applied
  uint32_t env_overrides = 0;  // bit i: env_override_name(i) set a field

  DType dtype() const { return static_cast<DType>(c.dtype); }
  uint32_t group() const { return c.n_q_heads / c.n_kv_heads; }
  uint32_t row_bytes() const { return c.head_dim * dtype_bytes(dtype()); }
  // Token slots in one page: as many rows as fit in page_bytes, at least one.
  uint32_t page_tokens() const {
    uint32_t t = c.page_bytes / row_bytes();
    return t == 0 ? 1 : t;
  }
  // Bytes of one page slot: K rows then V rows, rounded up to 64 bytes.
  uint32_t page_slot_bytes() const {
    uint32_t b = 2 * page_tokens() * row_bytes();
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
