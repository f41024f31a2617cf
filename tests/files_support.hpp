// Support of the sequence-file tests: a scratch directory, sequences with
// every kind of content (sink, clustered prompt and generated segments,
// tail), decoding through the C ABI, files as bytes, and the sections of a
// file as the reader lists them. Header-only.
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <xxhash.h>

#include "lib/store/seq_file.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

namespace wkvtest {

// A fresh directory under $TMPDIR (or /tmp), removed with what it holds.
class ScratchDir {
 public:
  ScratchDir() {
    const char *base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/wavekv-files-XXXXXX";
    path_ = mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~ScratchDir() {
    for (const std::string &n : names()) ::unlink((path_ + "/" + n).c_str());
    ::rmdir(path_.c_str());
  }
  const std::string &path() const { return path_; }
  std::string file(const std::string &name) const { return path_ + "/" + name; }
  // The names in the directory, "." and ".." left out.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    if (DIR *d = opendir(path_.c_str())) {
      while (dirent *e = readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(e->d_name);
      closedir(d);
    }
    return out;
  }

 private:
  std::string path_;
};

inline std::vector<uint8_t> read_bytes(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
inline void write_bytes(const std::string &path, const std::vector<uint8_t> &b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char *>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A small model shape for file tests.
struct Shape {
  uint32_t layers = 2, q_heads = 4, kv_heads = 2, head_dim = 64, dtype = WKV_DTYPE_F16;
};

inline wkv_config file_config(const Shape &s) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = s.layers;
  c.n_q_heads = s.q_heads;
  c.n_kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.dtype = s.dtype;
  c.segment_tokens = 256;
  c.update_segment_tokens = 64;
  c.window_tokens = 32;
  c.threads = 2;
  return c;
}

// The engine of the file reader's fuzz target and its seed files
// (tests/fuzz/): one layer of one KV head, small segments, so that a seed
// holds every kind of section in a few tens of KB.
inline wkv_config fuzz_config() {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = 1;
  c.n_q_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 64;
  c.dtype = WKV_DTYPE_F16;
  c.segment_tokens = 64;
  c.update_segment_tokens = 32;
  c.cluster_tokens = 8;
  c.window_tokens = 16;
  c.kmeans_iters = 3;
  c.threads = 1;
  return c;
}

// Tokens and queries of one context in a shape's dtype.
class Context {
 public:
  explicit Context(const Shape &s, uint64_t seed = 7) : s_(s), gen_(s.kv_heads, s.head_dim, seed) {}
  void tokens(uint32_t n, std::vector<uint8_t> *k, std::vector<uint8_t> *v) {
    std::vector<float> kf, vf;
    gen_.next(n, &kf, &vf);
    *k = pack(s_.dtype, kf);
    *v = pack(s_.dtype, vf);
  }
  std::vector<uint8_t> query() {
    std::vector<float> q;
    for (uint32_t h = 0; h < s_.kv_heads; ++h) gen_.query(h, s_.q_heads / s_.kv_heads, &q);
    return pack(s_.dtype, q);
  }

 private:
  Shape s_;
  KeyGen gen_;
};

// The rows a sequence of a Context holds, per KV head in f32 as stored:
// exact attention's reference. It follows a Context of its own with the
// same seed through the same tokens.
class StoredRows {
 public:
  explicit StoredRows(const Shape &s, uint64_t seed = 7) : s_(s), ctx_(s, seed), rows_(s.kv_heads) {}
  // The next n tokens of the context.
  void take(uint32_t n) {
    std::vector<uint8_t> k, v;
    ctx_.tokens(n, &k, &v);
    const size_t count = size_t(n) * s_.kv_heads * s_.head_dim;
    const std::vector<float> kf = unpack(s_.dtype, k, count), vf = unpack(s_.dtype, v, count);
    const uint32_t H = s_.kv_heads, d = s_.head_dim;
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t h = 0; h < H; ++h) {
        const size_t at = (size_t(t) * H + h) * d;
        rows_[h].k.insert(rows_[h].k.end(), kf.begin() + at, kf.begin() + at + d);
        rows_[h].v.insert(rows_[h].v.end(), vf.begin() + at, vf.begin() + at + d);
      }
  }
  const HeadRows &head(uint32_t h) const { return rows_[h]; }

 private:
  Shape s_;
  Context ctx_;
  std::vector<HeadRows> rows_;
};

// Fills a sequence with every kind of content: layer 0 and the odd layers
// end their prompt and generate past an update segment; other even layers
// stay in their prompt (a clustered segment and an unclustered tail).
inline void fill(wavekv::Sequence &seq, const Shape &s, Context &ctx, uint32_t prompt = 700,
                 uint32_t generated = 90) {
  std::vector<uint8_t> k, v;
  ctx.tokens(prompt, &k, &v);
  for (uint32_t l = 0; l < s.layers; ++l) seq.append(l, k.data(), v.data(), prompt);
  for (uint32_t l = 0; l < s.layers; ++l)
    if (l == 0 || l % 2 == 1) seq.end_prompt(l);
  for (uint32_t g = 0; g < generated; ++g) {
    ctx.tokens(1, &k, &v);
    for (uint32_t l = 0; l < s.layers; ++l)
      if (l == 0 || l % 2 == 1) seq.append(l, k.data(), v.data(), 1);
  }
}

// One decoding step of every layer: the outputs, concatenated.
inline std::vector<uint8_t> decode_all(const wavekv::Engine &e, wkv_seq *seq, const Shape &s,
                                       const std::vector<uint8_t> &q) {
  wavekv::Plan p(e);
  std::vector<uint8_t> all;
  for (uint32_t l = 0; l < s.layers; ++l) {
    std::vector<uint8_t> out(q.size(), 0xee);
    p.decode(&seq, 1, l, q.data(), out.data());
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

// The sections of an intact file, as the reader lists them.
inline std::vector<wkv::SectionInfo> sections_of(const std::string &path) {
  wkv::FileIO &io = wkv::posix_io();
  const int fd = io.open_read(path.c_str());
  wkv::SeqFileReader r(io, fd);
  wkv::Status st = r.open();
  io.close(fd);
  return st.is_ok() ? r.sections() : std::vector<wkv::SectionInfo>{};
}

// Recomputes every checksum of a file in place, as far as its section
// headers can be walked, so that a file altered on purpose passes them and
// meets the checks behind them (tests of hostile files, the fuzzer).
inline void repair_checksums(std::vector<uint8_t> &b) {
  using namespace wkv::seqfile;
  auto put64 = [&](size_t at, uint64_t v) {
    for (int i = 0; i < 8; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
  };
  auto get64 = [&](size_t at) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{b[at + i]} << (8 * i);
    return v;
  };
  if (b.size() < kSuperblockBytes + kTrailerBytes) return;
  const uint32_t pre = static_cast<uint32_t>(XXH3_64bits(b.data(), 12));
  for (int i = 0; i < 4; ++i) b[12 + i] = static_cast<uint8_t>(pre >> (8 * i));
  put64(kSuperblockBytes - 8, XXH3_64bits(b.data(), kSuperblockBytes - 8));
  const size_t end = b.size() - kTrailerBytes;
  XXH3_state_t *headers = XXH3_createState();
  XXH3_64bits_reset(headers);
  uint64_t count = 0;
  for (size_t off = kSuperblockBytes; end - off >= kSectionHeaderBytes; ++count) {
    const uint64_t bytes = get64(off + 16);
    if (bytes > end - off - kSectionHeaderBytes) break;
    put64(off + 24, XXH3_64bits(b.data() + off + kSectionHeaderBytes, bytes));
    put64(off + 40, XXH3_64bits(b.data() + off, 40));
    XXH3_64bits_update(headers, b.data() + off, kSectionHeaderBytes);
    off += kSectionHeaderBytes + bytes;
  }
  put64(end + 8, count);
  put64(end + 16, XXH3_64bits_digest(headers));
  put64(end + 24, XXH3_64bits(b.data() + end, 24));
  XXH3_freeState(headers);
}

}  // namespace wkvtest
