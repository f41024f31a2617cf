// Sequence files: one sequence (every layer's LayerSnapshot) and the
// settings that shaped it, as docs/FORMAT.md lays them out: a superblock,
// sections of (layer, head) data each with its length and checksum, a
// trailer. Written and read layer by layer, so that neither side holds more
// than one layer's snapshot in host memory.
//
// A reader trusts nothing it has not checked: every length is bounded by
// the file's size and compared with what the shape and the sections before
// it imply before anything is allocated for it; every byte is covered by a
// checksum (XXH3-64) that is checked before the bytes are used.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lib/common/config.hpp"
#include "lib/common/status.hpp"
#include "lib/index/snapshot.hpp"
#include "lib/store/io.hpp"

namespace wkv {
namespace seqfile {

// Format numbers are never reused; a reader refuses a newer one. A file is
// written in the oldest format that holds it: 1 for pages of the storage
// dtype, 2 for 8-bit pages (its page format at byte 148 of the superblock,
// reserved in format 1), so that older readers keep reading what they can.
constexpr uint32_t kFormatVersion = 2;
constexpr uint32_t kFormatVersionInt8Pages = 2;
constexpr size_t kSuperblockBytes = 256;
constexpr size_t kSectionHeaderBytes = 48;
constexpr size_t kTrailerBytes = 32;
constexpr size_t kLayerPayloadBytes = 24;
constexpr size_t kSegmentRecordBytes = 32;
constexpr uint32_t kNoHead = 0xffffffffu;  // the head field of a layer section

enum class Kind : uint16_t { kLayer = 1, kSteady = 2, kMapping = 3, kMeta = 4, kPages = 5 };
// The sections of one KV head, in file order, after its layer's kLayer.
constexpr Kind kHeadKinds[] = {Kind::kSteady, Kind::kMapping, Kind::kMeta, Kind::kPages};
const char *kind_name(Kind k);

}  // namespace seqfile

// Bits of the flags of a save (wavekv.h's WKV_SAVE_*).
constexpr uint32_t kSaveNoFsync = 1u << 0;

// The superblock, decoded.
struct FileHeader {
  uint32_t format_version = 0;
  uint32_t library_version = 0;          // WKV_VERSION_NUMBER of the writer
  std::string library_version_string;    // "0.1.0"
  wkv_config cfg{};                      // shape and index settings; the rest zero
  uint32_t page_tokens = 0, page_slot_bytes = 0;
  uint32_t env_overrides = 0;            // bits: env_override_name()
  uint32_t device = 0;                   // WKV_DEVICE_* of the engine that wrote it
  uint64_t saved_unix_ms = 0;

  uint32_t n_layers() const { return cfg.n_layers; }
  uint32_t n_kv_heads() const { return cfg.n_kv_heads; }
  uint64_t section_count() const { return uint64_t{cfg.n_layers} * (1 + 4ull * cfg.n_kv_heads); }
  // The engine configuration the file describes (for checks without an engine).
  Config config() const;
};

// One section as found in a file.
struct SectionInfo {
  seqfile::Kind kind;
  uint32_t layer = 0, head = seqfile::kNoHead;
  uint64_t offset = 0;  // of its header
  uint64_t bytes = 0;   // of its payload, which follows the header
  uint64_t checksum = 0;
};
// "section 17 (layer 1, head 3, mapping)".
std::string section_name(size_t index, const SectionInfo &s);

// (done, total) of a long operation: layers, or bytes.
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

// Checks a file's shape and layout settings against an engine's:
// WKV_ERR_INVALID_ARGUMENT naming every difference ("file has head_dim 64,
// engine 128"). Fractions, cluster_tokens, kmeans_iters and seed may differ:
// they shape only lookups and later growths, where the engine's apply.
Status check_file_shape(const FileHeader &h, const Config &engine);

// Writes a sequence file into fd from offset 0, one layer at a time:
// `next_layer(l, &snap)` exports layer l (and may be given back to free it
// once written). The file is fsynced unless flags has kSaveNoFsync, and
// truncated to its length.
class SeqFileWriter {
 public:
  using ExportFn = std::function<Status(uint32_t layer, LayerSnapshot *snap)>;
  SeqFileWriter(FileIO &io, int fd, const Config &cfg, uint32_t device) : io_(io), fd_(fd), cfg_(cfg), device_(device) {}
  Status write(const ExportFn &next_layer, uint32_t flags, const ProgressFn &progress = nullptr);

 private:
  class Out;
  FileIO &io_;
  int fd_;
  const Config &cfg_;
  uint32_t device_;
};

// Reads a sequence file: the superblock, then the section headers and the
// trailer (open), then the payloads of one layer at a time (read_layer) or
// of any section (check_section). Errors: WKV_ERR_CORRUPT naming the
// section, WKV_ERR_UNSUPPORTED for a newer format, WKV_ERR_IO.
class SeqFileReader {
 public:
  SeqFileReader(FileIO &io, int fd) : io_(io), fd_(fd) {}

  // 1. The superblock alone (its checksum, version, values).
  Status read_header();
  // 2. Walks the section headers and checks the trailer. Pre: read_header.
  //    The sections found whole before a failure stay listed.
  Status read_sections(const ProgressFn &progress = nullptr);
  // Both.
  Status open() {
    WKV_RETURN_IF_ERROR(read_header());
    return read_sections();
  }

  const FileHeader &header() const { return header_; }
  const std::vector<SectionInfo> &sections() const { return sections_; }
  uint64_t file_bytes() const { return file_bytes_; }

  // Reads, checks and decodes one layer's sections into *out (lengths
  // checked against what the shape implies before anything is allocated);
  // out->shape is the file's. Does not run check_snapshot. Pre: open.
  Status read_layer(uint32_t layer, LayerSnapshot *out);
  // Reads one section's payload in pieces and checks its checksum. Pre: open.
  Status check_section(size_t index);

 private:
  // Reads a section's payload into the pieces (their sizes sum to its
  // bytes) and checks its checksum.
  struct Piece {
    void *p;
    size_t n;
  };
  Status read_payload(size_t index, std::initializer_list<Piece> pieces);
  static Status corrupt(size_t index, const SectionInfo &s, const char *fmt, ...)
      __attribute__((format(printf, 3, 4)));

  FileIO &io_;
  int fd_;
  uint64_t file_bytes_ = 0;
  FileHeader header_;
  std::vector<SectionInfo> sections_;
};

}  // namespace wkv
