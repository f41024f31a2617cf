// A libFuzzer target for the C ABI: each input opens a CPU engine with a
// configuration drawn from it (valid or not) and plays a sequence of calls
// drawn from it against that engine: creating and destroying sequences and
// plans, appending with any strides, ending prompts, describing, looking up,
// assembling, attending, merging, updating and decoding, evicting sequences to
// the spill file and restoring them, saving sequences to a file and loading
// them back (the file intact, damaged or cut short), with live, destroyed,
// mistyped, foreign and null handles, layers out of range, sequences listed
// twice and buffers of every size.
//
// What it checks, besides the sanitizers' checks (the fuzz build is ASan +
// UBSan): every call returns a status of the header's list, and a failed one
// leaves a message; an append that fails leaves its sequence's token count as
// it was and one that succeeds adds its tokens; a sequence loaded from its
// saved file holds the saved token counts, and a damaged file never loads
// (every byte has a checksum, docs/FORMAT.md); the engine refuses whatever a
// caller cannot have meant (a null pointer, a stride whose extent overflows,
// a handle that is not live); and while every value appended and queried is
// finite and small, every output is finite.
//
// Buffers are allocated to the exact extent the call's strides imply, so that
// a read or write past what the caller passed is an ASan report, not a
// guess. Strides whose extent no buffer could hold are passed with a small
// buffer and must be refused.
//
// Built by `make fuzz` (clang, -fsanitize=fuzzer); every other build compiles
// it with tests/fuzz/replay_main.cpp and replays the seed corpus in
// tests/fuzz/corpus/c_abi as the fuzz_c_abi_corpus test.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "wavekv/wavekv.h"

namespace {

// A failed check: print what and abort, which the fuzzer reports as a crash.
[[noreturn]] void fail(const char *what, int status) {
  std::fprintf(stderr, "fuzz_c_abi: %s (status %d %s, last error \"%s\")\n", what, status,
               wkv_status_name(status), wkv_last_error());
  std::abort();
}

void check_status(const char *verb, int status) {
  if (status < WKV_OK || status > WKV_ERR_NO_DEVICE) fail(verb, status);
  if (status == WKV_ERR_INTERNAL) fail(verb, status);
  if (status != WKV_OK && wkv_last_error()[0] == '\0') fail("an error without a message", status);
}

// WKV_FUZZ_TRACE=1 prints each call, for reading a crashing input.
const bool kTrace = std::getenv("WKV_FUZZ_TRACE") != nullptr;
#define TRACE(...) \
  do {                                     \
    if (kTrace) std::fprintf(stderr, __VA_ARGS__); \
  } while (0)

size_t dtype_bytes(uint32_t dtype) { return dtype == WKV_DTYPE_F32 ? 4 : 2; }

// The process's spill directory: made once under $TMPDIR, removed at exit
// (the engines' spill files have no name, so it is empty by then).
std::string g_spill_dir;
void remove_spill_dir() {
  if (!g_spill_dir.empty()) rmdir(g_spill_dir.c_str());
}
const char *spill_dir() {
  if (g_spill_dir.empty()) {
    const char *base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/wavekv-fuzz-spill-XXXXXX";
    if (!mkdtemp(tmpl.data())) return "/nonexistent/wavekv-spill";
    g_spill_dir = tmpl;
    std::atexit(remove_spill_dir);
  }
  return g_spill_dir.c_str();
}

// Element values: small finite ones from a generator seeded by the input, or,
// once the input asks for them, NaN, infinities and huge values too.
struct Values {
  uint64_t state = 0;
  bool special = false;

  uint32_t next() {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return static_cast<uint32_t>((z ^ (z >> 31)) >> 16);
  }

  void fill(void *dst, size_t elements, uint32_t dtype) {
    for (size_t i = 0; i < elements; ++i) {
      uint32_t r = next();
      if (special && (r & 63) == 0) {
        // f32 NaN, +-Inf, 3e38; f16/bf16 NaN, +-Inf, the largest finite.
        static const uint32_t f32[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x7f61b1e6u};
        static const uint16_t f16[] = {0x7e00u, 0x7c00u, 0xfc00u, 0x7bffu};
        static const uint16_t bf16[] = {0x7fc0u, 0x7f80u, 0xff80u, 0x7f7fu};
        uint32_t k = (r >> 6) & 3;
        if (dtype == WKV_DTYPE_F32) std::memcpy(static_cast<char *>(dst) + 4 * i, &f32[k], 4);
        else std::memcpy(static_cast<char *>(dst) + 2 * i, dtype == WKV_DTYPE_F16 ? &f16[k] : &bf16[k], 2);
        continue;
      }
      uint32_t sign = (r >> 31) & 1;
      if (dtype == WKV_DTYPE_F32) {
        float x = (static_cast<float>(r & 0xffffff) / 8388608.0f - 1.0f) * 2.0f;  // [-2, 2)
        std::memcpy(static_cast<char *>(dst) + 4 * i, &x, 4);
      } else if (dtype == WKV_DTYPE_F16) {
        // exponent 5..16 (2^-10 .. 2^1), any mantissa
        uint16_t h = static_cast<uint16_t>(sign << 15 | (5 + (r >> 10) % 12) << 10 | (r & 0x3ff));
        std::memcpy(static_cast<char *>(dst) + 2 * i, &h, 2);
      } else {
        // exponent 117..128 (2^-10 .. 2^1)
        uint16_t b = static_cast<uint16_t>(sign << 15 | (117 + (r >> 7) % 12) << 7 | (r & 0x7f));
        std::memcpy(static_cast<char *>(dst) + 2 * i, &b, 2);
      }
    }
  }
};

bool all_finite(const void *src, size_t elements, uint32_t dtype) {
  for (size_t i = 0; i < elements; ++i) {
    if (dtype == WKV_DTYPE_F32) {
      float x;
      std::memcpy(&x, static_cast<const char *>(src) + 4 * i, 4);
      if (!std::isfinite(x)) return false;
    } else {
      uint16_t h;
      std::memcpy(&h, static_cast<const char *>(src) + 2 * i, 2);
      uint16_t exp_mask = dtype == WKV_DTYPE_F16 ? 0x7c00u : 0x7f80u;
      if ((h & exp_mask) == exp_mask) return false;
    }
  }
  return true;
}

constexpr uint64_t kMaxBuffer = 64ull << 20;  // bytes: larger extents get packed strides
constexpr uint32_t kMaxLiveSeqs = 4;
constexpr uint32_t kMaxTokensPerInput = 2048;

// The strides of one tensor argument [n][rows][dim], in elements: packed,
// padded, too small, negative, or anything.
struct Strides {
  int64_t outer = 0, inner = 0;
  bool must_refuse = false;  // the extent passes 2^63 bytes: the engine has to refuse
  uint64_t elements = 0;     // what to allocate: the extent these strides reach
};

Strides draw_strides(FuzzedDataProvider &in, bool sane, uint64_t n, uint64_t rows, uint64_t dim, size_t bytes) {
  Strides s;
  auto pick = [&](uint64_t packed) -> int64_t {
    switch (in.ConsumeIntegralInRange<int>(0, sane ? 4 : 7)) {
      case 0:
      case 1:
      case 2: return 0;
      case 3: return static_cast<int64_t>(packed);
      case 4: return static_cast<int64_t>(packed + in.ConsumeIntegralInRange<uint32_t>(1, 64));
      case 5: return static_cast<int64_t>(packed) - in.ConsumeIntegralInRange<int64_t>(1, 4);
      case 6: return -in.ConsumeIntegralInRange<int64_t>(1, 1000);
      default: return in.ConsumeIntegral<int64_t>();
    }
  };
  s.inner = pick(dim);
  s.outer = pick(rows * dim);
  const uint64_t packed = n * rows * dim;
  if (s.inner < 0 || s.outer < 0) {
    // Refused, or (one token, one row) never applied: a buffer of the packed
    // extent, so that any use of a negative stride reads before it.
    s.elements = packed;
    return s;
  }
  const __int128 inner = s.inner == 0 ? static_cast<__int128>(dim) : s.inner;
  // The header's packed: token (or sequence) stride 0 is rows x the row stride.
  const __int128 outer = s.outer == 0 ? rows * inner : static_cast<__int128>(s.outer);
  __int128 extent = 0;
  if (n > 0 && rows > 0) extent = (n - 1) * outer + (rows - 1) * inner + dim;
  if (extent * bytes > (static_cast<__int128>(1) << 63)) {
    s.must_refuse = true;
    s.elements = packed;
  } else if (extent * bytes > static_cast<__int128>(kMaxBuffer)) {
    s.outer = s.inner = 0;
    s.elements = packed;
  } else {
    s.elements = static_cast<uint64_t>(extent);
  }
  return s;
}

// What a plan holds, as far as the calls so far tell.
enum Step { kNoStep, kLookedUp, kAssembled, kUnknown };
struct PlanState {
  wkv_plan *plan;
  uint32_t n;  // sequences of its last lookup
  Step step;
};

class Session {
 public:
  Session(FuzzedDataProvider &in) : in_(in) {}
  ~Session() {
    for (wkv_plan *p : plans_) wkv_plan_destroy(p);
    for (wkv_seq *s : seqs_) wkv_seq_destroy(s);
    wkv_engine_close(engine_);
  }

  bool open() {
    wkv_config c;
    wkv_config_init(&c);
    c.device = WKV_DEVICE_CPU;
    c.n_layers = in_.ConsumeIntegralInRange<uint32_t>(0, 3);
    c.n_kv_heads = in_.ConsumeIntegralInRange<uint32_t>(1, 3);
    c.n_q_heads = c.n_kv_heads * in_.ConsumeIntegralInRange<uint32_t>(1, 3);
    if (in_.ConsumeBool()) c.n_q_heads += in_.ConsumeIntegralInRange<uint32_t>(0, 2);  // may not divide
    static const uint32_t dims[] = {64, 80, 96, 128, 256, 32, 0};
    c.head_dim = in_.PickValueInArray(dims);
    c.dtype = in_.ConsumeIntegralInRange<uint32_t>(0, 3);
    c.segment_tokens = in_.ConsumeIntegralInRange<uint32_t>(0, 300);
    c.update_segment_tokens = in_.ConsumeIntegralInRange<uint32_t>(0, 200);
    c.cluster_tokens = in_.ConsumeIntegralInRange<uint32_t>(0, 40);
    c.kmeans_iters = in_.ConsumeIntegralInRange<uint32_t>(0, 4);
    c.sink_tokens = in_.ConsumeIntegralInRange<uint32_t>(0, 20);
    c.window_tokens = in_.ConsumeIntegralInRange<uint32_t>(0, 80);
    if (in_.ConsumeBool()) {
      c.retrieval_frac = in_.ConsumeFloatingPoint<float>();
      c.estimation_frac = in_.ConsumeFloatingPoint<float>();
    } else {
      c.retrieval_frac = in_.ConsumeProbability<float>();
      c.estimation_frac = in_.ConsumeProbability<float>() * (1.0f - c.retrieval_frac);
    }
    static const uint32_t pages[] = {2048, 0, 512, 4096, 100, 1u << 20};
    c.page_bytes = in_.PickValueInArray(pages);
    c.threads = in_.ConsumeIntegralInRange<uint32_t>(1, 2);
    c.flags = in_.ConsumeBool() ? in_.ConsumeIntegral<uint32_t>() : uint32_t{WKV_CONFIG_NO_NUMA};
    // Either page format, and one time in sixteen 2, which is none (refused).
    // One byte, as before page_format, so that the seed corpus keeps its configurations.
    const int format = in_.ConsumeIntegralInRange<int>(0, 15);
    c.page_format = format == 0 ? 2u : static_cast<uint32_t>(format & 1);
    static const uint64_t budgets[] = {0, 1ull << 20, 4ull << 20, 64ull << 10, 1};
    c.host_budget_bytes = in_.PickValueInArray(budgets);
    static const uint64_t chunks[] = {1ull << 20, 2ull << 20, 0, 4096};
    c.host_chunk_bytes = in_.PickValueInArray(chunks);
    c.seed = in_.ConsumeIntegral<uint64_t>();
    // The spill tier: mostly a directory of the process's own, sometimes none
    // or one that cannot hold a file; budgets from none to a few pages.
    switch (in_.ConsumeIntegralInRange<int>(0, 7)) {
      case 0: c.spill_dir = nullptr; break;
      case 1: c.spill_dir = "/nonexistent/wavekv-spill"; break;
      case 2: c.spill_dir = ""; break;
      default: c.spill_dir = spill_dir(); break;
    }
    static const uint64_t spill_budgets[] = {0, 0, 64ull << 10, 4096, 1ull << 20};
    c.spill_budget_bytes = in_.PickValueInArray(spill_budgets);
    if (in_.ConsumeIntegralInRange<int>(0, 31) == 0) c.size = in_.ConsumeIntegralInRange<uint32_t>(0, 2 * sizeof c);
    cfg_ = c;
    int rc = wkv_engine_open(&c, &engine_);
    TRACE("open layers=%u q=%u kv=%u d=%u dtype=%u seg=%u upd=%u cl=%u sink=%u win=%u frac=%g,%g page=%u "
          "format=%u -> %s\n",
          c.n_layers, c.n_q_heads, c.n_kv_heads, c.head_dim, c.dtype, c.segment_tokens, c.update_segment_tokens,
          c.cluster_tokens, c.sink_tokens, c.window_tokens, c.retrieval_frac, c.estimation_frac, c.page_bytes,
          c.page_format, wkv_status_name(rc));
    check_status("wkv_engine_open", rc);
    if (rc != WKV_OK) {
      if (engine_ != nullptr) fail("a failed open returned an engine", rc);
      return false;
    }
    values_.state = in_.ConsumeIntegral<uint64_t>();
    return true;
  }

  void run() {
    // The configuration the engine settled on (environment, defaults).
    cfg_.size = sizeof cfg_;
    check_status("wkv_engine_config", wkv_engine_config(engine_, &cfg_));
    // Every input starts with a sequence and a plan; each call is then either
    // well formed (three in four: live handles, layers in range, packed or
    // padded strides, distinct sequences) or anything.
    create_seq();
    create_or_destroy_plan();
    for (int op = 0; op < 64 && in_.remaining_bytes() > 0; ++op) {
      const int verb = in_.ConsumeIntegralInRange<int>(0, 16);
      sane_ = in_.ConsumeIntegralInRange<int>(0, 3) != 0;
      step(verb);
    }
  }

 private:
  // A sequence handle for a call: mostly live, else destroyed, null, another
  // object's handle, or any value.
  wkv_seq *pick_seq() {
    switch (in_.ConsumeIntegralInRange<int>(sane_ ? 4 : 0, 9)) {
      case 0: return nullptr;
      case 1: return dead_seqs_.empty() ? nullptr : dead_seqs_[in_.ConsumeIntegralInRange<size_t>(0, dead_seqs_.size() - 1)];
      case 2: return reinterpret_cast<wkv_seq *>(in_.ConsumeIntegral<uintptr_t>());
      case 3: return plans_.empty() ? nullptr : reinterpret_cast<wkv_seq *>(plans_[0]);
      default:
        return seqs_.empty() ? nullptr : seqs_[in_.ConsumeIntegralInRange<size_t>(0, seqs_.size() - 1)];
    }
  }

  wkv_plan *pick_plan() {
    switch (in_.ConsumeIntegralInRange<int>(sane_ ? 4 : 0, 9)) {
      case 0: return nullptr;
      case 1: return dead_plans_.empty() ? nullptr : dead_plans_.back();
      case 2: return reinterpret_cast<wkv_plan *>(in_.ConsumeIntegral<uintptr_t>());
      case 3: return seqs_.empty() ? nullptr : reinterpret_cast<wkv_plan *>(seqs_[0]);
      default: return plans_.empty() ? nullptr : plans_[in_.ConsumeIntegralInRange<size_t>(0, plans_.size() - 1)];
    }
  }

  PlanState *state_of(wkv_plan *p) {
    for (PlanState &ps : plan_states_)
      if (ps.plan == p) return &ps;
    return nullptr;
  }

  bool is_live(wkv_seq *s) const {
    for (wkv_seq *x : seqs_)
      if (x == s) return true;
    return false;
  }

  uint32_t pick_layer() {
    return !sane_ && in_.ConsumeIntegralInRange<int>(0, 7) == 0 ? in_.ConsumeIntegral<uint32_t>()
                                                      : in_.ConsumeIntegralInRange<uint32_t>(0, cfg_.n_layers - 1);
  }

  uint64_t tokens_of(wkv_seq *s, uint32_t layer) {
    wkv_seq_info info;
    wkv_seq_info_init(&info);
    int rc = wkv_seq_info_get(s, layer, &info);
    return rc == WKV_OK ? info.tokens : UINT64_MAX;
  }

  void step(int op) {
    switch (op) {
      case 0: create_seq(); break;
      case 1: destroy_seq(); break;
      case 2:
      case 3:
      case 4: append(); break;
      case 5: end_prompt(); break;
      case 6: describe(); break;
      case 7: create_or_destroy_plan(); break;
      case 8:
      case 9: lookup(false); break;
      case 10: lookup(true); break;
      case 11: plan_verbs(); break;
      case 12: stats(); break;
      case 13: values_.special = values_.special || in_.ConsumeBool(); break;
      case 14: close_engine(); break;
      case 15: evict_or_restore(); break;
      default: save_and_load(); break;
    }
  }

  void create_seq() {
    if (seqs_.size() >= kMaxLiveSeqs) return;
    wkv_seq *s = nullptr;
    int rc = wkv_seq_create(!sane_ && in_.ConsumeIntegralInRange<int>(0, 7) == 0 ? nullptr : engine_, &s);
    check_status("wkv_seq_create", rc);
    if (rc == WKV_OK) {
      if (closed_) fail("a closed engine created a sequence", rc);
      seqs_.push_back(s);
    }
  }

  void destroy_seq() {
    if (seqs_.empty()) return;
    size_t i = in_.ConsumeIntegralInRange<size_t>(0, seqs_.size() - 1);
    wkv_seq_destroy(seqs_[i]);
    if (in_.ConsumeBool()) wkv_seq_destroy(seqs_[i]);  // twice: a no-op
    dead_seqs_.push_back(seqs_[i]);
    seqs_.erase(seqs_.begin() + static_cast<ptrdiff_t>(i));
  }

  void append() {
    wkv_seq *s = pick_seq();
    uint32_t layer = pick_layer();
    uint32_t n = in_.ConsumeIntegralInRange<uint32_t>(sane_ ? 1 : 0, 96);
    if (tokens_ + n > kMaxTokensPerInput) n = 1;
    const uint64_t rows = cfg_.n_kv_heads, dim = cfg_.head_dim;
    const size_t bytes = dtype_bytes(cfg_.dtype);
    Strides st = draw_strides(in_, sane_, n, rows, dim, bytes);
    std::vector<char> k(st.elements * bytes), v(st.elements * bytes);
    values_.fill(k.data(), st.elements, cfg_.dtype);
    values_.fill(v.data(), st.elements, cfg_.dtype);
    const bool null_k = !sane_ && in_.ConsumeIntegralInRange<int>(0, 15) == 0;
    const bool live = is_live(s);
    const uint64_t before = live ? tokens_of(s, layer) : UINT64_MAX;
    TRACE("append seq=%p layer=%u n=%u strides=%lld,%lld elements=%llu live=%d\n", static_cast<void *>(s), layer, n,
          static_cast<long long>(st.outer), static_cast<long long>(st.inner),
          static_cast<unsigned long long>(st.elements), live);
    int rc = wkv_seq_append(s, layer, null_k ? nullptr : k.data(), v.data(), n, st.outer, st.inner, nullptr);
    TRACE("  -> %s\n", wkv_status_name(rc));
    check_status("wkv_seq_append", rc);
    if (rc == WKV_OK) {
      if (!live) fail("an append through a handle that is not live succeeded", rc);
      if (null_k || n == 0) fail("an append of null keys or no tokens succeeded", rc);
      if (st.must_refuse) fail("an append with an overflowing extent succeeded", rc);
      if (tokens_of(s, layer) != before + n) fail("an append did not add its tokens", rc);
      tokens_ += n;
    } else if (live && before != UINT64_MAX && tokens_of(s, layer) != before) {
      fail("a failed append changed its sequence", rc);
    }
  }

  // Evicts or restores a sequence: whatever the outcome, no token is lost
  // or added, and a handle that is not live is refused.
  void evict_or_restore() {
    wkv_seq *s = pick_seq();
    const bool live = is_live(s), evict = in_.ConsumeBool();
    uint64_t before[4];
    for (uint32_t l = 0; l < 4; ++l) before[l] = live ? tokens_of(s, l) : UINT64_MAX;
    const int rc = evict ? wkv_seq_evict(s) : wkv_seq_restore(s);
    TRACE("%s -> %s\n", evict ? "evict" : "restore", wkv_status_name(rc));
    check_status(evict ? "wkv_seq_evict" : "wkv_seq_restore", rc);
    if (rc == WKV_OK && !live) fail("evict or restore through a handle that is not live succeeded", rc);
    if (evict && rc == WKV_OK && cfg_.spill_dir == nullptr) fail("an engine without a spill file evicted", rc);
    for (uint32_t l = 0; live && l < 4; ++l)
      if (tokens_of(s, l) != before[l]) fail("evict or restore changed a token count", rc);
  }

  // Saves a sequence into an anonymous file and loads it back as a new
  // sequence, which holds the saved token counts; or, drawn from the input,
  // flips a byte of the file or cuts it short first, and the load must fail.
  void save_and_load() {
    wkv_seq *s = pick_seq();
    const bool live = is_live(s);
    const int fd = memfd_create("wavekv-fuzz-save", 0);
    if (fd < 0) return;
    uint32_t flags = WKV_SAVE_NO_FSYNC;
    if (!sane_ && in_.ConsumeIntegralInRange<int>(0, 7) == 0) flags = in_.ConsumeIntegral<uint32_t>();
    const int save_fd = !sane_ && in_.ConsumeIntegralInRange<int>(0, 7) == 0 ? -1 : fd;
    uint64_t before[4];
    for (uint32_t l = 0; l < 4; ++l) before[l] = live ? tokens_of(s, l) : UINT64_MAX;
    const int rc = wkv_seq_save_fd(s, save_fd, flags);
    TRACE("save -> %s\n", wkv_status_name(rc));
    check_status("wkv_seq_save_fd", rc);
    if (rc == WKV_OK && !live) fail("save through a handle that is not live succeeded", rc);
    if (rc == WKV_OK && save_fd < 0) fail("save into a negative fd succeeded", rc);
    if (rc == WKV_OK && (flags & ~uint32_t{WKV_SAVE_NO_FSYNC})) fail("save with unknown flags succeeded", rc);
    for (uint32_t l = 0; live && l < 4; ++l)
      if (tokens_of(s, l) != before[l]) fail("save changed a token count", rc);
    bool damaged = false;
    const off_t size = lseek(fd, 0, SEEK_END);
    if (rc == WKV_OK && size > 0) {
      switch (in_.ConsumeIntegralInRange<int>(0, 5)) {
        case 0: {  // one byte flipped
          const off_t at = static_cast<off_t>(in_.ConsumeIntegralInRange<uint64_t>(0, static_cast<uint64_t>(size) - 1));
          unsigned char b = 0;
          if (pread(fd, &b, 1, at) == 1) {
            b ^= static_cast<unsigned char>(in_.ConsumeIntegralInRange<unsigned>(1, 255));
            damaged = pwrite(fd, &b, 1, at) == 1;
          }
          break;
        }
        case 1:  // cut short
          damaged = ftruncate(fd, static_cast<off_t>(in_.ConsumeIntegralInRange<uint64_t>(0, static_cast<uint64_t>(size) - 1))) == 0;
          break;
        default: break;
      }
    }
    wkv_seq *loaded = nullptr;
    const int lrc = wkv_seq_load_fd(engine_, fd, &loaded);
    TRACE("load%s -> %s\n", damaged ? " (damaged)" : "", wkv_status_name(lrc));
    check_status("wkv_seq_load_fd", lrc);
    close(fd);
    if (lrc != WKV_OK) {
      if (loaded != nullptr) fail("a failed load returned a sequence", lrc);
      return;
    }
    if (damaged) fail("a damaged sequence file loaded", lrc);
    if (rc != WKV_OK) fail("a file that was never saved loaded", lrc);
    for (uint32_t l = 0; l < cfg_.n_layers && l < 4; ++l)
      if (tokens_of(loaded, l) != before[l]) fail("a loaded sequence holds other token counts than the saved one", lrc);
    if (seqs_.size() < kMaxLiveSeqs) {
      seqs_.push_back(loaded);
    } else {
      wkv_seq_destroy(loaded);
      dead_seqs_.push_back(loaded);
    }
  }

  void end_prompt() {
    wkv_seq *s = pick_seq();
    uint32_t layer = pick_layer();
    const bool live = is_live(s);
    const uint64_t before = live ? tokens_of(s, layer) : UINT64_MAX;
    int rc = wkv_seq_end_prompt(s, layer, nullptr);
    check_status("wkv_seq_end_prompt", rc);
    if (rc == WKV_OK && !live) fail("end_prompt through a handle that is not live succeeded", rc);
    if (live && before != UINT64_MAX && tokens_of(s, layer) != before) fail("end_prompt changed the token count", rc);
  }

  void describe() {
    wkv_seq_info info;
    wkv_seq_info_init(&info);
    if (in_.ConsumeBool()) info.size = in_.ConsumeIntegralInRange<uint32_t>(0, sizeof info);
    wkv_seq *s = pick_seq();
    int rc = wkv_seq_info_get(s, pick_layer(), in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? nullptr : &info);
    check_status("wkv_seq_info_get", rc);
    if (rc == WKV_OK && !is_live(s)) fail("info through a handle that is not live succeeded", rc);
  }

  void create_or_destroy_plan() {
    if (plans_.size() < 2 && (plans_.empty() || in_.ConsumeBool())) {
      wkv_plan *p = nullptr;
      int rc = wkv_plan_create(engine_, &p);
      TRACE("plan_create -> %s %p\n", wkv_status_name(rc), static_cast<void *>(p));
      check_status("wkv_plan_create", rc);
      if (rc == WKV_OK) {
        if (closed_) fail("a closed engine created a plan", rc);
        plans_.push_back(p);
        plan_states_.push_back({p, 0, kNoStep});
      }
    } else if (!plans_.empty()) {
      size_t i = in_.ConsumeIntegralInRange<size_t>(0, plans_.size() - 1);
      TRACE("plan_destroy %p\n", static_cast<void *>(plans_[i]));
      wkv_plan_destroy(plans_[i]);
      plan_states_.erase(plan_states_.begin() + static_cast<ptrdiff_t>(i));
      dead_plans_.push_back(plans_[i]);
      plans_.erase(plans_.begin() + static_cast<ptrdiff_t>(i));
    }
  }

  // A lookup, or a decode.
  void lookup(bool decode) {
    wkv_plan *plan = pick_plan();
    std::vector<wkv_seq *> batch;
    if (sane_ && !seqs_.empty()) {
      // Distinct live sequences, in an order the input picks.
      std::vector<wkv_seq *> pool = seqs_;
      for (uint32_t i = 0, m = in_.ConsumeIntegralInRange<uint32_t>(1, pool.size()); i < m; ++i) {
        size_t j = in_.ConsumeIntegralInRange<size_t>(0, pool.size() - 1);
        batch.push_back(pool[j]);
        pool.erase(pool.begin() + static_cast<ptrdiff_t>(j));
      }
    } else {
      for (uint32_t i = 0, m = in_.ConsumeIntegralInRange<uint32_t>(0, 5); i < m; ++i) batch.push_back(pick_seq());
    }
    const uint32_t n = static_cast<uint32_t>(batch.size());
    uint32_t layer = pick_layer();
    const uint64_t rows = cfg_.n_q_heads, dim = cfg_.head_dim;
    const size_t bytes = dtype_bytes(cfg_.dtype);
    Strides qs = draw_strides(in_, sane_, n, rows, dim, bytes);
    std::vector<char> q(qs.elements * bytes);
    values_.fill(q.data(), qs.elements, cfg_.dtype);
    wkv_seq *const *seqs = !sane_ && in_.ConsumeIntegralInRange<int>(0, 15) == 0 ? nullptr : batch.data();
    int rc;
    if (decode) {
      Strides os = draw_strides(in_, sane_, n, rows, dim, bytes);
      std::vector<char> out(os.elements * bytes);
      rc = wkv_decode(plan, seqs, n, layer, q.data(), qs.outer, qs.inner, out.data(), os.outer, os.inner, nullptr);
      TRACE("decode n=%u layer=%u -> %s\n", n, layer, wkv_status_name(rc));
      check_status("wkv_decode", rc);
      if (rc == WKV_OK) {
        if (qs.must_refuse || os.must_refuse) fail("a decode with an overflowing extent succeeded", rc);
        check_outputs(out.data(), n, os, "wkv_decode");
      }
    } else {
      rc = wkv_lookup(plan, seqs, n, layer, q.data(), qs.outer, qs.inner, nullptr);
      TRACE("lookup plan=%p n=%u layer=%u -> %s\n", static_cast<void *>(plan), n, layer, wkv_status_name(rc));
      check_status("wkv_lookup", rc);
      if (rc == WKV_OK && qs.must_refuse) fail("a lookup with an overflowing extent succeeded", rc);
    }
    if (rc == WKV_OK) {
      for (wkv_seq *s : batch)
        if (!is_live(s)) fail("a lookup or decode with a sequence that is not live succeeded", rc);
    }
    if (PlanState *ps = state_of(plan)) {
      ps->n = n;
      // After a decode the header promises nothing either way.
      ps->step = rc != WKV_OK ? kNoStep : decode ? kUnknown : kLookedUp;
    }
  }

  // The verbs that follow a lookup, in an order the input picks (out of
  // order is WKV_ERR_STATE). Buffers have the size of the plan's last lookup
  // (the engine cannot know any other).
  void plan_verbs() {
    wkv_plan *plan = pick_plan();
    PlanState *ps = state_of(plan);
    const uint32_t n = ps != nullptr ? ps->n : in_.ConsumeIntegralInRange<uint32_t>(0, 5);
    const uint64_t rows = cfg_.n_q_heads, dim = cfg_.head_dim;
    const size_t bytes = dtype_bytes(cfg_.dtype);
    for (int i = 0, m = in_.ConsumeIntegralInRange<int>(1, 5); i < m; ++i) {
      int rc = WKV_OK;
      const Step before = ps != nullptr ? ps->step : kNoStep;
      Step after = before;
      const int verb = in_.ConsumeIntegralInRange<int>(0, 4);
      const bool describe_only = verb == 1;
      switch (verb) {
        case 0:
          rc = wkv_assemble(plan, nullptr);
          TRACE("assemble plan=%p state=%d -> %s\n", static_cast<void *>(plan), before, wkv_status_name(rc));
          check_status("wkv_assemble", rc);
          if (rc == WKV_OK && before == kNoStep) fail("assemble without a lookup succeeded", rc);
          after = kAssembled;
          break;
        case 1: {
          wkv_xbuf_view view;
          wkv_xbuf_view_init(&view);
          if (in_.ConsumeBool()) view.size = in_.ConsumeIntegralInRange<uint32_t>(0, sizeof view);
          rc = wkv_plan_xbuf(plan, &view);
          TRACE("xbuf -> %s\n", wkv_status_name(rc));
          check_status("wkv_plan_xbuf", rc);
          if (rc == WKV_OK && view.size == sizeof view && view.offsets != nullptr) {
            // The layout the header promises: offsets rise from 0 to n_tokens.
            if (view.offsets[0] != 0) fail("xbuf offsets[0] is not 0", rc);
            for (uint32_t r = 0; r < view.n_runs; ++r)
              if (view.offsets[r + 1] < view.offsets[r]) fail("xbuf offsets fall", rc);
            if (static_cast<uint64_t>(view.offsets[view.n_runs]) != view.n_tokens) fail("xbuf n_tokens", rc);
          }
          break;
        }
        case 2: {
          Strides os = draw_strides(in_, sane_, n, rows, dim, bytes);
          std::vector<char> out(os.elements * bytes);
          std::vector<float> lse(static_cast<size_t>(n) * rows);
          const bool with_lse = in_.ConsumeBool();
          rc = wkv_attend(plan, out.data(), os.outer, os.inner, with_lse ? lse.data() : nullptr, nullptr);
          TRACE("attend n=%u -> %s\n", n, wkv_status_name(rc));
          check_status("wkv_attend", rc);
          if (rc == WKV_OK) {
            if (os.must_refuse) fail("an attend with an overflowing extent succeeded", rc);
            if (before == kNoStep || before == kLookedUp) fail("attend without an assemble succeeded", rc);
            check_outputs(out.data(), n, os, "wkv_attend");
          }
          break;
        }
        case 3: {
          Strides os = draw_strides(in_, sane_, n, rows, dim, bytes);
          std::vector<char> out(os.elements * bytes);
          values_.fill(out.data(), os.elements, cfg_.dtype);
          const int64_t lse_stride = in_.ConsumeBool() ? 0 : in_.ConsumeIntegralInRange<int64_t>(-2, 2 * rows);
          const uint64_t lse_count = n == 0 ? 0 : (n - 1) * (lse_stride > 0 ? lse_stride : rows) + rows;
          std::vector<float> lse(lse_count, 0.5f);
          rc = wkv_merge(plan, out.data(), os.outer, os.inner, lse.data(), lse_stride, nullptr);
          TRACE("merge n=%u -> %s\n", n, wkv_status_name(rc));
          check_status("wkv_merge", rc);
          if (rc == WKV_OK) {
            if (os.must_refuse) fail("a merge with an overflowing extent succeeded", rc);
            if (before == kNoStep) fail("merge without a lookup succeeded", rc);
          }
          break;
        }
        default:
          rc = wkv_update(plan, nullptr);
          TRACE("update -> %s\n", wkv_status_name(rc));
          check_status("wkv_update", rc);
          if (rc == WKV_OK && (before == kNoStep || before == kLookedUp)) fail("update without an assemble succeeded", rc);
          after = kUnknown;
          break;
      }
      // A failed verb leaves no step; wkv_plan_xbuf only describes.
      if (rc != WKV_OK && !describe_only) after = kNoStep;
      if (ps != nullptr) ps->step = after;
    }
  }

  // Outputs of a step over finite, small values are finite.
  void check_outputs(const void *out, uint32_t n, const Strides &os, const char *verb) {
    if (values_.special || n == 0) return;
    const uint64_t rows = cfg_.n_q_heads, dim = cfg_.head_dim;
    const uint64_t inner = os.inner == 0 ? dim : static_cast<uint64_t>(os.inner);
    const uint64_t outer = os.outer == 0 ? rows * inner : static_cast<uint64_t>(os.outer);
    const size_t bytes = dtype_bytes(cfg_.dtype);
    for (uint64_t s = 0; s < n; ++s)
      for (uint64_t h = 0; h < rows; ++h)
        if (!all_finite(static_cast<const char *>(out) + (s * outer + h * inner) * bytes, dim, cfg_.dtype))
          fail(verb, WKV_OK);
  }

  void stats() {
    wkv_stats st;
    wkv_stats_init(&st);
    if (in_.ConsumeBool()) st.size = in_.ConsumeIntegralInRange<uint32_t>(0, sizeof st);
    check_status("wkv_engine_stats", wkv_engine_stats(engine_, &st));
    char *json = nullptr;
    int rc = wkv_engine_stats_json(engine_, &json);
    check_status("wkv_engine_stats_json", rc);
    if (rc == WKV_OK && (json == nullptr || json[0] != '{')) fail("stats json", rc);
    wkv_free(json);
    uint32_t device = 99;
    check_status("wkv_engine_device", wkv_engine_device(engine_, &device));
  }

  // Closing the engine's handle: its sequences and plans go on working; the
  // handle is refused from now on.
  void close_engine() {
    if (closed_ || in_.ConsumeIntegralInRange<int>(0, 3) != 0) return;
    wkv_engine_close(engine_);
    wkv_engine_close(engine_);  // twice: a no-op
    closed_ = true;
    wkv_stats st;
    wkv_stats_init(&st);
    int rc = wkv_engine_stats(engine_, &st);
    if (rc != WKV_ERR_INVALID_HANDLE) fail("a closed engine's handle was not refused", rc);
  }

  FuzzedDataProvider &in_;
  wkv_config cfg_{};
  wkv_engine *engine_ = nullptr;
  bool closed_ = false;
  bool sane_ = true;  // this call is well formed
  Values values_;
  std::vector<wkv_seq *> seqs_, dead_seqs_;
  std::vector<wkv_plan *> plans_, dead_plans_;
  std::vector<PlanState> plan_states_;  // one per live plan
  uint64_t tokens_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  FuzzedDataProvider in(data, size);
  Session session(in);
  if (session.open()) session.run();
  return 0;
}
