#include "lib/common/config.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace wkv {

bool head_dim_supported(uint32_t d) {
  for (uint32_t h : kHeadDims)
    if (h == d) return true;
  return false;
}

float Config::scale() const { return 1.0f / std::sqrt(static_cast<float>(c.head_dim)); }

wkv_config default_config() {
  wkv_config c;
  std::memset(&c, 0, sizeof c);
  c.size = sizeof(wkv_config);
  c.device = WKV_DEVICE_CPU;
  c.device_id = 0;
  c.dtype = WKV_DTYPE_F16;
  c.segment_tokens = 8192;
  c.update_segment_tokens = 1024;
  c.cluster_tokens = 16;
  c.kmeans_iters = 10;
  c.sink_tokens = 4;
  c.window_tokens = 64;
  c.retrieval_frac = 0.018f;
  c.estimation_frac = 0.232f;
  c.page_bytes = 2048;
  c.threads = 0;
  c.flags = 0;
  c.host_budget_bytes = 0;
  c.host_chunk_bytes = 64ull << 20;
  c.device_cache_bytes = 0;
  c.seed = 0x5eed;
  return c;
}

namespace {

// Environment overrides (mimalloc's MIMALLOC_<NAME> style): WKV_<FIELD>.
template <typename T> void env_override(const char *name, T *field) {
  const char *s = std::getenv(name);
  if (!s || !*s) return;
  char *end = nullptr;
  if constexpr (std::is_floating_point_v<T>) {
    double v = std::strtod(s, &end);
    if (end && *end == '\0') *field = static_cast<T>(v);
  } else {
    unsigned long long v = std::strtoull(s, &end, 0);
    if (end && *end == '\0') *field = static_cast<T>(v);
  }
}

}  // namespace

Status resolve_config(const wkv_config *user, Config *out) {
  if (!user) return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "config is NULL");
  if (user->size < offsetof(wkv_config, dtype) + sizeof(user->dtype))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "config size %u is too small (call wkv_config_init first)", user->size);
  wkv_config c = default_config();
  size_t n = user->size < sizeof c ? user->size : sizeof c;
  std::memcpy(&c, user, n);
  c.size = sizeof c;

  env_override("WKV_THREADS", &c.threads);
  env_override("WKV_SEGMENT_TOKENS", &c.segment_tokens);
  env_override("WKV_UPDATE_SEGMENT_TOKENS", &c.update_segment_tokens);
  env_override("WKV_CLUSTER_TOKENS", &c.cluster_tokens);
  env_override("WKV_KMEANS_ITERS", &c.kmeans_iters);
  env_override("WKV_SINK_TOKENS", &c.sink_tokens);
  env_override("WKV_WINDOW_TOKENS", &c.window_tokens);
  env_override("WKV_RETRIEVAL_FRAC", &c.retrieval_frac);
  env_override("WKV_ESTIMATION_FRAC", &c.estimation_frac);
  env_override("WKV_HOST_BUDGET_BYTES", &c.host_budget_bytes);
  env_override("WKV_HOST_CHUNK_BYTES", &c.host_chunk_bytes);
  env_override("WKV_DEVICE_CACHE_BYTES", &c.device_cache_bytes);

  if (c.n_layers == 0 || c.n_q_heads == 0 || c.n_kv_heads == 0 || c.head_dim == 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "config shape incomplete: n_layers=%u n_q_heads=%u n_kv_heads=%u head_dim=%u "
                     "(all must be set)",
                     c.n_layers, c.n_q_heads, c.n_kv_heads, c.head_dim);
  if (c.n_q_heads % c.n_kv_heads != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "n_q_heads %u is not a multiple of n_kv_heads %u",
                     c.n_q_heads, c.n_kv_heads);
  if (c.n_layers > 4096 || c.n_q_heads > 1024)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "shape too large: n_layers=%u n_q_heads=%u",
                     c.n_layers, c.n_q_heads);
  if (!head_dim_supported(c.head_dim))
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "head_dim %u is not supported (64, 80, 96, 128, 256)",
                     c.head_dim);
  if (c.dtype > WKV_DTYPE_BF16)
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "dtype %u is not supported (f32=0, f16=1, bf16=2)",
                     c.dtype);
  if (c.device > WKV_DEVICE_AUTO)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "device %u is not a WKV_DEVICE_* value", c.device);
  if (c.segment_tokens == 0 || c.update_segment_tokens == 0 || c.cluster_tokens == 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "segment_tokens, update_segment_tokens and cluster_tokens must be positive");
  if (c.kmeans_iters == 0 || c.kmeans_iters > 1000)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "kmeans_iters %u outside [1, 1000]", c.kmeans_iters);
  if (!(c.retrieval_frac >= 0.0f && c.retrieval_frac <= 1.0f) ||
      !(c.estimation_frac >= 0.0f && c.estimation_frac <= 1.0f) ||
      c.retrieval_frac + c.estimation_frac > 1.0f + 1e-6f)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "retrieval_frac %g and estimation_frac %g must lie in [0, 1] and sum to at most 1",
                     static_cast<double>(c.retrieval_frac), static_cast<double>(c.estimation_frac));
  if (c.page_bytes < 64 || c.page_bytes > (1u << 24))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "page_bytes %u outside [64, 16 MiB]", c.page_bytes);
  if (c.threads > 4096)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "threads %u is too many", c.threads);
  if (c.reserved0 != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "reserved0 must be 0");
  if (c.flags & ~(uint32_t)(WKV_CONFIG_NO_NUMA | WKV_CONFIG_NO_PINNED))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "unknown flags 0x%x", c.flags);
  if (c.host_chunk_bytes < (1u << 20)) c.host_chunk_bytes = 1u << 20;
  out->c = c;
  if (out->page_tokens() > 32768)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "page_bytes %u holds %u tokens, more than 32768",
                     c.page_bytes, out->page_tokens());
  if (out->page_slot_bytes() > c.host_chunk_bytes)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "host_chunk_bytes %llu smaller than one page",
                     static_cast<unsigned long long>(c.host_chunk_bytes));
  return Status::ok();
}

}  // namespace wkv
