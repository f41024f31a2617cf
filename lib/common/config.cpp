#include "lib/common/config.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <array>
#include <limits>
#include <string>
#include <variant>

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
  c.stats_path = nullptr;
  c.spill_dir = nullptr;
  c.spill_budget_bytes = 0;
  c.stats_interval_ms = 1000;
  c.method = WKV_METHOD_DEFAULT;
  c.page_format = WKV_PAGE_FORMAT_STORAGE;
  c.reserved1 = 0;
  return c;
}

namespace {

// Bounds checked at open. Past them a value is a mistake, not a setting: it
// would fail much later with a misleading message, or overflow a 32-bit count.
constexpr uint64_t kMinChunkBytes = 1ull << 20;  // smaller struct values are raised to it
constexpr uint64_t kMaxChunkBytes = 1ull << 40;  // 1 TiB
// The device k-means's largest segment (kKMeansMaxTokens in kernels/kmeans_cuda.hpp,
// repeated here because lib/ includes nothing from kernels/).
constexpr uint32_t kMaxSegmentTokens = 65536;
// Sink and window rows are held in full; the cap keeps sums such as
// window_tokens + update_segment_tokens far from 32-bit overflow.
constexpr uint32_t kMaxSteadyTokens = 1u << 20;
constexpr uint32_t kMaxThreads = 4096;
constexpr uint64_t kMaxDeviceCacheBytes = 1ull << 50;  // 1 PiB

// An unsigned integer written plainly: decimal digits, or 0x and hex digits,
// and nothing else. strtoull alone would take "-1" (as 2^64 - 1), leading
// spaces, and in base 0 read "010" as octal.
bool parse_u64(const char *s, uint64_t *out) {
  int base = 10;
  if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s += 2;
    base = 16;
  }
  const unsigned char first = static_cast<unsigned char>(s[0]);
  if (!(base == 16 ? std::isxdigit(first) : std::isdigit(first))) return false;
  errno = 0;
  char *end = nullptr;
  unsigned long long v = std::strtoull(s, &end, base);
  if (errno == ERANGE || *end != '\0') return false;
  *out = v;
  return true;
}

Status parse_env(const char *var, const char *s, uint32_t *field) {
  uint64_t v = 0;
  if (!parse_u64(s, &v) || v > UINT32_MAX)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "environment variable %s='%s' is not an unsigned 32-bit integer", var, s);
  *field = static_cast<uint32_t>(v);
  return Status::ok();
}

Status parse_env(const char *var, const char *s, uint64_t *field) {
  if (!parse_u64(s, field))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "environment variable %s='%s' is not an unsigned 64-bit integer", var, s);
  return Status::ok();
}

// A non-negative number that a float holds. The first character must be a
// digit or a point: strtod would also take spaces, a sign, "nan" and "inf".
Status parse_env(const char *var, const char *s, float *field) {
  char *end = nullptr;
  double v = -1.0;
  if (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.') v = std::strtod(s, &end);
  if (!end || *end != '\0' || !(v >= 0.0 && v <= std::numeric_limits<float>::max()))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "environment variable %s='%s' is not a finite non-negative number", var, s);
  *field = static_cast<float>(v);
  return Status::ok();
}

// One environment override: WKV_<FIELD>.
struct EnvOverride {
  const char *var;
  std::variant<uint32_t *, uint64_t *, float *> field;
  bool applied = false;
};

// One environment override per field (mimalloc's MIMALLOC_<NAME> table),
// in the order of the bits of Config::env_overrides: never reordered.
constexpr size_t kEnvOverrides = 14;
std::array<EnvOverride, kEnvOverrides> env_overrides(wkv_config &c) {
  return {{
      {"WKV_THREADS", &c.threads},
      {"WKV_SEGMENT_TOKENS", &c.segment_tokens},
      {"WKV_UPDATE_SEGMENT_TOKENS", &c.update_segment_tokens},
      {"WKV_CLUSTER_TOKENS", &c.cluster_tokens},
      {"WKV_KMEANS_ITERS", &c.kmeans_iters},
      {"WKV_SINK_TOKENS", &c.sink_tokens},
      {"WKV_WINDOW_TOKENS", &c.window_tokens},
      {"WKV_RETRIEVAL_FRAC", &c.retrieval_frac},
      {"WKV_ESTIMATION_FRAC", &c.estimation_frac},
      {"WKV_HOST_BUDGET_BYTES", &c.host_budget_bytes},
      {"WKV_HOST_CHUNK_BYTES", &c.host_chunk_bytes},
      {"WKV_DEVICE_CACHE_BYTES", &c.device_cache_bytes},
      {"WKV_METHOD", &c.method},
      {"WKV_PAGE_FORMAT", &c.page_format},
  }};
}

}  // namespace

const char *env_override_name(unsigned bit) {
  wkv_config c{};
  return bit < kEnvOverrides ? env_overrides(c)[bit].var : nullptr;
}

Status resolve_config(const wkv_config *user, Config *out) {
  if (!user) return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "config is NULL");
  if (user->size < offsetof(wkv_config, dtype) + sizeof(user->dtype))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "config size %u is too small (call wkv_config_init first)", user->size);
  wkv_config c = default_config();
  size_t n = user->size < sizeof c ? user->size : sizeof c;
  std::memcpy(&c, user, n);
  c.size = sizeof c;
  // A pointer the size covers only in part is not the caller's: it keeps its
  // default (NULL) rather than becoming half of one and half of another.
  if (n < offsetof(wkv_config, stats_path) + sizeof c.stats_path) c.stats_path = nullptr;
  if (n < offsetof(wkv_config, spill_dir) + sizeof c.spill_dir) c.spill_dir = nullptr;

  std::array<EnvOverride, kEnvOverrides> overrides = env_overrides(c);
  for (EnvOverride &o : overrides) {
    const char *s = std::getenv(o.var);
    if (!s) continue;
    WKV_RETURN_IF_ERROR(std::visit([&](auto *field) { return parse_env(o.var, s, field); }, o.field));
    o.applied = true;
  }
  // The variable that set a field, or null; and the same in words, for the
  // bounds' messages.
  auto env_var = [&](const void *field) -> const char * {
    for (const EnvOverride &o : overrides)
      if (o.applied && std::visit([&](auto *p) { return static_cast<const void *>(p) == field; }, o.field))
        return o.var;
    return nullptr;
  };
  auto from = [&](const void *field) -> std::string {
    const char *var = env_var(field);
    return var ? format("from the environment variable %s", var) : "from the config";
  };

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
  if (c.segment_tokens > kMaxSegmentTokens)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "segment_tokens %u (%s) is above %u, the largest segment the device k-means takes",
                     c.segment_tokens, from(&c.segment_tokens).c_str(), kMaxSegmentTokens);
  if (c.update_segment_tokens > kMaxSegmentTokens)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "update_segment_tokens %u (%s) is above %u, the largest segment the device "
                     "k-means takes",
                     c.update_segment_tokens, from(&c.update_segment_tokens).c_str(), kMaxSegmentTokens);
  if (c.cluster_tokens > c.segment_tokens)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "cluster_tokens %u (%s) is above segment_tokens %u (%s)",
                     c.cluster_tokens, from(&c.cluster_tokens).c_str(), c.segment_tokens,
                     from(&c.segment_tokens).c_str());
  if (c.kmeans_iters == 0 || c.kmeans_iters > 1000)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "kmeans_iters %u outside [1, 1000]", c.kmeans_iters);
  if (!(c.retrieval_frac >= 0.0f && c.retrieval_frac <= 1.0f) ||
      !(c.estimation_frac >= 0.0f && c.estimation_frac <= 1.0f) ||
      c.retrieval_frac + c.estimation_frac > 1.0f + 1e-6f)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "retrieval_frac %g and estimation_frac %g must lie in [0, 1] and sum to at most 1",
                     static_cast<double>(c.retrieval_frac), static_cast<double>(c.estimation_frac));
  if (c.sink_tokens > kMaxSteadyTokens)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "sink_tokens %u (%s) is above %u", c.sink_tokens,
                     from(&c.sink_tokens).c_str(), kMaxSteadyTokens);
  if (c.window_tokens > kMaxSteadyTokens)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "window_tokens %u (%s) is above %u", c.window_tokens,
                     from(&c.window_tokens).c_str(), kMaxSteadyTokens);
  if (c.page_bytes < 64 || c.page_bytes > (1u << 24))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "page_bytes %u outside [64, 16 MiB]", c.page_bytes);
  if (c.threads > kMaxThreads)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "threads %u is too many (%s; at most %u)", c.threads,
                     from(&c.threads).c_str(), kMaxThreads);
  if (c.page_format > WKV_PAGE_FORMAT_INT8_CENTERED)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "page_format %u (%s) is no WKV_PAGE_FORMAT_* (storage=0, int8=1, int8-centered=2)", c.page_format,
                     from(&c.page_format).c_str());
  if (c.reserved1 != 0) return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "reserved1 must be 0");
  if (c.stats_path && c.stats_path[0] == '\0')
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "stats_path is empty (NULL means no statistics file)");
  if (c.stats_path && (c.stats_interval_ms < 10 || c.stats_interval_ms > 3600000))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "stats_interval_ms %u outside [10, 3600000]", c.stats_interval_ms);
  if (c.method & ~static_cast<uint32_t>(WKV_METHOD_DEFAULT))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "method 0x%x (%s) has bits that are no WKV_METHOD_* (0x%x)", c.method,
                     from(&c.method).c_str(), static_cast<uint32_t>(WKV_METHOD_DEFAULT));
  if (c.spill_dir && c.spill_dir[0] == '\0')
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "spill_dir is empty (NULL means no spill file)");
  if (c.flags & ~(uint32_t)(WKV_CONFIG_NO_NUMA | WKV_CONFIG_NO_PINNED | WKV_CONFIG_SPILL_NO_URING |
                             WKV_CONFIG_HOST_META_ROWS))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "unknown flags 0x%x", c.flags);
  if (c.device_cache_bytes > kMaxDeviceCacheBytes)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "device_cache_bytes %llu (%s) is above 1 PiB",
                     static_cast<unsigned long long>(c.device_cache_bytes),
                     from(&c.device_cache_bytes).c_str());
  if (c.host_chunk_bytes > kMaxChunkBytes)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "host_chunk_bytes %llu (%s) is above 1 TiB",
                     static_cast<unsigned long long>(c.host_chunk_bytes),
                     from(&c.host_chunk_bytes).c_str());
  // Callers of the struct have always had small chunks raised; a variable,
  // being new and typed by hand, gets no such slack.
  if (c.host_chunk_bytes < kMinChunkBytes) {
    if (env_var(&c.host_chunk_bytes))
      return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "host_chunk_bytes %llu (%s) is below 1 MiB",
                       static_cast<unsigned long long>(c.host_chunk_bytes),
                       from(&c.host_chunk_bytes).c_str());
    c.host_chunk_bytes = kMinChunkBytes;
  }

  Config r;
  r.c = c;
  for (size_t i = 0; i < overrides.size(); ++i)
    if (overrides[i].applied) r.env_overrides |= 1u << i;
  if (r.page_tokens() > 32768)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "page_bytes %u holds %u tokens, more than 32768",
                     c.page_bytes, r.page_tokens());
  const uint64_t slot = r.page_slot_bytes();
  if (slot > c.host_chunk_bytes)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "host_chunk_bytes %llu smaller than one page",
                     static_cast<unsigned long long>(c.host_chunk_bytes));
  // Page ids and the arena's per-chunk page count are 32-bit.
  if (c.host_chunk_bytes / slot > UINT32_MAX)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "host_chunk_bytes %llu (%s) holds %llu page slots of %llu bytes, more than 2^32 - 1",
                     static_cast<unsigned long long>(c.host_chunk_bytes),
                     from(&c.host_chunk_bytes).c_str(),
                     static_cast<unsigned long long>(c.host_chunk_bytes / slot),
                     static_cast<unsigned long long>(slot));
  // A budget below one slot could never hold a page: every append would fail.
  if (c.host_budget_bytes != 0 && c.host_budget_bytes < slot)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "host_budget_bytes %llu (%s) is smaller than one page slot of %llu bytes "
                     "(0 means unlimited)",
                     static_cast<unsigned long long>(c.host_budget_bytes),
                     from(&c.host_budget_bytes).c_str(), static_cast<unsigned long long>(slot));
  *out = r;
  return Status::ok();
}

namespace {

// ceil(frac * n), at most n.
uint32_t share_of(float frac, uint32_t n) {
  const double r = std::ceil(static_cast<double>(frac) * n - 1e-9);
  return static_cast<uint32_t>(std::min<double>(r, n));
}

}  // namespace

void zone_sizes(const Config &cfg, uint32_t clusters, uint32_t *n_ret, uint32_t *n_est) {
  uint32_t n_one = 0;
  zone_sizes(cfg, clusters, 0, n_ret, &n_one, n_est);
}

void zone_sizes(const Config &cfg, uint32_t clusters, uint32_t ones, uint32_t *n_ret, uint32_t *n_one,
                uint32_t *n_est) {
  *n_ret = *n_one = *n_est = 0;
  if (clusters == 0) return;
  uint32_t nr = 0, no = 0;
  if ((cfg.c.method & WKV_METHOD_ONES) && ones > 0) {
    // Clusters of one ranked apart: each class its share, at least one of
    // the clusters of one.
    no = std::max<uint32_t>(1, share_of(cfg.c.retrieval_frac, ones));
    nr = share_of(cfg.c.retrieval_frac, clusters - ones) + no;
  } else {
    nr = share_of(cfg.c.retrieval_frac, clusters);
  }
  const double e = std::floor(static_cast<double>(cfg.c.estimation_frac) * clusters + 0.5);
  *n_ret = nr;
  *n_one = no;
  *n_est = static_cast<uint32_t>(std::min<double>(e, clusters - nr));
}

}  // namespace wkv
