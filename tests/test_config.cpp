// Config resolution: strict parsing of the WKV_<FIELD> overrides and the
// bounds checked at open, through wkv_engine_open and wkv::resolve_config.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstddef>
#include <cstdlib>
#include <deque>
#include <optional>
#include <string>

#include "lib/common/config.hpp"
#include "wavekv/wavekv.h"

namespace {

const char *const kVariables[] = {
    "WKV_THREADS",         "WKV_SEGMENT_TOKENS",    "WKV_UPDATE_SEGMENT_TOKENS",
    "WKV_CLUSTER_TOKENS",  "WKV_KMEANS_ITERS",      "WKV_SINK_TOKENS",
    "WKV_WINDOW_TOKENS",   "WKV_RETRIEVAL_FRAC",    "WKV_ESTIMATION_FRAC",
    "WKV_HOST_BUDGET_BYTES", "WKV_HOST_CHUNK_BYTES", "WKV_DEVICE_CACHE_BYTES",
    "WKV_METHOD",          "WKV_CACHE_POLICY",      "WKV_QUARANTINE",
    "WKV_CACHE_RESERVE",   "WKV_PAGE_FORMAT",
};
const char *const kFractions[] = {"WKV_RETRIEVAL_FRAC", "WKV_ESTIMATION_FRAC"};

// Sets (or, with a null value, unsets) an environment variable for the
// guard's lifetime, then puts back what was there.
class EnvGuard {
 public:
  EnvGuard(const char *name, const char *value) : name_(name) {
    if (const char *old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~EnvGuard() {
    if (old_)
      setenv(name_.c_str(), old_->c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  EnvGuard(const EnvGuard &) = delete;
  EnvGuard &operator=(const EnvGuard &) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

wkv_config minimal_config() {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = 1;
  c.n_q_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 64;
  c.dtype = WKV_DTYPE_F32;
  c.device = WKV_DEVICE_CPU;
  c.threads = 1;
  return c;
}

// Every test starts with none of the overrides set, whatever the shell had.
class ResolveConfig : public ::testing::Test {
 protected:
  ResolveConfig() {
    for (const char *v : kVariables) cleared_.emplace_back(v, nullptr);
  }

  // Opens an engine through the C ABI and closes it again; on success the
  // effective config lands in *effective.
  static int open(const wkv_config &c, wkv_config *effective = nullptr) {
    wkv_engine *e = nullptr;
    int rc = wkv_engine_open(&c, &e);
    if (rc != WKV_OK) return rc;
    if (effective) {
      effective->size = sizeof *effective;
      EXPECT_EQ(wkv_engine_config(e, effective), WKV_OK);
    }
    wkv_engine_close(e);
    return rc;
  }
  static std::string error() { return wkv_last_error(); }

  // Through the internals: the status of resolving c.
  static wkv::Status resolve(const wkv_config &c, wkv::Config *out = nullptr) {
    wkv::Config scratch;
    return wkv::resolve_config(&c, out ? out : &scratch);
  }

 private:
  std::deque<EnvGuard> cleared_;
};

bool contains(const std::string &s, const std::string &part) { return s.find(part) != std::string::npos; }

TEST_F(ResolveConfig, OpensWithNoOverrides) {
  wkv_config got;
  ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
  EXPECT_EQ(got.threads, 1u);
  EXPECT_EQ(got.segment_tokens, 8192u);
  EXPECT_EQ(got.host_chunk_bytes, 64ull << 20);
}

// A size that ends inside a pointer field (found by fuzz_c_abi: half of the
// caller's spill_dir over half of the default NULL) leaves that pointer at its
// default; a size that covers it takes it whole.
TEST_F(ResolveConfig, APointerThatTheSizeCoversInPartIsNotRead) {
  static const char kDir[] = "/nonexistent/spill";
  static const char kPath[] = "/nonexistent/stats.json";
  for (size_t cut : {offsetof(wkv_config, stats_path) + 4, offsetof(wkv_config, spill_dir) + 1,
                     offsetof(wkv_config, spill_dir) + 7}) {
    wkv_config c = minimal_config();
    c.stats_path = kPath;
    c.spill_dir = kDir;
    c.size = static_cast<uint32_t>(cut);
    wkv::Config got;
    ASSERT_TRUE(resolve(c, &got).is_ok()) << "size " << cut;
    EXPECT_EQ(got.c.spill_dir, nullptr) << "size " << cut;
    if (cut < offsetof(wkv_config, stats_path) + 8) {
      EXPECT_EQ(got.c.stats_path, nullptr) << "size " << cut;
    }
  }
  wkv_config c = minimal_config();
  c.spill_dir = kDir;
  c.size = static_cast<uint32_t>(offsetof(wkv_config, spill_dir) + 8);
  wkv::Config got;
  ASSERT_TRUE(resolve(c, &got).is_ok());
  EXPECT_EQ(got.c.spill_dir, kDir);
  // The directory does not exist: opening says so, naming it.
  EXPECT_EQ(open(c), WKV_ERR_IO);
  EXPECT_TRUE(contains(error(), "/nonexistent/spill")) << error();
}

TEST_F(ResolveConfig, RejectsSegmentTokensThatWouldWrapTo64) {
  EnvGuard g("WKV_SEGMENT_TOKENS", "4294967360");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "WKV_SEGMENT_TOKENS='4294967360'")) << error();
  EXPECT_TRUE(contains(error(), "unsigned 32-bit integer")) << error();
}

TEST_F(ResolveConfig, RejectsThreadCountThatWouldWrapToOne) {
  EnvGuard g("WKV_THREADS", "4294967297");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "WKV_THREADS='4294967297'")) << error();
}

TEST_F(ResolveConfig, RejectsNegativeThreadCount) {
  EnvGuard g("WKV_THREADS", "-1");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "environment variable WKV_THREADS='-1' is not an unsigned 32-bit integer"))
      << error();
}

TEST_F(ResolveConfig, RejectsHostBudgetBeyond64Bits) {
  for (const char *v : {"18446744073709551616", "99999999999999999999999999", "0x10000000000000000"}) {
    EnvGuard g("WKV_HOST_BUDGET_BYTES", v);
    EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT) << v;
    EXPECT_TRUE(contains(error(), std::string("WKV_HOST_BUDGET_BYTES='") + v + "'")) << error();
    EXPECT_TRUE(contains(error(), "unsigned 64-bit integer")) << error();
  }
}

TEST_F(ResolveConfig, AcceptsHostBudgetOfExactlyUint64Max) {
  EnvGuard g("WKV_HOST_BUDGET_BYTES", "18446744073709551615");
  wkv_config got;
  ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
  EXPECT_EQ(got.host_budget_bytes, UINT64_MAX);
}

TEST_F(ResolveConfig, RejectsNonNumericValue) {
  EnvGuard g("WKV_WINDOW_TOKENS", "abc");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "WKV_WINDOW_TOKENS='abc'")) << error();
}

TEST_F(ResolveConfig, RejectsEmptyValue) {
  EnvGuard g("WKV_KMEANS_ITERS", "");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "WKV_KMEANS_ITERS=''")) << error();
}

TEST_F(ResolveConfig, RejectsExponentInInteger) {
  EnvGuard g("WKV_SINK_TOKENS", "1e3");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "WKV_SINK_TOKENS='1e3'")) << error();
}

TEST_F(ResolveConfig, RejectsWhitespaceAroundInteger) {
  for (const char *v : {" 5", "5 ", "\t5", "5\n"}) {
    EnvGuard g("WKV_THREADS", v);
    EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT) << "'" << v << "'";
    EXPECT_TRUE(contains(error(), "WKV_THREADS")) << error();
  }
}

TEST_F(ResolveConfig, RejectsSignsAndSuffixes) {
  for (const char *v : {"+5", "64M", "0x", "0x-5", "5.0", "1,000"}) {
    EnvGuard g("WKV_WINDOW_TOKENS", v);
    EXPECT_FALSE(resolve(minimal_config()).is_ok()) << v;
  }
}

TEST_F(ResolveConfig, AcceptsHexadecimalInteger) {
  EnvGuard g("WKV_WINDOW_TOKENS", "0x10");
  wkv_config got;
  ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
  EXPECT_EQ(got.window_tokens, 16u);
}

TEST_F(ResolveConfig, ReadsLeadingZeroAsDecimalNotOctal) {
  EnvGuard g("WKV_WINDOW_TOKENS", "010");
  wkv::Config r;
  ASSERT_TRUE(resolve(minimal_config(), &r).is_ok());
  EXPECT_EQ(r.c.window_tokens, 10u);
}

TEST_F(ResolveConfig, RejectsTrailingGarbageInFraction) {
  EnvGuard g("WKV_RETRIEVAL_FRAC", "0.5x");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "WKV_RETRIEVAL_FRAC='0.5x'")) << error();
}

TEST_F(ResolveConfig, RejectsNanAndInfinityFractions) {
  for (const char *var : kFractions)
    for (const char *v : {"nan", "NAN", "inf", "infinity", "1e999", "-0.1", " 0.1", "0.1 ", ""}) {
      EnvGuard g(var, v);
      wkv::Status s = resolve(minimal_config());
      EXPECT_EQ(s.code(), WKV_ERR_INVALID_ARGUMENT) << var << "='" << v << "'";
      EXPECT_TRUE(contains(s.message(), std::string(var) + "='" + v + "'")) << s.message();
    }
}

TEST_F(ResolveConfig, AppliesValidOverrides) {
  EnvGuard a("WKV_THREADS", "2");
  EnvGuard b("WKV_SEGMENT_TOKENS", "4096");
  EnvGuard c("WKV_UPDATE_SEGMENT_TOKENS", "512");
  EnvGuard d("WKV_CLUSTER_TOKENS", "8");
  EnvGuard e("WKV_KMEANS_ITERS", "7");
  EnvGuard f("WKV_SINK_TOKENS", "0");
  EnvGuard g("WKV_WINDOW_TOKENS", "128");
  EnvGuard h("WKV_RETRIEVAL_FRAC", "0.05");
  EnvGuard i("WKV_ESTIMATION_FRAC", ".25");
  EnvGuard j("WKV_HOST_BUDGET_BYTES", "0x40000000");
  EnvGuard k("WKV_HOST_CHUNK_BYTES", "2097152");
  EnvGuard l("WKV_DEVICE_CACHE_BYTES", "1048576");
  wkv_config got;
  ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
  EXPECT_EQ(got.threads, 2u);
  EXPECT_EQ(got.segment_tokens, 4096u);
  EXPECT_EQ(got.update_segment_tokens, 512u);
  EXPECT_EQ(got.cluster_tokens, 8u);
  EXPECT_EQ(got.kmeans_iters, 7u);
  EXPECT_EQ(got.sink_tokens, 0u);
  EXPECT_EQ(got.window_tokens, 128u);
  EXPECT_FLOAT_EQ(got.retrieval_frac, 0.05f);
  EXPECT_FLOAT_EQ(got.estimation_frac, 0.25f);
  EXPECT_EQ(got.host_budget_bytes, 1ull << 30);
  EXPECT_EQ(got.host_chunk_bytes, 2ull << 20);
  EXPECT_EQ(got.device_cache_bytes, 1ull << 20);
}

TEST_F(ResolveConfig, MethodDefaultsToEveryRefinementAndTheVariableSetsIt) {
  wkv_config got;
  ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
  EXPECT_EQ(got.method, static_cast<uint32_t>(WKV_METHOD_DEFAULT));
  {
    EnvGuard m("WKV_METHOD", "0");
    ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
    EXPECT_EQ(got.method, static_cast<uint32_t>(WKV_METHOD_PAPER));
  }
  {
    EnvGuard m("WKV_METHOD", "0x6");
    ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
    EXPECT_EQ(got.method, static_cast<uint32_t>(WKV_METHOD_ONES | WKV_METHOD_SPREAD));
  }
}

TEST_F(ResolveConfig, RejectsUnknownMethodBitsNamingWhereTheyCameFrom) {
  wkv_config c = minimal_config();
  c.method = WKV_METHOD_DEFAULT | 0x10u;
  EXPECT_EQ(open(c), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "method 0x1f (from the config)")) << error();
  EnvGuard m("WKV_METHOD", "32");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "from the environment variable WKV_METHOD")) << error();
  c = minimal_config();
  c.reserved1 = 1;
  EnvGuard n("WKV_METHOD", nullptr);
  EXPECT_EQ(open(c), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "reserved1")) << error();
}

TEST_F(ResolveConfig, PageFormatDefaultsToStorageAndTheVariableSetsIt) {
  wkv_config got;
  ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
  EXPECT_EQ(got.page_format, static_cast<uint32_t>(WKV_PAGE_FORMAT_STORAGE));
  wkv_config c = minimal_config();
  c.page_format = WKV_PAGE_FORMAT_INT8;
  ASSERT_EQ(open(c, &got), WKV_OK) << error();
  EXPECT_EQ(got.page_format, static_cast<uint32_t>(WKV_PAGE_FORMAT_INT8));
  c.page_format = WKV_PAGE_FORMAT_INT8_CENTERED;
  ASSERT_EQ(open(c, &got), WKV_OK) << error();
  EXPECT_EQ(got.page_format, static_cast<uint32_t>(WKV_PAGE_FORMAT_INT8_CENTERED));
  EnvGuard f("WKV_PAGE_FORMAT", "1");
  ASSERT_EQ(open(minimal_config(), &got), WKV_OK) << error();
  EXPECT_EQ(got.page_format, static_cast<uint32_t>(WKV_PAGE_FORMAT_INT8));
}

TEST_F(ResolveConfig, RejectsUnknownPageFormatsNamingWhereTheyCameFrom) {
  wkv_config c = minimal_config();
  c.page_format = 3;
  EXPECT_EQ(open(c), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "page_format 3 (from the config)")) << error();
  EnvGuard f("WKV_PAGE_FORMAT", "7");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "from the environment variable WKV_PAGE_FORMAT")) << error();
}

TEST_F(ResolveConfig, RejectsEveryMalformedValueOfEveryVariable) {
  for (const char *var : kVariables)
    for (const char *v : {"", "abc", "-1", " 5", "5 ", "0.5x", "5k"}) {
      EnvGuard g(var, v);
      EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT) << var << "='" << v << "'";
      EXPECT_TRUE(contains(error(), std::string(var) + "='" + v + "'")) << error();
    }
}

// WKV_CACHE_POLICY names the device cache's replacement policy (no config
// field): a known name opens, another fails the open saying which names are.
TEST_F(ResolveConfig, CachePolicyVariableTakesKnownNamesOnly) {
  for (const char *name : {"lru", "clock", "slru"}) {
    EnvGuard g("WKV_CACHE_POLICY", name);
    EXPECT_EQ(open(minimal_config()), WKV_OK) << name << ": " << error();
  }
  for (const char *bad : {"", "LRU", "fifo", "lru "}) {
    EnvGuard g("WKV_CACHE_POLICY", bad);
    EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT) << "'" << bad << "'";
    EXPECT_TRUE(contains(error(), "WKV_CACHE_POLICY")) << error();
    EXPECT_TRUE(contains(error(), "lru, clock or slru")) << error();
  }
}

// WKV_QUARANTINE and WKV_CACHE_RESERVE pick how the buffer manager frees
// and keeps frames (no config fields): their two names open, anything else
// fails the open naming the variable and its choices.
TEST_F(ResolveConfig, QuarantineAndReserveVariablesTakeTheirNamesOnly) {
  const struct {
    const char *var, *a, *b, *choices;
  } cases[] = {{"WKV_QUARANTINE", "readers", "steps", "neither 'readers' nor 'steps'"},
               {"WKV_CACHE_RESERVE", "readers", "burst", "neither 'readers' nor 'burst'"}};
  for (const auto &c : cases) {
    for (const char *name : {c.a, c.b}) {
      EnvGuard g(c.var, name);
      EXPECT_EQ(open(minimal_config()), WKV_OK) << c.var << "=" << name << ": " << error();
    }
    for (const char *bad : {"", "Readers", "all", "steps "}) {
      EnvGuard g(c.var, bad);
      EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT) << c.var << "='" << bad << "'";
      EXPECT_TRUE(contains(error(), c.var)) << error();
      EXPECT_TRUE(contains(error(), c.choices)) << error();
    }
  }
}

TEST_F(ResolveConfig, RejectsHostChunkBytesOfUint64Max) {
  wkv_config c = minimal_config();
  c.host_chunk_bytes = UINT64_MAX;
  EXPECT_EQ(open(c), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "host_chunk_bytes 18446744073709551615 (from the config) is above 1 TiB"))
      << error();
}

TEST_F(ResolveConfig, RejectsNegativeHostChunkBytesVariable) {
  EnvGuard g("WKV_HOST_CHUNK_BYTES", "-1");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "WKV_HOST_CHUNK_BYTES='-1'")) << error();
}

TEST_F(ResolveConfig, RejectsHostChunkBytesVariableAboveOneTebibyte) {
  EnvGuard g("WKV_HOST_CHUNK_BYTES", "1099511627777");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "from the environment variable WKV_HOST_CHUNK_BYTES")) << error();
}

TEST_F(ResolveConfig, RaisesSmallHostChunkFromTheConfigToOneMebibyte) {
  wkv_config c = minimal_config();
  for (uint64_t bytes : {0ull, 4096ull, (1ull << 20) - 1}) {
    c.host_chunk_bytes = bytes;
    wkv_config got;
    ASSERT_EQ(open(c, &got), WKV_OK) << bytes << ": " << error();
    EXPECT_EQ(got.host_chunk_bytes, 1ull << 20);
  }
}

TEST_F(ResolveConfig, RejectsSmallHostChunkFromTheVariable) {
  EnvGuard g("WKV_HOST_CHUNK_BYTES", "4096");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "host_chunk_bytes 4096 (from the environment variable WKV_HOST_CHUNK_BYTES) "
                                "is below 1 MiB"))
      << error();
}

TEST_F(ResolveConfig, RejectsChunkOfMoreThan2To32PageSlots) {
  // f16, head_dim 64, page_bytes 64: one token per page, a 256-byte slot.
  wkv_config c = minimal_config();
  c.dtype = WKV_DTYPE_F16;
  c.page_bytes = 64;
  wkv::Config r;
  c.host_chunk_bytes = (1ull << 40) - 256;  // 2^32 - 1 slots
  ASSERT_TRUE(resolve(c, &r).is_ok());
  EXPECT_EQ(r.page_slot_bytes(), 256u);
  c.host_chunk_bytes = 1ull << 40;  // 2^32 slots
  wkv::Status s = resolve(c);
  EXPECT_EQ(s.code(), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(s.message(), "more than 2^32 - 1")) << s.message();
}

TEST_F(ResolveConfig, RejectsHostBudgetSmallerThanOnePageSlot) {
  wkv_config c = minimal_config();
  wkv::Config r;
  ASSERT_TRUE(resolve(c, &r).is_ok());
  const uint64_t slot = r.page_slot_bytes();
  c.host_budget_bytes = slot - 1;
  EXPECT_EQ(open(c), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "host_budget_bytes")) << error();
  c.host_budget_bytes = slot;
  EXPECT_EQ(open(c), WKV_OK) << error();
  c.host_budget_bytes = 0;
  EXPECT_EQ(open(c), WKV_OK) << error();

  c = minimal_config();
  EnvGuard g("WKV_HOST_BUDGET_BYTES", "1");
  EXPECT_EQ(open(c), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "from the environment variable WKV_HOST_BUDGET_BYTES")) << error();
}

TEST_F(ResolveConfig, RejectsSegmentsLargerThanTheDeviceKMeansTakes) {
  wkv_config c = minimal_config();
  c.segment_tokens = 65536;
  c.update_segment_tokens = 65536;
  EXPECT_TRUE(resolve(c).is_ok());
  c.segment_tokens = 65537;
  wkv::Status s = resolve(c);
  EXPECT_EQ(s.code(), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(s.message(), "segment_tokens 65537 (from the config)")) << s.message();

  EnvGuard g("WKV_UPDATE_SEGMENT_TOKENS", "65537");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "update_segment_tokens 65537 (from the environment variable "
                                "WKV_UPDATE_SEGMENT_TOKENS)"))
      << error();
}

TEST_F(ResolveConfig, RejectsClusterTokensAboveSegmentTokens) {
  wkv_config c = minimal_config();
  c.segment_tokens = 64;
  c.cluster_tokens = 64;
  EXPECT_TRUE(resolve(c).is_ok());
  EnvGuard g("WKV_CLUSTER_TOKENS", "65");
  wkv::Status s = resolve(c);
  EXPECT_EQ(s.code(), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(s.message(), "cluster_tokens 65 (from the environment variable WKV_CLUSTER_TOKENS) "
                                    "is above segment_tokens 64 (from the config)"))
      << s.message();
}

TEST_F(ResolveConfig, RejectsSinkAndWindowAboveTwoTo20) {
  wkv_config c = minimal_config();
  c.sink_tokens = 1u << 20;
  c.window_tokens = 1u << 20;
  EXPECT_TRUE(resolve(c).is_ok());
  c.sink_tokens = (1u << 20) + 1;
  EXPECT_TRUE(contains(resolve(c).message(), "sink_tokens 1048577 (from the config)"));
  c.sink_tokens = 4;
  EnvGuard g("WKV_WINDOW_TOKENS", "4294967295");
  EXPECT_EQ(open(c), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "window_tokens 4294967295 (from the environment variable WKV_WINDOW_TOKENS)"))
      << error();
}

TEST_F(ResolveConfig, RejectsTooManyThreadsNamingTheVariable) {
  EnvGuard g("WKV_THREADS", "4097");
  EXPECT_EQ(open(minimal_config()), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(error(), "threads 4097 is too many (from the environment variable WKV_THREADS"))
      << error();
}

TEST_F(ResolveConfig, RejectsDeviceCacheAboveOnePebibyte) {
  wkv_config c = minimal_config();
  c.device_cache_bytes = 1ull << 50;
  EXPECT_TRUE(resolve(c).is_ok());
  c.device_cache_bytes = UINT64_MAX;
  wkv::Status s = resolve(c);
  EXPECT_EQ(s.code(), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(s.message(), "device_cache_bytes")) << s.message();
}

TEST_F(ResolveConfig, AcceptsAnySeed) {
  wkv_config c = minimal_config();
  c.seed = UINT64_MAX;
  wkv_config got;
  ASSERT_EQ(open(c, &got), WKV_OK) << error();
  EXPECT_EQ(got.seed, UINT64_MAX);
}

TEST_F(ResolveConfig, LeavesOutputUntouchedOnFailure) {
  wkv_config c = minimal_config();
  c.host_chunk_bytes = UINT64_MAX;
  wkv::Config r;
  r.c.seed = 42;
  EXPECT_FALSE(resolve(c, &r).is_ok());
  EXPECT_EQ(r.c.seed, 42u);
}

}  // namespace
