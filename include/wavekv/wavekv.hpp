// A thin C++ RAII layer over the C ABI of wavekv.h, for C++ runtimes.
// Handles are move-only owners; a failing call throws wavekv::Error carrying
// the status code and wkv_last_error(). Everything else is the C contract.
#ifndef WAVEKV_HPP
#define WAVEKV_HPP

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "wavekv/wavekv.h"

namespace wavekv {

class Error : public std::runtime_error {
 public:
  Error(int code, const std::string &msg)
      : std::runtime_error(std::string(wkv_status_name(code)) + ": " + msg), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

inline void check(int rc) {
  if (rc != WKV_OK) throw Error(rc, wkv_last_error());
}

// Owns one handle of type T, destroyed with D.
template <typename T, void (*D)(T *)> class Handle {
 public:
  Handle() = default;
  explicit Handle(T *h) : h_(h) {}
  ~Handle() { D(h_); }
  Handle(Handle &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Handle &operator=(Handle &&o) noexcept {
    if (this != &o) {
      D(h_);
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  T *get() const { return h_; }
  explicit operator bool() const { return h_ != nullptr; }

 private:
  T *h_ = nullptr;
};

class Engine : public Handle<wkv_engine, wkv_engine_close> {
 public:
  explicit Engine(const wkv_config &cfg) : Handle(open(cfg)) {}
  wkv_stats stats() const {
    wkv_stats s;
    wkv_stats_init(&s);
    check(wkv_engine_stats(get(), &s));
    return s;
  }
  wkv_config config() const {
    wkv_config c;
    wkv_config_init(&c);
    check(wkv_engine_config(get(), &c));
    return c;
  }
  std::string stats_json() const {
    char *json = nullptr;
    check(wkv_engine_stats_json(get(), &json));
    std::string s(json);
    wkv_free(json);
    return s;
  }

 private:
  static wkv_engine *open(const wkv_config &cfg) {
    wkv_engine *e = nullptr;
    check(wkv_engine_open(&cfg, &e));
    return e;
  }
};

class Sequence : public Handle<wkv_seq, wkv_seq_destroy> {
 public:
  explicit Sequence(const Engine &e) : Handle(create(e)) {}
  // Takes ownership of a sequence handle.
  static Sequence adopt(wkv_seq *s) { return Sequence(s); }
  // A sequence file loaded into the engine (wkv_seq_load).
  static Sequence load(const Engine &e, const std::string &path) {
    wkv_seq *s = nullptr;
    check(wkv_seq_load(e.get(), path.c_str(), &s));
    return Sequence(s);
  }
  // Saves the sequence to a file (wkv_seq_save; flags: WKV_SAVE_*).
  void save(const std::string &path, uint32_t flags = 0) const { check(wkv_seq_save(get(), path.c_str(), flags)); }
  // The spill tier (wkv_seq_evict, wkv_seq_restore).
  void evict() { check(wkv_seq_evict(get())); }
  void restore() { check(wkv_seq_restore(get())); }
  void append(uint32_t layer, const void *k, const void *v, uint32_t n_tokens, int64_t token_stride = 0,
              int64_t head_stride = 0, void *stream = nullptr) {
    check(wkv_seq_append(get(), layer, k, v, n_tokens, token_stride, head_stride, stream));
  }
  void end_prompt(uint32_t layer, void *stream = nullptr) { check(wkv_seq_end_prompt(get(), layer, stream)); }
  wkv_seq_info info(uint32_t layer) const {
    wkv_seq_info i;
    wkv_seq_info_init(&i);
    check(wkv_seq_info_get(get(), layer, &i));
    return i;
  }

 private:
  explicit Sequence(wkv_seq *s) : Handle(s) {}
  static wkv_seq *create(const Engine &e) {
    wkv_seq *s = nullptr;
    check(wkv_seq_create(e.get(), &s));
    return s;
  }
};

class Plan : public Handle<wkv_plan, wkv_plan_destroy> {
 public:
  explicit Plan(const Engine &e) : Handle(create(e)) {}
  void lookup(wkv_seq *const *seqs, uint32_t n, uint32_t layer, const void *q, int64_t seq_stride = 0,
              int64_t head_stride = 0, void *stream = nullptr) {
    check(wkv_lookup(get(), seqs, n, layer, q, seq_stride, head_stride, stream));
  }
  void assemble(void *stream = nullptr) { check(wkv_assemble(get(), stream)); }
  wkv_xbuf_view xbuf() const {
    wkv_xbuf_view v;
    wkv_xbuf_view_init(&v);
    check(wkv_plan_xbuf(get(), &v));
    return v;
  }
  void attend(void *out, float *lse = nullptr, int64_t seq_stride = 0, int64_t head_stride = 0,
              void *stream = nullptr) {
    check(wkv_attend(get(), out, seq_stride, head_stride, lse, stream));
  }
  void merge(void *out, float *lse, int64_t seq_stride = 0, int64_t head_stride = 0,
             int64_t lse_seq_stride = 0, void *stream = nullptr) {
    check(wkv_merge(get(), out, seq_stride, head_stride, lse, lse_seq_stride, stream));
  }
  void update(void *stream = nullptr) { check(wkv_update(get(), stream)); }
  void decode(wkv_seq *const *seqs, uint32_t n, uint32_t layer, const void *q, void *out,
              void *stream = nullptr) {
    check(wkv_decode(get(), seqs, n, layer, q, 0, 0, out, 0, 0, stream));
  }
  // Steps a runtime captures (wkv_plan_bind).
  void bind(wkv_seq *const *seqs, uint32_t n, uint32_t max_steps = 0, void *stream = nullptr) {
    check(wkv_plan_bind(get(), seqs, n, max_steps, stream));
  }
  void prepare(void *stream = nullptr) { check(wkv_plan_prepare(get(), stream)); }
  void unbind(void *stream = nullptr) { check(wkv_plan_unbind(get(), stream)); }

 private:
  static wkv_plan *create(const Engine &e) {
    wkv_plan *p = nullptr;
    check(wkv_plan_create(e.get(), &p));
    return p;
  }
};

// Appends n_tokens tokens to one layer of each of n sequences in one call
// (wkv_append_batch).
inline void append_batch(wkv_seq *const *seqs, uint32_t n, uint32_t layer, const void *k, const void *v,
                         uint32_t n_tokens, int64_t seq_stride = 0, int64_t token_stride = 0,
                         int64_t head_stride = 0, void *stream = nullptr) {
  check(wkv_append_batch(seqs, n, layer, k, v, n_tokens, seq_stride, token_stride, head_stride, stream));
}

}  // namespace wavekv

#endif  // WAVEKV_HPP
