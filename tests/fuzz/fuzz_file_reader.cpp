// libFuzzer target of the sequence-file reader (lib/store/seq_file.hpp).
// An input is one mode byte and a file. The file is read from memory
// through the I/O layer: the superblock, the walk of the section headers
// and the trailer, every layer decoded and checked as an import checks it,
// and, when it fits the small engine below, loaded into it (and destroyed).
// Mode bit 0 recomputes every checksum first, so that the fuzzer reaches
// the checks behind them: a hostile file can carry right checksums; mode
// bit 1 loads into an engine of 8-bit pages (format-2 files).
//
// Built by `make fuzz` (clang, -fsanitize=fuzzer,address,undefined) and run
// on tests/fuzz/corpus/file_reader, whose seeds test_files writes and
// checks (FuzzSeeds).
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "files_support.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/sequence.hpp"

namespace {

// One file in memory, as descriptor kFd.
class MemoryIO final : public wkv::FileIO {
 public:
  static constexpr int kFd = 3;
  explicit MemoryIO(const std::vector<uint8_t> &bytes) : b_(bytes) {}
  int open_dir(const char *) override { return -ENOTSUP; }
  int open_read(const char *) override { return -ENOTSUP; }
  int create_excl(int, const char *) override { return -ENOTSUP; }
  int open_tmp(int, int) override { return -ENOTSUP; }
  int create_rw(int, const char *, int) override { return -ENOTSUP; }
  int64_t pread(int fd, void *buf, size_t n, uint64_t offset) override {
    if (fd != kFd) return -EBADF;
    if (offset >= b_.size()) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, b_.size() - offset));
    std::memcpy(buf, b_.data() + offset, n);
    return static_cast<int64_t>(n);
  }
  int64_t pwrite(int, const void *, size_t, uint64_t) override { return -EBADF; }
  int fsync(int) override { return 0; }
  int truncate(int, uint64_t) override { return -EBADF; }
  int size(int fd, uint64_t *bytes) override {
    if (fd != kFd) return -EBADF;
    *bytes = b_.size();
    return 0;
  }
  int rename_at(int, const char *, const char *) override { return -ENOTSUP; }
  int unlink_at(int, const char *) override { return -ENOTSUP; }
  int close(int) override { return 0; }

 private:
  const std::vector<uint8_t> &b_;
};

// The engine a file is loaded into: pages of the storage dtype, 8-bit pages
// (mode bit 1), or 8-bit pages with centered keys (mode bits 1 and 2).
wkv::Engine &engine(uint8_t mode) {
  auto open = [](uint32_t page_format) {
    wkv_config c = wkvtest::fuzz_config();
    c.page_format = page_format;
    std::shared_ptr<wkv::Engine> out;
    if (!wkv::Engine::open(&c, &out).is_ok()) __builtin_trap();
    return out;
  };
  static std::shared_ptr<wkv::Engine> storage = open(WKV_PAGE_FORMAT_STORAGE), eight = open(WKV_PAGE_FORMAT_INT8),
                                      centered = open(WKV_PAGE_FORMAT_INT8_CENTERED);
  if (!(mode & 2)) return *storage;
  return (mode & 4) ? *centered : *eight;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  std::vector<uint8_t> file(data + 1, data + size);
  if (data[0] & 1) wkvtest::repair_checksums(file);
  MemoryIO io(file);
  wkv::SeqFileReader reader(io, MemoryIO::kFd);
  if (!reader.read_header().is_ok() || !reader.read_sections().is_ok()) return 0;
  const wkv::Config cfg = reader.header().config();
  wkv::LayerSnapshot snap;
  for (uint32_t l = 0; l < reader.header().n_layers(); ++l)
    if (reader.read_layer(l, &snap).is_ok()) (void)wkv::check_snapshot(cfg, snap);
  std::shared_ptr<wkv::Sequence> seq;
  wkv::Engine &e = engine(data[0]);
  if (wkv::check_file_shape(reader.header(), e.config()).is_ok()) (void)e.load(io, MemoryIO::kFd, &seq);
  return 0;
}
