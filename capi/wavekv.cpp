// The C ABI: argument checks, error translation and handles over the engine.
// Nothing thrown inside crosses this file: every entry point catches, turns
// the failure into a status code and the calling thread's message.
#include "wavekv/wavekv.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "capi/handles.hpp"
#include "lib/common/config.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"

namespace {

using wkv::capi::HandleTable;

// One table per handle type; the type is the value's top byte.
HandleTable<wkv::Engine, 0xE1> &engines() {
  static auto *t = new HandleTable<wkv::Engine, 0xE1>();  // outlives static destructors
  return *t;
}
HandleTable<wkv::Sequence, 0x5E> &sequences() {
  static auto *t = new HandleTable<wkv::Sequence, 0x5E>();
  return *t;
}
HandleTable<wkv::Plan, 0x91> &plans() {
  static auto *t = new HandleTable<wkv::Plan, 0x91>();
  return *t;
}

// What a forked child keeps of its parent's objects (handles.hpp): never
// destroyed, reachable from here. Its lock, like the tables', is held
// across a fork.
std::mutex &forsaken_mu() {
  static auto *mu = new std::mutex();
  return *mu;
}
std::vector<std::shared_ptr<void>> &forsaken() {
  static auto *v = new std::vector<std::shared_ptr<void>>();
  return *v;
}

std::atomic<pid_t> g_pid{0};

void before_fork() {
  forsaken_mu().lock();
  engines().lock_for_fork();
  sequences().lock_for_fork();
  plans().lock_for_fork();
}
void after_fork_in_parent() {
  plans().unlock_after_fork();
  sequences().unlock_after_fork();
  engines().unlock_after_fork();
  forsaken_mu().unlock();
}
void after_fork_in_child() {
  g_pid.store(getpid(), std::memory_order_relaxed);
  after_fork_in_parent();
}

template <typename H> uint64_t value_of(const H *h) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(h)); }
template <typename H> H *handle_of(uint64_t v) { return reinterpret_cast<H *>(static_cast<uintptr_t>(v)); }

thread_local std::string t_last_error;

int fail(int code, std::string msg) {
  t_last_error = std::move(msg);
  return code;
}
int fail(const wkv::Status &s) { return fail(s.code(), s.message()); }
int done(const wkv::Status &s) {
  if (s.is_ok()) {
    t_last_error.clear();
    return WKV_OK;
  }
  return fail(s);
}

// Runs body, translating exceptions into statuses.
template <typename Fn> int guarded(const char *fn, Fn &&body) {
  try {
    return body();
  } catch (const std::bad_alloc &) {
    return fail(WKV_ERR_OUT_OF_MEMORY, std::string(fn) + ": out of host memory");
  } catch (const std::exception &ex) {
    return fail(WKV_ERR_INTERNAL, std::string(fn) + ": internal error: " + ex.what());
  } catch (...) {
    return fail(WKV_ERR_INTERNAL, std::string(fn) + ": internal error");
  }
}

#define CHECK_ARG(cond, ...) \
  do {                       \
    if (!(cond)) return fail(WKV_ERR_INVALID_ARGUMENT, wkv::format(__VA_ARGS__)); \
  } while (0)

// The live object behind a handle, or a failure naming what the handle is.
template <typename T, typename Table, typename H>
int resolve(Table &table, const H *h, const char *fn, const char *what, std::shared_ptr<T> *out) {
  if (!h) return fail(WKV_ERR_INVALID_HANDLE, wkv::format("%s: %s is NULL", fn, what));
  bool foreign = false;
  *out = table.get(value_of(h), &foreign);
  if (foreign)
    return fail(WKV_ERR_STATE, wkv::format("%s: this %s was made by another process (the parent of a fork); a forked "
                                           "process opens engines of its own",
                                           fn, what));
  if (!*out)
    return fail(WKV_ERR_INVALID_HANDLE,
                wkv::format("%s: not a live %s handle (destroyed, of another type, or foreign)", fn, what));
  return WKV_OK;
}
int resolve_engine(const wkv_engine *h, const char *fn, std::shared_ptr<wkv::Engine> *out) {
  return resolve(engines(), h, fn, "wkv_engine", out);
}
int resolve_seq(const wkv_seq *h, const char *fn, std::shared_ptr<wkv::Sequence> *out) {
  return resolve(sequences(), h, fn, "wkv_seq", out);
}
int resolve_plan(const wkv_plan *h, const char *fn, std::shared_ptr<wkv::Plan> *out) {
  return resolve(plans(), h, fn, "wkv_plan", out);
}

// Resolves packed (0) strides of a [n_outer][n_inner][d] tensor of elements
// of esz bytes and checks them: not negative, rows that do not overlap (the
// smaller stride spans a row, the larger spans all rows of the smaller), and
// an extent, in bytes, that 63 bits hold, all in checked arithmetic.
int check_strides(const char *fn, const char *what, uint64_t n_outer, uint64_t n_inner, uint32_t d, size_t esz,
                  int64_t *outer_stride, int64_t *inner_stride) {
  if (*inner_stride == 0) *inner_stride = d;
  if (*outer_stride == 0) {
    uint64_t s;
    if (__builtin_mul_overflow(n_inner, static_cast<uint64_t>(*inner_stride), &s) ||
        s > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return fail(WKV_ERR_INVALID_ARGUMENT, wkv::format("%s: %s is too large to address", fn, what));
    *outer_stride = static_cast<int64_t>(s);
  }
  if (*outer_stride < 0 || *inner_stride < 0)
    return fail(WKV_ERR_INVALID_ARGUMENT, wkv::format("%s: %s strides must not be negative", fn, what));
  // The last element's offset plus one, in bytes.
  uint64_t a = 0, b = 0, end = 0;
  const bool overflow =
      __builtin_mul_overflow(n_outer > 0 ? n_outer - 1 : 0, static_cast<uint64_t>(*outer_stride), &a) ||
      __builtin_mul_overflow(n_inner > 0 ? n_inner - 1 : 0, static_cast<uint64_t>(*inner_stride), &b) ||
      __builtin_add_overflow(a, b, &end) || __builtin_add_overflow(end, static_cast<uint64_t>(d), &end) ||
      __builtin_mul_overflow(end, static_cast<uint64_t>(esz), &end) ||
      end > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (overflow)
    return fail(WKV_ERR_INVALID_ARGUMENT,
                wkv::format("%s: %s strides (%lld, %lld elements) over %llu x %llu rows reach past 2^63 bytes", fn,
                            what, static_cast<long long>(*outer_stride), static_cast<long long>(*inner_stride),
                            static_cast<unsigned long long>(n_outer), static_cast<unsigned long long>(n_inner)));
  struct Dim {
    uint64_t stride, n;
  } x{static_cast<uint64_t>(*inner_stride), n_inner}, y{static_cast<uint64_t>(*outer_stride), n_outer};
  if (x.n <= 1) x.stride = std::numeric_limits<uint64_t>::max();
  if (y.n <= 1) y.stride = std::numeric_limits<uint64_t>::max();
  if (x.stride > y.stride) std::swap(x, y);
  if (x.n > 1 || y.n > 1) {
    uint64_t span = 0;
    // (The extent check above bounds every product here.)
    const bool overlap = x.stride < d || (y.n > 1 && x.n > 1 && (__builtin_mul_overflow(x.stride, x.n, &span) ||
                                                                  y.stride < span));
    if (overlap)
      return fail(WKV_ERR_INVALID_ARGUMENT,
                  wkv::format("%s: %s strides (%lld, %lld elements) make rows of %u elements overlap", fn, what,
                              static_cast<long long>(*outer_stride), static_cast<long long>(*inner_stride), d));
  }
  return WKV_OK;
}

int check_layer(const wkv::Engine &e, uint32_t layer, const char *fn) {
  if (layer >= e.config().c.n_layers)
    return fail(WKV_ERR_OUT_OF_RANGE,
                wkv::format("%s: layer %u out of range (n_layers %u)", fn, layer, e.config().c.n_layers));
  return WKV_OK;
}

size_t element_bytes(const wkv::Engine &e) { return wkv::dtype_bytes(e.config().dtype()); }

// Copies the prefix of `src` that the caller's size covers.
template <typename T> void copy_prefix(T *dst, const T &src) {
  uint32_t n = std::min<uint32_t>(dst->size, sizeof(T));
  uint32_t keep = dst->size;
  std::memcpy(dst, &src, n);
  dst->size = keep;
}

// Collects and checks a batch of distinct sequences of one engine: the
// plan's, or (plan null) sequence 0's.
int collect_seqs(const wkv::Plan *plan, wkv_seq *const *seqs, uint32_t n, const char *fn,
                 std::vector<std::shared_ptr<wkv::Sequence>> *out) {
  CHECK_ARG(seqs, "%s: seqs is NULL", fn);
  CHECK_ARG(n > 0, "%s: n_seqs is 0", fn);
  out->clear();
  out->reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::shared_ptr<wkv::Sequence> s;
    if (int rc = resolve_seq(seqs[i], fn, &s)) return rc;
    const wkv::Engine *engine = plan ? plan->engine_ptr().get() : i > 0 ? (*out)[0]->engine_ptr().get() : nullptr;
    if (engine && s->engine_ptr().get() != engine)
      return fail(WKV_ERR_INVALID_HANDLE, wkv::format("%s: sequence %u belongs to another engine than %s", fn, i,
                                                      plan ? "the plan" : "sequence 0"));
    out->push_back(std::move(s));
  }
  std::vector<const wkv::Sequence *> sorted;
  sorted.reserve(n);
  for (auto &s : *out) sorted.push_back(s.get());
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    return fail(WKV_ERR_INVALID_ARGUMENT, wkv::format("%s: a sequence is listed twice", fn));
  return WKV_OK;
}

// A per-thread scratch for the batch, so that steady decoding does not
// allocate in the ABI layer either.
thread_local std::vector<std::shared_ptr<wkv::Sequence>> t_batch;

// Runs a verb of a plan; whatever fails (the verb, or the checks before it),
// the plan holds no step afterwards.
template <typename Fn> int plan_verb(const char *fn, wkv_plan *handle, Fn &&body) {
  return guarded(fn, [&] {
    std::shared_ptr<wkv::Plan> p;
    if (int rc = resolve_plan(handle, fn, &p)) return rc;
    int rc = WKV_ERR_INTERNAL;
    try {
      rc = body(*p);
    } catch (...) {
      p->stage = wkv::Plan::Stage::kEmpty;
      throw;
    }
    if (rc != WKV_OK) p->stage = wkv::Plan::Stage::kEmpty;
    return rc;
  });
}

int lookup_impl(const char *fn, wkv::Plan &plan, wkv_seq *const *seqs, uint32_t n_seqs, uint32_t layer,
                const void *q, int64_t seq_stride, int64_t head_stride, void *stream,
                const wkv::DecodeOut *decode = nullptr) {
  // The batch never outlives the call (it holds sequences alive).
  struct ClearBatch {
    ~ClearBatch() { t_batch.clear(); }
  } clear_batch;
  wkv::Engine &e = plan.engine();
  if (int rc = collect_seqs(&plan, seqs, n_seqs, fn, &t_batch)) return rc;
  if (int rc = check_layer(e, layer, fn)) return rc;
  CHECK_ARG(q, "%s: q is NULL", fn);
  const wkv::Config &cfg = e.config();
  if (int rc = check_strides(fn, "q", n_seqs, cfg.c.n_q_heads, cfg.c.head_dim, element_bytes(e), &seq_stride,
                             &head_stride))
    return rc;
  wkv::Status s = e.lookup(plan, t_batch.data(), n_seqs, layer, q, seq_stride, head_stride, stream, decode);
  if (!s.is_ok()) return fail(s.code(), std::string(fn) + ": " + s.message());
  return WKV_OK;
}

int out_strides(const char *fn, const wkv::Plan &p, int64_t *seq_stride, int64_t *head_stride) {
  const wkv::Config &cfg = p.engine().config();
  return check_strides(fn, "out", p.n_seqs, cfg.c.n_q_heads, cfg.c.head_dim, element_bytes(p.engine()), seq_stride,
                       head_stride);
}

}  // namespace

namespace wkv::capi {

pid_t process_id() {
  static const bool registered = [] {
    g_pid.store(getpid(), std::memory_order_relaxed);
    return pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child) == 0;
  }();
  (void)registered;
  return g_pid.load(std::memory_order_relaxed);
}

void forsake(std::shared_ptr<void> obj) {
  try {
    std::lock_guard<std::mutex> lock(forsaken_mu());
    forsaken().push_back(obj);
    return;
  } catch (...) {
  }
  // Out of memory for the list: the reference itself is leaked (else the
  // object would be destroyed here, waiting for threads that do not exist).
  if (new (std::nothrow) std::shared_ptr<void>(std::move(obj))) return;
}

}  // namespace wkv::capi

namespace {
// The fork handlers are registered when the library is loaded, before any
// thread of the process can meet them half-registered, and what they lock
// is made then too (not inside a fork's handler).
[[maybe_unused]] const pid_t g_loaded_in = [] {
  (void)forsaken_mu();
  (void)forsaken();
  (void)engines();
  (void)sequences();
  (void)plans();
  return wkv::capi::process_id();
}();
}  // namespace

extern "C" {

int wkv_version(void) { return WKV_VERSION_NUMBER; }

const char *wkv_version_string(void) {
#define WKV_STR2(x) #x
#define WKV_STR(x) WKV_STR2(x)
  return WKV_STR(WKV_VERSION_MAJOR) "." WKV_STR(WKV_VERSION_MINOR) "." WKV_STR(WKV_VERSION_PATCH);
}

const char *wkv_status_name(int status) {
  switch (status) {
    case WKV_OK: return "WKV_OK";
    case WKV_ERR_INVALID_ARGUMENT: return "WKV_ERR_INVALID_ARGUMENT";
    case WKV_ERR_INVALID_HANDLE: return "WKV_ERR_INVALID_HANDLE";
    case WKV_ERR_OUT_OF_RANGE: return "WKV_ERR_OUT_OF_RANGE";
    case WKV_ERR_UNSUPPORTED: return "WKV_ERR_UNSUPPORTED";
    case WKV_ERR_BUDGET: return "WKV_ERR_BUDGET";
    case WKV_ERR_OUT_OF_MEMORY: return "WKV_ERR_OUT_OF_MEMORY";
    case WKV_ERR_DEVICE: return "WKV_ERR_DEVICE";
    case WKV_ERR_IO: return "WKV_ERR_IO";
    case WKV_ERR_CORRUPT: return "WKV_ERR_CORRUPT";
    case WKV_ERR_STATE: return "WKV_ERR_STATE";
    case WKV_ERR_INTERNAL: return "WKV_ERR_INTERNAL";
    case WKV_ERR_NO_DEVICE: return "WKV_ERR_NO_DEVICE";
    default: return "WKV_ERR_UNKNOWN";
  }
}

const char *wkv_last_error(void) { return t_last_error.c_str(); }

void wkv_free(void *ptr) { std::free(ptr); }

// wkv_config_init: capi/current.cpp and capi/compat.cpp.

int wkv_engine_open(const wkv_config *cfg, wkv_engine **out) {
  return guarded("wkv_engine_open", [&] {
    CHECK_ARG(out, "wkv_engine_open: out is NULL");
    *out = nullptr;
    CHECK_ARG(cfg, "wkv_engine_open: config is NULL");
    std::shared_ptr<wkv::Engine> e;
    wkv::Status s = wkv::Engine::open(cfg, &e);
    if (!s.is_ok()) return fail(s.code(), "wkv_engine_open: " + s.message());
    const uint64_t h = engines().insert(std::move(e));
    if (!h) return fail(WKV_ERR_OUT_OF_MEMORY, "wkv_engine_open: too many live engine handles");
    *out = handle_of<wkv_engine>(h);
    return done(wkv::Status::ok());
  });
}

void wkv_engine_close(wkv_engine *engine) {
  try {
    std::shared_ptr<wkv::Engine> e = engines().remove(value_of(engine));
    (void)e;  // released here: the engine goes once its sequences and plans have
  } catch (...) {
  }
}

int wkv_engine_config(const wkv_engine *engine, wkv_config *cfg) {
  return guarded("wkv_engine_config", [&] {
    std::shared_ptr<wkv::Engine> e;
    if (int rc = resolve_engine(engine, "wkv_engine_config", &e)) return rc;
    CHECK_ARG(cfg, "wkv_engine_config: cfg is NULL");
    CHECK_ARG(cfg->size >= 8, "wkv_engine_config: cfg->size %u is too small (set it to sizeof(wkv_config))",
              cfg->size);
    copy_prefix(cfg, e->config().c);
    return done(wkv::Status::ok());
  });
}

int wkv_engine_device(const wkv_engine *engine, uint32_t *device) {
  return guarded("wkv_engine_device", [&] {
    std::shared_ptr<wkv::Engine> e;
    if (int rc = resolve_engine(engine, "wkv_engine_device", &e)) return rc;
    CHECK_ARG(device, "wkv_engine_device: device is NULL");
    *device = e->config().c.device;
    return done(wkv::Status::ok());
  });
}

int wkv_engine_stats(wkv_engine *engine, wkv_stats *stats) {
  return guarded("wkv_engine_stats", [&] {
    std::shared_ptr<wkv::Engine> e;
    if (int rc = resolve_engine(engine, "wkv_engine_stats", &e)) return rc;
    CHECK_ARG(stats, "wkv_engine_stats: stats is NULL");
    CHECK_ARG(stats->size >= 8, "wkv_engine_stats: stats->size %u is too small (call wkv_stats_init)",
              stats->size);
    wkv_stats full;
    wkv_stats_init(&full);
    e->fill_stats(&full);
    copy_prefix(stats, full);
    return done(wkv::Status::ok());
  });
}

int wkv_engine_stats_json(wkv_engine *engine, char **json) {
  return guarded("wkv_engine_stats_json", [&] {
    CHECK_ARG(json, "wkv_engine_stats_json: json is NULL");
    *json = nullptr;
    std::shared_ptr<wkv::Engine> e;
    if (int rc = resolve_engine(engine, "wkv_engine_stats_json", &e)) return rc;
    std::string s = e->stats_json();
    char *buf = static_cast<char *>(std::malloc(s.size() + 1));
    if (!buf) return fail(WKV_ERR_OUT_OF_MEMORY, "wkv_engine_stats_json: out of host memory");
    std::memcpy(buf, s.c_str(), s.size() + 1);
    *json = buf;
    return done(wkv::Status::ok());
  });
}

int wkv_seq_create(wkv_engine *engine, wkv_seq **out) {
  return guarded("wkv_seq_create", [&] {
    CHECK_ARG(out, "wkv_seq_create: out is NULL");
    *out = nullptr;
    std::shared_ptr<wkv::Engine> e;
    if (int rc = resolve_engine(engine, "wkv_seq_create", &e)) return rc;
    std::shared_ptr<wkv::Sequence> seq;
    wkv::Status s = wkv::Sequence::create(e, &seq);
    if (!s.is_ok()) return fail(s.code(), "wkv_seq_create: " + s.message());
    const uint64_t h = sequences().insert(std::move(seq));
    if (!h) return fail(WKV_ERR_OUT_OF_MEMORY, "wkv_seq_create: too many live sequence handles");
    *out = handle_of<wkv_seq>(h);
    return done(wkv::Status::ok());
  });
}

void wkv_seq_destroy(wkv_seq *seq) {
  try {
    std::shared_ptr<wkv::Sequence> s = sequences().remove(value_of(seq));
    (void)s;  // released here, or by the last plan that holds it
  } catch (...) {
  }
}

int wkv_seq_append(wkv_seq *seq, uint32_t layer, const void *k, const void *v, uint32_t n_tokens,
                   int64_t token_stride, int64_t head_stride, void *stream) {
  return guarded("wkv_seq_append", [&] {
    const char *fn = "wkv_seq_append";
    std::shared_ptr<wkv::Sequence> s;
    if (int rc = resolve_seq(seq, fn, &s)) return rc;
    wkv::Engine &e = s->engine();
    if (int rc = check_layer(e, layer, fn)) return rc;
    CHECK_ARG(k, "%s: k is NULL", fn);
    CHECK_ARG(v, "%s: v is NULL", fn);
    CHECK_ARG(n_tokens > 0, "%s: n_tokens is 0", fn);
    const wkv::Config &cfg = e.config();
    if (int rc = check_strides(fn, "k/v", n_tokens, cfg.c.n_kv_heads, cfg.c.head_dim, element_bytes(e),
                               &token_stride, &head_stride))
      return rc;
    return done(e.append(*s, layer, static_cast<const uint8_t *>(k), static_cast<const uint8_t *>(v), n_tokens,
                         token_stride, head_stride, stream));
  });
}

int wkv_append_batch(wkv_seq *const *seqs, uint32_t n_seqs, uint32_t layer, const void *k, const void *v,
                     uint32_t n_tokens, int64_t seq_stride, int64_t token_stride, int64_t head_stride,
                     void *stream) {
  return guarded("wkv_append_batch", [&] {
    const char *fn = "wkv_append_batch";
    struct ClearBatch {
      ~ClearBatch() { t_batch.clear(); }
    } clear_batch;
    if (int rc = collect_seqs(nullptr, seqs, n_seqs, fn, &t_batch)) return rc;
    wkv::Engine &e = t_batch[0]->engine();
    if (int rc = check_layer(e, layer, fn)) return rc;
    CHECK_ARG(k, "%s: k is NULL", fn);
    CHECK_ARG(v, "%s: v is NULL", fn);
    CHECK_ARG(n_tokens > 0, "%s: n_tokens is 0", fn);
    const wkv::Config &cfg = e.config();
    const size_t esz = element_bytes(e);
    if (int rc = check_strides(fn, "k/v", n_tokens, cfg.c.n_kv_heads, cfg.c.head_dim, esz, &token_stride,
                               &head_stride))
      return rc;
    // Sequence i's tokens begin at i * seq_stride; 0: one after another.
    // Any other layout is fine (sequences interleaved by token, say): the
    // tensors are only read, so the batch need only be addressable.
    const uint64_t span = static_cast<uint64_t>(n_tokens - 1) * static_cast<uint64_t>(token_stride) +
                          static_cast<uint64_t>(cfg.c.n_kv_heads - 1) * static_cast<uint64_t>(head_stride) +
                          cfg.c.head_dim;  // elements of one sequence's rows (its extent checked above)
    if (seq_stride == 0) seq_stride = static_cast<int64_t>(span);
    if (seq_stride < 0) return fail(WKV_ERR_INVALID_ARGUMENT, wkv::format("%s: seq_stride must not be negative", fn));
    uint64_t end = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(n_seqs - 1), static_cast<uint64_t>(seq_stride), &end) ||
        __builtin_add_overflow(end, span, &end) || __builtin_mul_overflow(end, static_cast<uint64_t>(esz), &end) ||
        end > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return fail(WKV_ERR_INVALID_ARGUMENT, wkv::format("%s: k/v is too large to address", fn));
    thread_local std::vector<wkv::Sequence *> batch;
    batch.clear();
    for (auto &s : t_batch) batch.push_back(s.get());
    return done(e.append_batch(batch.data(), n_seqs, layer, static_cast<const uint8_t *>(k),
                               static_cast<const uint8_t *>(v), n_tokens, seq_stride, token_stride, head_stride, stream,
                               fn));
  });
}

int wkv_seq_end_prompt(wkv_seq *seq, uint32_t layer, void *stream) {
  return guarded("wkv_seq_end_prompt", [&] {
    const char *fn = "wkv_seq_end_prompt";
    std::shared_ptr<wkv::Sequence> s;
    if (int rc = resolve_seq(seq, fn, &s)) return rc;
    if (int rc = check_layer(s->engine(), layer, fn)) return rc;
    return done(s->engine().end_prompt(*s, layer, stream));
  });
}

int wkv_seq_evict(wkv_seq *seq) {
  return guarded("wkv_seq_evict", [&] {
    std::shared_ptr<wkv::Sequence> s;
    if (int rc = resolve_seq(seq, "wkv_seq_evict", &s)) return rc;
    wkv::Status st = s->engine().evict(*s);
    return st.is_ok() ? done(st) : fail(st.code(), "wkv_seq_evict: " + st.message());
  });
}

int wkv_seq_restore(wkv_seq *seq) {
  return guarded("wkv_seq_restore", [&] {
    std::shared_ptr<wkv::Sequence> s;
    if (int rc = resolve_seq(seq, "wkv_seq_restore", &s)) return rc;
    wkv::Status st = s->engine().restore(*s);
    return st.is_ok() ? done(st) : fail(st.code(), "wkv_seq_restore: " + st.message());
  });
}

// Sequence files. Errors of the path forms name the path.
static int save_impl(const char *fn, const wkv_seq *seq, const char *path, int fd, uint32_t flags) {
  std::shared_ptr<wkv::Sequence> q;
  if (int rc = resolve_seq(seq, fn, &q)) return rc;
  CHECK_ARG(!(flags & ~static_cast<uint32_t>(WKV_SAVE_NO_FSYNC)), "%s: unknown flags 0x%x", fn, flags);
  wkv::Engine &e = q->engine();
  wkv::Status s = path ? e.save(*q, e.io(), std::string(path), flags) : e.save(*q, e.io(), fd, flags);
  if (!s.is_ok())
    return fail(s.code(), path ? wkv::format("%s: '%s': %s", fn, path, s.message().c_str()) : fn + (": " + s.message()));
  return done(s);
}

static int load_impl(const char *fn, wkv_engine *engine, const char *path, int fd, wkv_seq **out) {
  CHECK_ARG(out, "%s: out is NULL", fn);
  *out = nullptr;
  std::shared_ptr<wkv::Engine> e;
  if (int rc = resolve_engine(engine, fn, &e)) return rc;
  std::shared_ptr<wkv::Sequence> q;
  wkv::Status s = path ? e->load(e->io(), std::string(path), &q) : e->load(e->io(), fd, &q);
  if (!s.is_ok())
    return fail(s.code(), path ? wkv::format("%s: '%s': %s", fn, path, s.message().c_str()) : fn + (": " + s.message()));
  const uint64_t h = sequences().insert(std::move(q));
  if (!h) return fail(WKV_ERR_OUT_OF_MEMORY, wkv::format("%s: too many live sequence handles", fn));
  *out = handle_of<wkv_seq>(h);
  return done(s);
}

int wkv_seq_save(const wkv_seq *seq, const char *path, uint32_t flags) {
  return guarded("wkv_seq_save", [&] {
    CHECK_ARG(path, "wkv_seq_save: path is NULL");
    return save_impl("wkv_seq_save", seq, path, -1, flags);
  });
}

int wkv_seq_save_fd(const wkv_seq *seq, int fd, uint32_t flags) {
  return guarded("wkv_seq_save_fd", [&] {
    CHECK_ARG(fd >= 0, "wkv_seq_save_fd: fd %d is negative", fd);
    return save_impl("wkv_seq_save_fd", seq, nullptr, fd, flags);
  });
}

int wkv_seq_load(wkv_engine *engine, const char *path, wkv_seq **out) {
  return guarded("wkv_seq_load", [&] {
    if (out) *out = nullptr;
    CHECK_ARG(path, "wkv_seq_load: path is NULL");
    return load_impl("wkv_seq_load", engine, path, -1, out);
  });
}

int wkv_seq_load_fd(wkv_engine *engine, int fd, wkv_seq **out) {
  return guarded("wkv_seq_load_fd", [&] {
    if (out) *out = nullptr;
    CHECK_ARG(fd >= 0, "wkv_seq_load_fd: fd %d is negative", fd);
    return load_impl("wkv_seq_load_fd", engine, nullptr, fd, out);
  });
}

int wkv_seq_info_get(const wkv_seq *seq, uint32_t layer, wkv_seq_info *info) {
  return guarded("wkv_seq_info_get", [&] {
    const char *fn = "wkv_seq_info_get";
    std::shared_ptr<wkv::Sequence> s;
    if (int rc = resolve_seq(seq, fn, &s)) return rc;
    if (int rc = check_layer(s->engine(), layer, fn)) return rc;
    CHECK_ARG(info, "%s: info is NULL", fn);
    CHECK_ARG(info->size >= 8, "%s: info->size %u is too small (call wkv_seq_info_init)", fn, info->size);
    const wkv::LayerState &L = s->layer(layer);
    wkv_seq_info full;
    wkv_seq_info_init(&full);
    full.generating = L.generating ? 1 : 0;
    full.evicted = s->evicted() ? 1 : 0;
    full.tokens = L.tokens;
    if (!L.heads.empty()) {
      full.sink = L.heads[0].sink.n;
      full.tail = L.heads[0].tail.n;
      full.segments = L.heads[0].segments.size();
    }
    full.clustered = L.tokens - full.sink - full.tail;
    for (const wkv::HeadState &h : L.heads) {
      full.clusters += h.clusters();
      full.pages += h.map.pages.size();
      full.spilled_pages += h.cold.out;  // cold pages: on disk, being read back, or failed
    }
    // Evicted, every page is in the spill file: the resident ones in the
    // head's extent, the cold ones in their own (lib/engine/engine.cpp).
    if (full.evicted) full.spilled_pages = full.pages;
    copy_prefix(info, full);
    return done(wkv::Status::ok());
  });
}

int wkv_plan_create(wkv_engine *engine, wkv_plan **out) {
  return guarded("wkv_plan_create", [&] {
    CHECK_ARG(out, "wkv_plan_create: out is NULL");
    *out = nullptr;
    std::shared_ptr<wkv::Engine> e;
    if (int rc = resolve_engine(engine, "wkv_plan_create", &e)) return rc;
    std::shared_ptr<wkv::StepTracker> tracker;
    wkv::Status s = e->buffers().new_tracker(&tracker);
    if (!s.is_ok()) return fail(s.code(), "wkv_plan_create: " + s.message());
    const uint64_t h = plans().insert(std::make_shared<wkv::Plan>(e, std::move(tracker)));
    if (!h) return fail(WKV_ERR_OUT_OF_MEMORY, "wkv_plan_create: too many live plan handles");
    *out = handle_of<wkv_plan>(h);
    return done(wkv::Status::ok());
  });
}

void wkv_plan_destroy(wkv_plan *plan) {
  try {
    std::shared_ptr<wkv::Plan> p = plans().remove(value_of(plan));
    (void)p;
  } catch (...) {
  }
}

int wkv_lookup(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs, uint32_t layer, const void *q,
               int64_t seq_stride, int64_t head_stride, void *stream) {
  return plan_verb("wkv_lookup", plan, [&](wkv::Plan &p) {
    int rc = lookup_impl("wkv_lookup", p, seqs, n_seqs, layer, q, seq_stride, head_stride, stream);
    return rc ? rc : done(wkv::Status::ok());
  });
}

int wkv_assemble(wkv_plan *plan, void *stream) {
  return plan_verb("wkv_assemble", plan, [&](wkv::Plan &p) { return done(p.engine().assemble(p, stream)); });
}

void wkv_xbuf_view_init(wkv_xbuf_view *view) {
  if (!view) return;
  std::memset(view, 0, sizeof *view);
  view->size = sizeof *view;
}

int wkv_plan_xbuf(const wkv_plan *plan, wkv_xbuf_view *view) {
  return guarded("wkv_plan_xbuf", [&] {
    std::shared_ptr<wkv::Plan> p;
    if (int rc = resolve_plan(plan, "wkv_plan_xbuf", &p)) return rc;
    CHECK_ARG(view, "wkv_plan_xbuf: view is NULL");
    CHECK_ARG(view->size >= 8, "wkv_plan_xbuf: view->size %u is too small (call wkv_xbuf_view_init)",
              view->size);
    if (p->stage != wkv::Plan::Stage::kAssembled)
      return fail(WKV_ERR_STATE, "wkv_plan_xbuf: the plan has no assembled execution buffer");
    if (!p->rows_laid_out)
      return fail(WKV_ERR_STATE,
                  "wkv_plan_xbuf: the plan's last step was a decode that attended from where its rows live; "
                  "its execution buffer holds no rows (wkv_assemble lays them out)");
    wkv_xbuf_view full;
    wkv_xbuf_view_init(&full);
    const wkv::Config &cfg = p->engine().config();
    full.head_dim = cfg.c.head_dim;
    full.dtype = cfg.c.dtype;
    p->engine().backend().xbuf(*p, &full);
    copy_prefix(view, full);
    return done(wkv::Status::ok());
  });
}

int wkv_attend(wkv_plan *plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
               void *stream) {
  return plan_verb("wkv_attend", plan, [&](wkv::Plan &p) {
    CHECK_ARG(out, "wkv_attend: out is NULL");
    if (int rc = out_strides("wkv_attend", p, &seq_stride, &head_stride)) return rc;
    return done(p.engine().attend(p, out, seq_stride, head_stride, lse, stream));
  });
}

int wkv_merge(wkv_plan *plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
              int64_t lse_seq_stride, void *stream) {
  return plan_verb("wkv_merge", plan, [&](wkv::Plan &p) {
    CHECK_ARG(out, "wkv_merge: out is NULL");
    CHECK_ARG(lse, "wkv_merge: lse is NULL");
    if (int rc = out_strides("wkv_merge", p, &seq_stride, &head_stride)) return rc;
    const uint32_t nq = p.engine().config().c.n_q_heads;
    if (lse_seq_stride == 0) lse_seq_stride = nq;
    CHECK_ARG(lse_seq_stride > 0, "wkv_merge: lse_seq_stride %lld is negative",
              static_cast<long long>(lse_seq_stride));
    CHECK_ARG(lse_seq_stride >= static_cast<int64_t>(nq) || p.n_seqs == 1,
              "wkv_merge: lse_seq_stride %lld is smaller than n_q_heads %u", static_cast<long long>(lse_seq_stride),
              nq);
    int64_t lse_inner = 1, lse_outer = lse_seq_stride;
    if (int rc = check_strides("wkv_merge", "lse", p.n_seqs, nq, 1, sizeof(float), &lse_outer, &lse_inner))
      return rc;
    if (p.stage == wkv::Plan::Stage::kEmpty) return fail(WKV_ERR_STATE, "wkv_merge: merge needs a lookup first");
    return done(p.engine().merge(p, out, seq_stride, head_stride, lse, lse_seq_stride, stream));
  });
}

int wkv_update(wkv_plan *plan, void *stream) {
  return plan_verb("wkv_update", plan, [&](wkv::Plan &p) { return done(p.engine().update(p, stream)); });
}

int wkv_decode(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs, uint32_t layer, const void *q,
               int64_t q_seq_stride, int64_t q_head_stride, void *out, int64_t out_seq_stride,
               int64_t out_head_stride, void *stream) {
  return plan_verb("wkv_decode", plan, [&](wkv::Plan &p) {
    const char *fn = "wkv_decode";
    CHECK_ARG(out, "%s: out is NULL", fn);
    {
      const wkv::Config &cfg = p.engine().config();
      int64_t a = out_seq_stride, b = out_head_stride;
      if (int rc = check_strides(fn, "out", n_seqs, cfg.c.n_q_heads, cfg.c.head_dim, element_bytes(p.engine()), &a,
                                 &b))
        return rc;
      out_seq_stride = a;
      out_head_stride = b;
    }
    const wkv::DecodeOut whole{out, out_seq_stride, out_head_stride};
    if (int rc = lookup_impl(fn, p, seqs, n_seqs, layer, q, q_seq_stride, q_head_stride, stream, &whole)) return rc;
    // Decoded at once (a CUDA engine's graph), captured (a bound plan's
    // call: the plan holds no step), or looked up only.
    if (p.stage == wkv::Plan::Stage::kAssembled || p.binding) return done(wkv::Status::ok());
    wkv::Engine &e = p.engine();
    wkv::Status s = e.assemble(p, stream);
    if (s.is_ok()) s = e.attend(p, out, out_seq_stride, out_head_stride, nullptr, stream);
    if (s.is_ok()) s = e.update(p, stream);
    if (!s.is_ok()) return fail(s.code(), std::string(fn) + ": " + s.message());
    return done(wkv::Status::ok());
  });
}

int wkv_plan_bind(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs, uint32_t max_steps, void *stream) {
  return plan_verb("wkv_plan_bind", plan, [&](wkv::Plan &p) {
    const char *fn = "wkv_plan_bind";
    struct ClearBatch {
      ~ClearBatch() { t_batch.clear(); }
    } clear_batch;
    if (int rc = collect_seqs(&p, seqs, n_seqs, fn, &t_batch)) return rc;
    wkv::Status s = p.engine().bind(p, t_batch.data(), n_seqs, max_steps, stream);
    if (!s.is_ok()) return fail(s.code(), std::string(fn) + ": " + s.message());
    return done(wkv::Status::ok());
  });
}

int wkv_plan_prepare(wkv_plan *plan, void *stream) {
  return plan_verb("wkv_plan_prepare", plan, [&](wkv::Plan &p) {
    wkv::Status s = p.engine().prepare(p, stream);
    if (!s.is_ok()) return fail(s.code(), "wkv_plan_prepare: " + s.message());
    return done(wkv::Status::ok());
  });
}

int wkv_plan_unbind(wkv_plan *plan, void *stream) {
  return plan_verb("wkv_plan_unbind", plan, [&](wkv::Plan &p) {
    wkv::Status s = p.engine().unbind(p, stream);
    if (!s.is_ok()) return fail(s.code(), "wkv_plan_unbind: " + s.message());
    return done(wkv::Status::ok());
  });
}

}  // extern "C"
