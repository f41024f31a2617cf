#include "lib/store/seq_file.hpp"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>

namespace wkv {

// Bulk data (rows, pages, f32 arrays) is written as it lies in memory, and
// the format is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "sequence files are written by little-endian hosts");

namespace seqfile {

const char *kind_name(Kind k) {
  switch (k) {
    case Kind::kLayer: return "layer";
    case Kind::kSteady: return "steady zone";
    case Kind::kMapping: return "mapping";
    case Kind::kMeta: return "meta index";
    case Kind::kPages: return "pages";
  }
  return "unknown";
}

}  // namespace seqfile

using namespace seqfile;

namespace {

constexpr uint8_t kMagic[8] = {0x89, 'W', 'K', 'V', '\r', '\n', 0x1a, '\n'};
constexpr uint8_t kSectionMagic[4] = {'W', 'K', 'V', 'S'};
constexpr uint8_t kTrailerMagic[8] = {'W', 'K', 'V', 'T', 'R', 'A', 'I', 'L'};
constexpr size_t kVersionStringBytes = 32;
constexpr size_t kChunk = 4u << 20;  // reads of payloads too large to hold

void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{p[i]} << (8 * i);
  return v;
}
uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}
uint32_t f32_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float bits_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The superblock's fields after the preamble: (offset, field of wkv_config).
// One list for the writer and the reader.
struct U32Field {
  size_t offset;
  uint32_t wkv_config::*field;
};
constexpr U32Field kShapeFields[] = {
    {56, &wkv_config::n_layers},        {60, &wkv_config::n_q_heads},
    {64, &wkv_config::n_kv_heads},      {68, &wkv_config::head_dim},
    {72, &wkv_config::dtype},           {76, &wkv_config::page_bytes},
    {88, &wkv_config::segment_tokens},  {92, &wkv_config::update_segment_tokens},
    {96, &wkv_config::cluster_tokens},  {100, &wkv_config::kmeans_iters},
    {104, &wkv_config::sink_tokens},    {108, &wkv_config::window_tokens},
};
constexpr size_t kPageTokensAt = 80, kPageSlotAt = 84, kRetrievalAt = 112, kEstimationAt = 116, kSeedAt = 120,
                 kEnvAt = 128, kDeviceAt = 132, kSavedAt = 136, kMethodAt = 144, kPageFormatAt = 148, kReservedAt = 152,
                 kChecksumAt = kSuperblockBytes - 8;

// The expected (kind, layer, head) of section i of a file with H KV heads.
SectionInfo expected_section(uint64_t i, uint32_t H) {
  SectionInfo s;
  const uint64_t per_layer = 1 + 4ull * H;
  s.layer = static_cast<uint32_t>(i / per_layer);
  const uint64_t r = i % per_layer;
  if (r == 0) {
    s.kind = Kind::kLayer;
  } else {
    s.head = static_cast<uint32_t>((r - 1) / 4);
    s.kind = kHeadKinds[(r - 1) % 4];
  }
  return s;
}

uint64_t unix_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// a * b, or false on overflow.
bool mul(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_mul_overflow(a, b, out); }

// The rows beyond each segment's tokens in its last page (and their
// scales), and the padding of every page slot, hold whatever the slot held
// before: zeroed, so that a file never carries another sequence's bytes.
void scrub_pages(HeadSnapshot &h, const Config &cfg) {
  const uint32_t pt = cfg.page_tokens(), slot = cfg.page_slot_bytes();
  const size_t row = cfg.page_row_bytes(), used_bytes = 2 * size_t(pt) * cfg.page_token_bytes();
  const size_t scales = cfg.page_scales_at(), scale_bytes = cfg.int8_pages() ? 4 : 0;
  for (uint8_t *p = h.pages.data(); p < h.pages.data() + h.pages.size(); p += slot)
    std::memset(p + used_bytes, 0, slot - used_bytes);
  for (const SegmentDesc &g : h.segments) {
    const uint32_t used = g.tokens - (g.pages - 1) * pt;  // rows of the last page
    uint8_t *last = h.pages.data() + static_cast<size_t>(g.page_begin + g.pages - 1) * slot;
    std::memset(last + used * row, 0, (pt - used) * row);
    std::memset(last + (pt + used) * row, 0, (pt - used) * row);
    std::memset(last + scales + used * scale_bytes, 0, (pt - used) * scale_bytes);
    std::memset(last + scales + (pt + used) * scale_bytes, 0, (pt - used) * scale_bytes);
  }
}

}  // namespace

Config FileHeader::config() const {
  Config c;
  c.c = cfg;
  c.env_overrides = env_overrides;
  return c;
}

std::string section_name(size_t index, const SectionInfo &s) {
  if (s.kind == Kind::kLayer) return format("section %zu (layer %u)", index, s.layer);
  return format("section %zu (layer %u, head %u, %s)", index, s.layer, s.head, kind_name(s.kind));
}

Status check_file_shape(const FileHeader &h, const Config &engine) {
  const wkv_config &f = h.cfg, &e = engine.c;
  std::string diff;
  auto differs = [&](const char *what, uint64_t file, uint64_t eng) {
    if (file == eng) return;
    diff += format("%sfile has %s %llu, engine %llu", diff.empty() ? "" : "; ", what,
                   static_cast<unsigned long long>(file), static_cast<unsigned long long>(eng));
  };
  differs("n_layers", f.n_layers, e.n_layers);
  differs("n_q_heads", f.n_q_heads, e.n_q_heads);
  differs("n_kv_heads", f.n_kv_heads, e.n_kv_heads);
  differs("head_dim", f.head_dim, e.head_dim);
  if (f.dtype != e.dtype)
    diff += format("%sfile has dtype %s, engine %s", diff.empty() ? "" : "; ",
                   dtype_name(static_cast<DType>(f.dtype)), dtype_name(engine.dtype()));
  if (f.page_format != e.page_format)
    diff += format("%sfile has page format %s, engine %s", diff.empty() ? "" : "; ",
                   page_format_name(f.page_format), page_format_name(e.page_format));
  differs("page_tokens", h.page_tokens, engine.page_tokens());
  differs("page_slot_bytes", h.page_slot_bytes, engine.page_slot_bytes());
  differs("sink_tokens", f.sink_tokens, e.sink_tokens);
  differs("window_tokens", f.window_tokens, e.window_tokens);
  differs("segment_tokens", f.segment_tokens, e.segment_tokens);
  differs("update_segment_tokens", f.update_segment_tokens, e.update_segment_tokens);
  if (diff.empty()) return Status::ok();
  return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "the file does not fit the engine: %s", diff.c_str());
}

// Writing ------------------------------------------------------------------

// Buffered writes at a running offset; the checksum of the section headers
// for the trailer.
class SeqFileWriter::Out {
 public:
  Out(FileIO &io, int fd) : io_(io), fd_(fd) {
    buf_.reserve(1u << 20);
    XXH3_64bits_reset(&headers_);
  }
  uint64_t offset() const { return flushed_ + buf_.size(); }
  uint64_t sections() const { return sections_; }
  uint64_t headers_checksum() const { return XXH3_64bits_digest(&headers_); }

  Status put(const void *p, size_t n) {
    if (buf_.size() + n > buf_.capacity()) WKV_RETURN_IF_ERROR(flush());
    if (n >= buf_.capacity()) {
      const int r = write_full(io_, fd_, p, n, flushed_);
      if (r < 0) return io_status(r, "writing the sequence file");
      flushed_ += n;
      return Status::ok();
    }
    buf_.insert(buf_.end(), static_cast<const uint8_t *>(p), static_cast<const uint8_t *>(p) + n);
    return Status::ok();
  }
  Status flush() {
    if (buf_.empty()) return Status::ok();
    const int r = write_full(io_, fd_, buf_.data(), buf_.size(), flushed_);
    if (r < 0) return io_status(r, "writing the sequence file");
    flushed_ += buf_.size();
    buf_.clear();
    return Status::ok();
  }

  struct Piece {
    const void *p;
    size_t n;
  };
  // One section: its header (with the payload's length and checksum), then
  // the payload's pieces in order.
  Status section(Kind kind, uint32_t layer, uint32_t head, std::initializer_list<Piece> pieces) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    uint64_t bytes = 0;
    for (const Piece &p : pieces) {
      XXH3_64bits_update(&st, p.p, p.n);
      bytes += p.n;
    }
    uint8_t h[kSectionHeaderBytes] = {};
    std::memcpy(h, kSectionMagic, 4);
    h[4] = static_cast<uint8_t>(kind);
    h[5] = static_cast<uint8_t>(static_cast<uint16_t>(kind) >> 8);
    put32(h + 8, layer);
    put32(h + 12, head);
    put64(h + 16, bytes);
    put64(h + 24, XXH3_64bits_digest(&st));
    put64(h + 40, XXH3_64bits(h, 40));
    XXH3_64bits_update(&headers_, h, sizeof h);
    ++sections_;
    WKV_RETURN_IF_ERROR(put(h, sizeof h));
    for (const Piece &p : pieces) WKV_RETURN_IF_ERROR(put(p.p, p.n));
    return Status::ok();
  }

 private:
  FileIO &io_;
  int fd_;
  std::vector<uint8_t> buf_;
  uint64_t flushed_ = 0;
  uint64_t sections_ = 0;
  XXH3_state_t headers_;
};

Status SeqFileWriter::write(const ExportFn &next_layer, uint32_t flags, const ProgressFn &progress) {
  const wkv_config &c = cfg_.c;
  Out out(io_, fd_);
  try {
    // 1. The superblock.
    uint8_t sb[kSuperblockBytes] = {};
    std::memcpy(sb, kMagic, 8);
    put32(sb + 8, c.page_format == WKV_PAGE_FORMAT_STORAGE ? 1 : kFormatVersionInt8Pages);
    put32(sb + 12, static_cast<uint32_t>(XXH3_64bits(sb, 12)));
    put32(sb + 20, WKV_VERSION_NUMBER);
    std::snprintf(reinterpret_cast<char *>(sb + 24), kVersionStringBytes, "%d.%d.%d", WKV_VERSION_MAJOR,
                  WKV_VERSION_MINOR, WKV_VERSION_PATCH);
    for (const U32Field &f : kShapeFields) put32(sb + f.offset, c.*f.field);
    put32(sb + kPageTokensAt, cfg_.page_tokens());
    put32(sb + kPageSlotAt, cfg_.page_slot_bytes());
    put32(sb + kRetrievalAt, f32_bits(c.retrieval_frac));
    put32(sb + kEstimationAt, f32_bits(c.estimation_frac));
    put64(sb + kSeedAt, c.seed);
    put32(sb + kEnvAt, cfg_.env_overrides);
    put32(sb + kDeviceAt, device_);
    put64(sb + kSavedAt, unix_ms());
    put32(sb + kMethodAt, c.method);
    put32(sb + kPageFormatAt, c.page_format);  // 0 (reserved) in format 1
    put64(sb + kChecksumAt, XXH3_64bits(sb, kChecksumAt));
    WKV_RETURN_IF_ERROR(out.put(sb, sizeof sb));

    // 2. Each layer: its section, then each head's four.
    LayerSnapshot snap;
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      WKV_RETURN_IF_ERROR(next_layer(l, &snap));
      uint8_t lp[kLayerPayloadBytes] = {};
      put64(lp, snap.tokens);
      put64(lp + 8, snap.tail_begin);
      put32(lp + 16, snap.generating ? 1 : 0);
      WKV_RETURN_IF_ERROR(out.section(Kind::kLayer, l, kNoHead, {{lp, sizeof lp}}));
      for (uint32_t h = 0; h < c.n_kv_heads; ++h) {
        HeadSnapshot &hs = snap.heads[h];
        WKV_RETURN_IF_ERROR(out.section(Kind::kSteady, l, h,
                                        {{hs.sink_k.data(), hs.sink_k.size()},
                                         {hs.sink_v.data(), hs.sink_v.size()},
                                         {hs.tail_k.data(), hs.tail_k.size()},
                                         {hs.tail_v.data(), hs.tail_v.size()}}));
        const size_t S = hs.segments.size(), C = hs.size.size();
        std::vector<uint8_t> map(8 + S * kSegmentRecordBytes + 8 * C);
        put32(map.data(), static_cast<uint32_t>(S));
        put32(map.data() + 4, static_cast<uint32_t>(C));
        uint8_t *p = map.data() + 8;
        for (const SegmentDesc &g : hs.segments) {
          put64(p, g.token_begin);
          const uint32_t v[6] = {g.tokens, g.cluster_begin, g.clusters, g.page_begin, g.pages, g.generated};
          for (int i = 0; i < 6; ++i) put32(p + 8 + 4 * i, v[i]);
          p += kSegmentRecordBytes;
        }
        for (size_t i = 0; i < C; ++i) put32(p + 4 * i, hs.first_slot[i]);
        for (size_t i = 0; i < C; ++i) put32(p + 4 * (C + i), hs.size[i]);
        WKV_RETURN_IF_ERROR(out.section(Kind::kMapping, l, h, {{map.data(), map.size()}}));
        WKV_RETURN_IF_ERROR(out.section(Kind::kMeta, l, h,
                                        {{hs.centroid.data(), hs.centroid.size() * 4},
                                         {hs.value_sum.data(), hs.value_sum.size() * 4},
                                         {hs.spread.data(), hs.spread.size() * 4}}));
        scrub_pages(hs, cfg_);
        WKV_RETURN_IF_ERROR(out.section(Kind::kPages, l, h, {{hs.pages.data(), hs.pages.size()}}));
      }
      if (progress) progress(l + 1, c.n_layers);
    }

    // 3. The trailer.
    uint8_t tr[kTrailerBytes] = {};
    std::memcpy(tr, kTrailerMagic, 8);
    put64(tr + 8, out.sections());
    put64(tr + 16, out.headers_checksum());
    put64(tr + 24, XXH3_64bits(tr, 24));
    WKV_RETURN_IF_ERROR(out.put(tr, sizeof tr));
    WKV_RETURN_IF_ERROR(out.flush());
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory writing a sequence file");
  }
  // 4. Exactly the file: a longer file given by descriptor loses its tail.
  int r = io_.truncate(fd_, out.offset());
  if (r < 0) return io_status(r, "truncating the sequence file");
  if (!(flags & kSaveNoFsync)) {
    r = io_.fsync(fd_);
    if (r < 0) return io_status(r, "fsync of the sequence file");
  }
  return Status::ok();
}

// Reading ------------------------------------------------------------------

Status SeqFileReader::corrupt(size_t index, const SectionInfo &s, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return WKV_ERROR(WKV_ERR_CORRUPT, "%s: %s", section_name(index, s).c_str(), buf);
}

Status SeqFileReader::read_header() {
  int r = io_.size(fd_, &file_bytes_);
  if (r < 0) return io_status(r, "the size of the sequence file");
  // 1. The preamble (magic, version, its check), the same in every format.
  uint8_t sb[kSuperblockBytes] = {};
  r = read_full(io_, fd_, sb, std::min<uint64_t>(file_bytes_, kSuperblockBytes), 0);
  if (r < 0) return io_status(r, "reading the superblock");
  if (file_bytes_ < 16 || std::memcmp(sb, kMagic, 8) != 0)
    return WKV_ERROR(WKV_ERR_CORRUPT, "not a wavekv sequence file (no magic number)");
  if (get32(sb + 12) != static_cast<uint32_t>(XXH3_64bits(sb, 12)))
    return WKV_ERROR(WKV_ERR_CORRUPT, "the superblock: the format version's checksum does not match");
  FileHeader &h = header_;
  h.format_version = get32(sb + 8);
  if (h.format_version > kFormatVersion)
    return WKV_ERROR(WKV_ERR_UNSUPPORTED,
                     "the file has format version %u, newer than this library's (%u): load it with a newer wavekv",
                     h.format_version, kFormatVersion);
  if (h.format_version == 0) return WKV_ERROR(WKV_ERR_CORRUPT, "the superblock: format version 0");
  // 2. The superblock of formats 1 and 2 (2 adds the page format).
  if (file_bytes_ < kSuperblockBytes + kTrailerBytes)
    return WKV_ERROR(WKV_ERR_CORRUPT, "the file is %llu bytes, too short for a superblock and a trailer (truncated)",
                     static_cast<unsigned long long>(file_bytes_));
  if (get64(sb + kChecksumAt) != XXH3_64bits(sb, kChecksumAt))
    return WKV_ERROR(WKV_ERR_CORRUPT, "the superblock: checksum mismatch");
  const bool reserved_zero =
      get32(sb + 16) == 0 && std::all_of(sb + kReservedAt, sb + kChecksumAt, [](uint8_t b) { return b == 0; });
  h.library_version = get32(sb + 20);
  const char *vs = reinterpret_cast<const char *>(sb + 24);
  h.library_version_string.assign(vs, strnlen(vs, kVersionStringBytes));
  std::memset(&h.cfg, 0, sizeof h.cfg);
  h.cfg.size = sizeof h.cfg;
  for (const U32Field &f : kShapeFields) h.cfg.*f.field = get32(sb + f.offset);
  h.page_tokens = get32(sb + kPageTokensAt);
  h.page_slot_bytes = get32(sb + kPageSlotAt);
  h.cfg.retrieval_frac = bits_f32(get32(sb + kRetrievalAt));
  h.cfg.estimation_frac = bits_f32(get32(sb + kEstimationAt));
  h.cfg.seed = get64(sb + kSeedAt);
  h.env_overrides = get32(sb + kEnvAt);
  h.device = get32(sb + kDeviceAt);
  h.saved_unix_ms = get64(sb + kSavedAt);
  h.cfg.method = get32(sb + kMethodAt);
  h.cfg.page_format = get32(sb + kPageFormatAt);

  // 3. Values a writer of this format produces, no others: the reader's
  //    arithmetic relies on them.
  const wkv_config &c = h.cfg;
  const Config cfg = h.config();
  const char *bad = nullptr;
  if (!reserved_zero || (h.format_version == 1 && c.page_format != 0)) bad = "reserved bytes are not zero";
  else if (c.page_format > WKV_PAGE_FORMAT_INT8_CENTERED) bad = "unknown page format";
  else if (h.format_version == kFormatVersionInt8Pages && c.page_format == WKV_PAGE_FORMAT_STORAGE)
    bad = "format 2 without 8-bit pages (a file of storage-dtype pages is format 1)";
  else if (c.n_layers == 0 || c.n_layers > 4096 || c.n_q_heads == 0 || c.n_q_heads > 1024 || c.n_kv_heads == 0 ||
           c.n_q_heads % c.n_kv_heads != 0)
    bad = "impossible layer or head counts";
  else if (!head_dim_supported(c.head_dim) || c.dtype > WKV_DTYPE_BF16) bad = "unsupported head_dim or dtype";
  else if (c.page_bytes < 64 || c.page_bytes > (1u << 24) || h.page_tokens != cfg.page_tokens() ||
           h.page_tokens > 32768 || h.page_slot_bytes != cfg.page_slot_bytes())
    bad = "inconsistent page sizes";
  else if (c.segment_tokens == 0 || c.segment_tokens > 65536 || c.update_segment_tokens == 0 ||
           c.update_segment_tokens > 65536 || c.sink_tokens > (1u << 20) || c.window_tokens > (1u << 20) ||
           c.cluster_tokens == 0 || c.kmeans_iters == 0)
    bad = "index settings out of range";
  else if (h.device > WKV_DEVICE_CUDA) bad = "unknown device";
  else if (c.method & ~static_cast<uint32_t>(WKV_METHOD_DEFAULT)) bad = "unknown method bits";
  if (bad) return WKV_ERROR(WKV_ERR_CORRUPT, "the superblock: %s", bad);
  return Status::ok();
}

Status SeqFileReader::read_sections(const ProgressFn &progress) {
  sections_.clear();
  const uint64_t end = file_bytes_ - kTrailerBytes;  // where the trailer begins
  const uint64_t count = header_.section_count();
  XXH3_state_t headers;
  XXH3_64bits_reset(&headers);
  uint64_t off = kSuperblockBytes;
  // 1. Every section header, in the order the format fixes; a section is
  //    listed once its header is checked and its payload inside the file.
  for (uint64_t i = 0; i < count; ++i) {
    SectionInfo s = expected_section(i, header_.n_kv_heads());
    s.offset = off;
    if (end - off < kSectionHeaderBytes)
      return corrupt(i, s, "the file ends before it, at byte %llu (truncated)",
                     static_cast<unsigned long long>(file_bytes_));
    uint8_t h[kSectionHeaderBytes];
    const int r = read_full(io_, fd_, h, sizeof h, off);
    if (r < 0) return io_status(r, "reading " + section_name(i, s));
    if (std::memcmp(h, kSectionMagic, 4) != 0)
      return corrupt(i, s, "no section header at byte %llu", static_cast<unsigned long long>(off));
    if (get64(h + 40) != XXH3_64bits(h, 40)) return corrupt(i, s, "header checksum mismatch");
    const uint16_t kind = static_cast<uint16_t>(h[4] | h[5] << 8);
    if (kind != static_cast<uint16_t>(s.kind) || get32(h + 8) != s.layer || get32(h + 12) != s.head ||
        h[6] != 0 || h[7] != 0 || get64(h + 32) != 0)
      return corrupt(i, s, "the header names another section (kind %u, layer %u, head %u)", kind, get32(h + 8),
                     get32(h + 12));
    s.bytes = get64(h + 16);
    s.checksum = get64(h + 24);
    XXH3_64bits_update(&headers, h, sizeof h);
    off += kSectionHeaderBytes;
    if (s.bytes > end - off)
      return corrupt(i, s, "its %llu bytes run past the end of the file (truncated)",
                     static_cast<unsigned long long>(s.bytes));
    off += s.bytes;
    sections_.push_back(s);
    if (progress) progress(i + 1, count);
  }
  // 2. The trailer, right after the last section.
  if (off != end)
    return WKV_ERROR(WKV_ERR_CORRUPT, "the trailer: %llu unexpected bytes after the last section",
                     static_cast<unsigned long long>(end - off));
  uint8_t tr[kTrailerBytes];
  const int r = read_full(io_, fd_, tr, sizeof tr, end);
  if (r < 0) return io_status(r, "reading the trailer");
  if (std::memcmp(tr, kTrailerMagic, 8) != 0) return WKV_ERROR(WKV_ERR_CORRUPT, "the trailer: not found (truncated?)");
  if (get64(tr + 24) != XXH3_64bits(tr, 24)) return WKV_ERROR(WKV_ERR_CORRUPT, "the trailer: checksum mismatch");
  if (get64(tr + 8) != count)
    return WKV_ERROR(WKV_ERR_CORRUPT, "the trailer: counts %llu sections, the superblock implies %llu",
                     static_cast<unsigned long long>(get64(tr + 8)), static_cast<unsigned long long>(count));
  if (get64(tr + 16) != XXH3_64bits_digest(&headers))
    return WKV_ERROR(WKV_ERR_CORRUPT, "the trailer: the checksum of the section headers does not match");
  return Status::ok();
}

Status SeqFileReader::read_payload(size_t index, std::initializer_list<Piece> pieces) {
  const SectionInfo &s = sections_[index];
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  uint64_t off = s.offset + kSectionHeaderBytes;
  for (const Piece &p : pieces) {
    const int r = read_full(io_, fd_, p.p, p.n, off);
    if (r < 0) return io_status(r, "reading " + section_name(index, s));
    XXH3_64bits_update(&st, p.p, p.n);
    off += p.n;
  }
  if (off != s.offset + kSectionHeaderBytes + s.bytes)
    return WKV_ERROR(WKV_ERR_INTERNAL, "%s: pieces of %llu bytes read for %llu", section_name(index, s).c_str(),
                     static_cast<unsigned long long>(off - s.offset - kSectionHeaderBytes),
                     static_cast<unsigned long long>(s.bytes));
  if (XXH3_64bits_digest(&st) != s.checksum) return corrupt(index, s, "checksum mismatch");
  return Status::ok();
}

Status SeqFileReader::check_section(size_t index) {
  const SectionInfo &s = sections_[index];
  std::vector<uint8_t> buf;
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  try {
    buf.resize(std::min<uint64_t>(s.bytes, kChunk));
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory checking a section");
  }
  for (uint64_t done = 0; done < s.bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(s.bytes - done, buf.size()));
    const int r = read_full(io_, fd_, buf.data(), n, s.offset + kSectionHeaderBytes + done);
    if (r < 0) return io_status(r, "reading " + section_name(index, s));
    XXH3_64bits_update(&st, buf.data(), n);
    done += n;
  }
  if (XXH3_64bits_digest(&st) != s.checksum) return corrupt(index, s, "checksum mismatch");
  return Status::ok();
}

Status SeqFileReader::read_layer(uint32_t layer, LayerSnapshot *out) {
  const wkv_config &c = header_.cfg;
  const uint32_t H = c.n_kv_heads, d = c.head_dim;
  const Config cfg = header_.config();
  const uint64_t row = cfg.row_bytes(), slot = header_.page_slot_bytes;
  const size_t first = static_cast<size_t>(layer) * (1 + 4ull * H);
  if (layer >= c.n_layers || sections_.size() < first + 1 + 4ull * H)
    return WKV_ERROR(WKV_ERR_INTERNAL, "read_layer %u before its sections were read", layer);
  // The length a section must have, checked before anything is allocated.
  auto expect = [&](size_t i, uint64_t bytes, const char *implied_by) -> Status {
    if (sections_[i].bytes == bytes) return Status::ok();
    return corrupt(i, sections_[i], "%llu bytes, where %s implies %llu", static_cast<unsigned long long>(sections_[i].bytes),
                   implied_by, static_cast<unsigned long long>(bytes));
  };
  try {
    // 1. The layer: tokens, where its tail begins, whether it generates.
    WKV_RETURN_IF_ERROR(expect(first, kLayerPayloadBytes, "the format"));
    uint8_t lp[kLayerPayloadBytes];
    WKV_RETURN_IF_ERROR(read_payload(first, {{lp, sizeof lp}}));
    out->shape = snapshot_shape(cfg);
    out->tokens = get64(lp);
    out->tail_begin = get64(lp + 8);
    const uint32_t generating = get32(lp + 16);
    if (out->tail_begin > out->tokens || generating > 1 || get32(lp + 20) != 0)
      return corrupt(first, sections_[first], "impossible values (tail at %llu of %llu tokens, generating %u)",
                     static_cast<unsigned long long>(out->tail_begin), static_cast<unsigned long long>(out->tokens),
                     generating);
    out->generating = generating == 1;
    const uint64_t sink = std::min<uint64_t>(out->tokens, c.sink_tokens), tail = out->tokens - out->tail_begin;
    out->heads.assign(H, HeadSnapshot{});
    for (uint32_t h = 0; h < H; ++h) {
      HeadSnapshot &o = out->heads[h];
      const size_t i = first + 1 + 4ull * h;
      // 2. The steady zone: its size follows from the layer's.
      uint64_t sink_bytes = 0, tail_bytes = 0;
      if (!mul(sink, row, &sink_bytes) || !mul(tail, row, &tail_bytes) || tail_bytes > sections_[i].bytes / 2)
        return corrupt(first, sections_[first], "a tail of %llu tokens is more than the file holds",
                       static_cast<unsigned long long>(tail));
      WKV_RETURN_IF_ERROR(expect(i, 2 * (sink_bytes + tail_bytes), "the layer's token counts"));
      o.sink_k.resize(sink_bytes);
      o.sink_v.resize(sink_bytes);
      o.tail_k.resize(tail_bytes);
      o.tail_v.resize(tail_bytes);
      WKV_RETURN_IF_ERROR(read_payload(i, {{o.sink_k.data(), sink_bytes},
                                           {o.sink_v.data(), sink_bytes},
                                           {o.tail_k.data(), tail_bytes},
                                           {o.tail_v.data(), tail_bytes}}));
      // 3. The mapping: its counts come first and fix its length.
      if (sections_[i + 1].bytes < 8) return expect(i + 1, 8, "the format");
      std::vector<uint8_t> map(sections_[i + 1].bytes);
      WKV_RETURN_IF_ERROR(read_payload(i + 1, {{map.data(), map.size()}}));
      const uint64_t S = get32(map.data()), C = get32(map.data() + 4);
      WKV_RETURN_IF_ERROR(expect(i + 1, 8 + S * kSegmentRecordBytes + 8 * C, "its segment and cluster counts"));
      o.segments.resize(S);
      const uint8_t *p = map.data() + 8;
      uint64_t pages = 0;
      for (SegmentDesc &g : o.segments) {
        g.token_begin = get64(p);
        g.tokens = get32(p + 8);
        g.cluster_begin = get32(p + 12);
        g.clusters = get32(p + 16);
        g.page_begin = get32(p + 20);
        g.pages = get32(p + 24);
        g.generated = get32(p + 28);
        pages += g.pages;
        p += kSegmentRecordBytes;
      }
      o.first_slot.resize(C);
      o.size.resize(C);
      for (uint64_t j = 0; j < C; ++j) o.first_slot[j] = get32(p + 4 * j);
      for (uint64_t j = 0; j < C; ++j) o.size[j] = get32(p + 4 * (C + j));
      // 4. The meta index: clusters x head_dim f32, twice, then clusters f32.
      WKV_RETURN_IF_ERROR(expect(i + 2, (8 * d + 4) * C, "the mapping's cluster count"));
      o.centroid.resize(C * d);
      o.value_sum.resize(C * d);
      o.spread.resize(C);
      WKV_RETURN_IF_ERROR(read_payload(
          i + 2, {{o.centroid.data(), 4 * C * d}, {o.value_sum.data(), 4 * C * d}, {o.spread.data(), 4 * C}}));
      // 5. The pages the segments name.
      uint64_t page_bytes = 0;
      if (!mul(pages, slot, &page_bytes)) return corrupt(i + 1, sections_[i + 1], "its segments name %llu pages", static_cast<unsigned long long>(pages));
      WKV_RETURN_IF_ERROR(expect(i + 3, page_bytes, "the mapping's segments"));
      o.pages.resize(page_bytes);
      WKV_RETURN_IF_ERROR(read_payload(i + 3, {{o.pages.data(), page_bytes}}));
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory reading layer %u", layer);
  }
  return Status::ok();
}

}  // namespace wkv
