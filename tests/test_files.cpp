// Sequence files: a sequence saved and loaded decodes bit for bit as before
// and keeps growing the same way; a file of another shape or a newer format
// is refused saying why; every flipped bit, truncation and torn write is
// found at load and named, nothing half-loaded stays, and the engine keeps
// working; a save that fails leaves the previous file whole; files are
// created 0600; saving one sequence does not stop another from decoding.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "files_checks.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"

using namespace wkvtest;

namespace {

// A saved sequence and the outputs it decodes to.
struct Saved {
  Shape shape;
  wavekv::Engine engine;
  std::vector<uint8_t> q, out;
  std::string path;
  Saved(const Shape &s, const std::string &file) : shape(s), engine(file_config(s)), path(file) {
    Context ctx(s);
    wavekv::Sequence seq(engine);
    fill(seq, s, ctx);
    q = ctx.query();
    out = decode_all(engine, seq.get(), s, q);
    seq.save(path);
  }
};

wkv_stats stats(const wavekv::Engine &e) { return e.stats(); }

// Loads a file expecting `code`; on success checks nothing else.
int load_code(const wavekv::Engine &e, const std::string &path, std::string *msg = nullptr) {
  wkv_seq *s = reinterpret_cast<wkv_seq *>(1);
  const int rc = wkv_seq_load(e.get(), path.c_str(), &s);
  if (msg) *msg = wkv_last_error();
  if (rc != WKV_OK) {
    EXPECT_EQ(s, nullptr) << "a failed load hands out no sequence";
  }
  wkv_seq_destroy(s);
  return rc;
}

}  // namespace

TEST(SeqFile, RoundTripDecodesBitForBitAndGrowsTheSameWay) {
  ScratchDir dir;
  const Shape shapes[] = {{2, 4, 2, 64, WKV_DTYPE_F32}, {2, 4, 2, 64, WKV_DTYPE_F16}, {2, 4, 2, 64, WKV_DTYPE_BF16},
                          {3, 8, 1, 128, WKV_DTYPE_F16}, {1, 6, 3, 80, WKV_DTYPE_BF16}};
  for (const Shape &s : shapes) {
    SCOPED_TRACE(testing::Message() << s.layers << " layers, " << s.kv_heads << " kv heads, d=" << s.head_dim
                                    << ", dtype " << s.dtype);
    wavekv::Engine a(file_config(s)), b(file_config(s));
    Context ctx(s);
    wavekv::Sequence sa(a);
    fill(sa, s, ctx);
    const std::string path = dir.file("seq.wkv");
    sa.save(path);
    wavekv::Sequence sb = wavekv::Sequence::load(b, path);
    for (uint32_t l = 0; l < s.layers; ++l) {
      const wkv_seq_info ia = sa.info(l), ib = sb.info(l);
      EXPECT_EQ(std::memcmp(&ia, &ib, sizeof ia), 0) << "layer " << l;
    }
    EXPECT_EQ(stats(b).tokens, stats(a).tokens);
    EXPECT_EQ(stats(b).clusters, stats(a).clusters);
    expect_same_decodes(b, sb, a, sa, s, ctx, 3);
    EXPECT_EQ(sb.info(0).segments, sa.info(0).segments);
  }
}

TEST(SeqFile, AnEmptySequenceAndASequenceOfSinkTokensRoundTrip) {
  ScratchDir dir;
  const Shape s;
  wavekv::Engine e(file_config(s));
  wavekv::Sequence empty(e);
  empty.save(dir.file("empty.wkv"));
  wavekv::Sequence back = wavekv::Sequence::load(e, dir.file("empty.wkv"));
  EXPECT_EQ(back.info(1).tokens, 0u);
  Context ctx(s);
  std::vector<uint8_t> k, v;
  ctx.tokens(3, &k, &v);
  back.append(1, k.data(), v.data(), 3);
  back.save(dir.file("sink.wkv"));
  wavekv::Sequence sink = wavekv::Sequence::load(e, dir.file("sink.wkv"));
  EXPECT_EQ(sink.info(1).sink, 3u);
  EXPECT_EQ(sink.info(0).tokens, 0u);
}

TEST(SeqFile, DescriptorFormsWriteFromTheStartTruncateAndLeaveThePosition) {
  ScratchDir dir;
  const Shape s;
  Saved saved(s, dir.file("seq.wkv"));
  wavekv::Sequence seq = wavekv::Sequence::load(saved.engine, saved.path);
  const std::string path = dir.file("fd.wkv");
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  const std::vector<uint8_t> junk(read_bytes(saved.path).size() + 5000, 0x5a);  // longer than the file
  ASSERT_EQ(::write(fd, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  ASSERT_EQ(::lseek(fd, 123, SEEK_SET), 123);
  ASSERT_EQ(wkv_seq_save_fd(seq.get(), fd, WKV_SAVE_NO_FSYNC), WKV_OK) << wkv_last_error();
  EXPECT_EQ(::lseek(fd, 0, SEEK_CUR), 123) << "the file position is not moved";
  EXPECT_EQ(read_bytes(path).size(), read_bytes(saved.path).size()) << "truncated to the file's length";
  wkv_seq *back = nullptr;
  ASSERT_EQ(wkv_seq_load_fd(saved.engine.get(), fd, &back), WKV_OK) << wkv_last_error();
  wavekv::Sequence owned = wavekv::Sequence::adopt(back);
  EXPECT_EQ(::lseek(fd, 0, SEEK_CUR), 123);
  EXPECT_EQ(decode_all(saved.engine, owned.get(), s, saved.q), saved.out);
  ::close(fd);
  // A pipe has no offsets: refused as an I/O error, not read as a file.
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  EXPECT_EQ(wkv_seq_load_fd(saved.engine.get(), p[0], &back), WKV_ERR_IO);
  EXPECT_EQ(back, nullptr);
  EXPECT_EQ(wkv_seq_save_fd(seq.get(), p[1], 0), WKV_ERR_IO);
  ::close(p[0]);
  ::close(p[1]);
  EXPECT_EQ(wkv_seq_load_fd(saved.engine.get(), -1, &back), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_seq_save_fd(seq.get(), -1, 0), WKV_ERR_INVALID_ARGUMENT);
}

TEST(SeqFile, ArgumentsAreChecked) {
  ScratchDir dir;
  const Shape s;
  wavekv::Engine e(file_config(s));
  wavekv::Sequence seq(e);
  wkv_seq *out = reinterpret_cast<wkv_seq *>(1);
  EXPECT_EQ(wkv_seq_save(seq.get(), nullptr, 0), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_seq_save(nullptr, dir.file("x").c_str(), 0), WKV_ERR_INVALID_HANDLE);
  EXPECT_EQ(wkv_seq_save(seq.get(), dir.file("x").c_str(), 0x80), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_seq_save(seq.get(), (dir.path() + "/").c_str(), 0), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_seq_load(e.get(), nullptr, &out), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(wkv_seq_load(nullptr, dir.file("x").c_str(), &out), WKV_ERR_INVALID_HANDLE);
  EXPECT_EQ(wkv_seq_load(e.get(), dir.file("x").c_str(), nullptr), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wkv_seq_load(e.get(), dir.file("missing").c_str(), &out), WKV_ERR_IO);
  EXPECT_NE(std::string(wkv_last_error()).find("No such file"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(wkv_seq_save(seq.get(), dir.file("no/such/dir/x").c_str(), 0), WKV_ERR_IO);
  EXPECT_TRUE(dir.names().empty());
}

TEST(SeqFile, AFileOfAnotherShapeIsRefusedSayingWhatDiffers) {
  ScratchDir dir;
  Saved saved(Shape{}, dir.file("seq.wkv"));
  Shape other;
  other.head_dim = 128;
  other.dtype = WKV_DTYPE_BF16;
  wavekv::Engine e(file_config(other));
  std::string msg;
  EXPECT_EQ(load_code(e, saved.path, &msg), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("file has head_dim 64, engine 128"), std::string::npos) << msg;
  EXPECT_NE(msg.find("file has dtype f16, engine bf16"), std::string::npos) << msg;
  wkv_config c = file_config(Shape{});
  c.window_tokens = 48;
  wavekv::Engine w(c);
  EXPECT_EQ(load_code(w, saved.path, &msg), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("window_tokens 32, engine 48"), std::string::npos) << msg;
  EXPECT_EQ(stats(w).sequences, 0u);
  // Fractions, cluster size, iterations and seed shape only what comes next.
  c = file_config(Shape{});
  c.retrieval_frac = 0.5f;
  c.estimation_frac = 0.1f;
  c.kmeans_iters = 3;
  c.seed = 42;
  wavekv::Engine f(c);
  wavekv::Sequence seq = wavekv::Sequence::load(f, saved.path);
  EXPECT_EQ(seq.info(0).tokens, 790u);
}

// The preamble: magic (8), version (4), the low 32 bits of XXH3-64 of both.
void set_version(std::vector<uint8_t> &b, uint32_t version) {
  for (int i = 0; i < 4; ++i) b[8 + i] = static_cast<uint8_t>(version >> (8 * i));
  const uint32_t check = static_cast<uint32_t>(XXH3_64bits(b.data(), 12));
  for (int i = 0; i < 4; ++i) b[12 + i] = static_cast<uint8_t>(check >> (8 * i));
}

TEST(SeqFile, ANewerFormatIsRefusedNamingBothVersions) {
  ScratchDir dir;
  Saved saved(Shape{}, dir.file("seq.wkv"));
  std::vector<uint8_t> b = read_bytes(saved.path);
  set_version(b, 7);
  write_bytes(dir.file("v7.wkv"), b);
  std::string msg;
  EXPECT_EQ(load_code(saved.engine, dir.file("v7.wkv"), &msg), WKV_ERR_UNSUPPORTED);
  EXPECT_NE(msg.find("format version 7, newer than this library's (2)"), std::string::npos) << msg;
  // Without its check, the same version field is a flipped bit.
  b[8] ^= 0x01;
  write_bytes(dir.file("flip.wkv"), b);
  EXPECT_EQ(load_code(saved.engine, dir.file("flip.wkv"), &msg), WKV_ERR_CORRUPT);
}

TEST(SeqFile, WhatIsNotASequenceFileIsRefused) {
  ScratchDir dir;
  wavekv::Engine e(file_config(Shape{}));
  std::string msg;
  for (size_t n : {0, 1, 15, 300, 70000}) {
    std::vector<uint8_t> b(n);
    uint64_t x = 0x9e3779b97f4a7c15ull * (n + 1);
    for (uint8_t &c : b) c = static_cast<uint8_t>((x = x * 6364136223846793005ull + 1) >> 56);
    write_bytes(dir.file("random"), b);
    EXPECT_EQ(load_code(e, dir.file("random"), &msg), WKV_ERR_CORRUPT) << n;
    EXPECT_NE(msg.find("not a wavekv sequence file"), std::string::npos) << msg;
  }
  EXPECT_EQ(stats(e).sequences, 0u);
}

// What is not a regular file is neither replaced nor read. A save renames a
// new file over its target, which would put a regular file in the place of
// a FIFO, a device or a directory: refused, nothing written. A load refuses
// them at once (the open of a FIFO without a writer used to block for
// good). A symbolic link is replaced itself, never followed: in a shared
// directory another user's link would send the file wherever it points.
// The statistics file (wkv_config.stats_path) is written the same way.
TEST(SeqFile, WhatIsNotARegularFileIsNeitherReplacedNorRead) {
  ScratchDir dir;
  const Shape s;
  Saved saved(s, dir.file("seq"));
  wkv_seq *seq = nullptr;
  ASSERT_EQ(wkv_seq_load(saved.engine.get(), saved.path.c_str(), &seq), WKV_OK) << wkv_last_error();
  const std::string fifo = dir.file("fifo"), sub = dir.file("sub");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(mkdir(sub.c_str(), 0700), 0);
  for (const std::string &p : {fifo, sub}) {
    EXPECT_EQ(wkv_seq_save(seq, p.c_str(), 0), WKV_ERR_INVALID_ARGUMENT) << p;
    EXPECT_NE(std::string(wkv_last_error()).find("not a regular file"), std::string::npos) << wkv_last_error();
    std::string msg;
    EXPECT_EQ(load_code(saved.engine, p, &msg), WKV_ERR_INVALID_ARGUMENT) << p;
    EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
  }
  struct stat st;
  ASSERT_EQ(lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(lstat(sub.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));

  // Links (to the saved file, to the FIFO, to nothing): each replaced by the
  // new file, what it pointed to untouched.
  const std::vector<uint8_t> before = read_bytes(saved.path);
  const std::string nowhere = dir.file("nowhere");
  const std::pair<std::string, std::string> links[] = {
      {dir.file("link"), saved.path}, {dir.file("to-fifo"), fifo}, {dir.file("dangling"), nowhere}};
  for (const auto &[link, to] : links) {
    ASSERT_EQ(symlink(to.c_str(), link.c_str()), 0);
    ASSERT_EQ(wkv_seq_save(seq, link.c_str(), 0), WKV_OK) << link << ": " << wkv_last_error();
    ASSERT_EQ(lstat(link.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode)) << link << ": the link is replaced by the file";
    EXPECT_EQ(load_code(saved.engine, link), WKV_OK) << link;
  }
  EXPECT_EQ(read_bytes(saved.path), before) << "the file a link pointed to is not written";
  ASSERT_EQ(lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_NE(access(nowhere.c_str(), F_OK), 0);
  wkv_seq_destroy(seq);

  wkv_config c = file_config(s);
  c.stats_path = fifo.c_str();
  wkv_engine *other = reinterpret_cast<wkv_engine *>(1);
  EXPECT_EQ(wkv_engine_open(&c, &other), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(wkv_last_error()).find("a FIFO"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(other, nullptr);
  ASSERT_EQ(lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_EQ(dir.names().size(), 6u) << "seq, fifo, sub and the three links' files: no temporary file stays";
}

// Every bit of the superblock, of each section header and of the trailer,
// and bits throughout each payload: found at load, the section named,
// nothing left behind, the engine still working.
TEST(SeqFileCorruption, EveryFlippedBitIsFoundAndNamed) {
  ScratchDir dir;
  const Shape s;
  Saved saved(s, dir.file("seq.wkv"));
  const std::vector<uint8_t> good = read_bytes(saved.path);
  const std::vector<wkv::SectionInfo> sections = sections_of(saved.path);
  ASSERT_EQ(sections.size(), s.layers * (1 + 4u * s.kv_heads));
  const wkv_stats before = stats(saved.engine);
  const std::string bad = dir.file("bad.wkv");
  auto expect_corrupt = [&](size_t byte, int bit, const std::string &name) {
    std::vector<uint8_t> b = good;
    b[byte] ^= static_cast<uint8_t>(1u << bit);
    write_bytes(bad, b);
    std::string msg;
    ASSERT_EQ(load_code(saved.engine, bad, &msg), WKV_ERR_CORRUPT) << "byte " << byte << " bit " << bit;
    EXPECT_NE(msg.find(name), std::string::npos) << "byte " << byte << ": " << msg;
  };
  for (size_t i = 0; i < wkv::seqfile::kSuperblockBytes; ++i)
    expect_corrupt(i, static_cast<int>(i % 8), i < 8 ? "not a wavekv sequence file" : "superblock");
  for (size_t n = 0; n < sections.size(); ++n) {
    const wkv::SectionInfo &sec = sections[n];
    const std::string name = wkv::section_name(n, sec);
    for (size_t i = 0; i < wkv::seqfile::kSectionHeaderBytes; ++i)
      expect_corrupt(sec.offset + i, static_cast<int>((i + n) % 8), name);
    const uint64_t payload = sec.offset + wkv::seqfile::kSectionHeaderBytes;
    const uint64_t stride = std::max<uint64_t>(1, sec.bytes / 37);
    for (uint64_t i = 0; i < sec.bytes; i += stride) expect_corrupt(payload + i, static_cast<int>(i % 8), name);
    if (sec.bytes) expect_corrupt(payload + sec.bytes - 1, 7, name);
  }
  for (size_t i = good.size() - wkv::seqfile::kTrailerBytes; i < good.size(); ++i)
    expect_corrupt(i, static_cast<int>(i % 8), "trailer");
  const wkv_stats after = stats(saved.engine);
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.clusters, before.clusters);
  wavekv::Sequence seq = wavekv::Sequence::load(saved.engine, saved.path);
  EXPECT_EQ(decode_all(saved.engine, seq.get(), s, saved.q), saved.out) << "the engine still works";
}

// Truncation at every section boundary, inside every header and payload,
// and anywhere in the superblock and the trailer.
TEST(SeqFileCorruption, EveryTruncationIsFoundAndNamed) {
  ScratchDir dir;
  const Shape s;
  Saved saved(s, dir.file("seq.wkv"));
  const std::vector<uint8_t> good = read_bytes(saved.path);
  const std::vector<wkv::SectionInfo> sections = sections_of(saved.path);
  const std::string bad = dir.file("cut.wkv");
  auto expect_cut = [&](size_t bytes, const std::string &name) {
    write_bytes(bad, std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(bytes)));
    std::string msg;
    ASSERT_EQ(load_code(saved.engine, bad, &msg), WKV_ERR_CORRUPT) << bytes << " bytes";
    EXPECT_NE(msg.find(name), std::string::npos) << bytes << " bytes: " << msg;
  };
  for (size_t n : {0, 8, 100, 255, 256, 280}) expect_cut(n, n < 16 ? "not a wavekv" : n < 256 + 32 ? "truncated" : "");
  for (size_t n = 0; n < sections.size(); ++n) {
    const wkv::SectionInfo &sec = sections[n];
    const std::string name = wkv::section_name(n, sec);
    const uint64_t payload = sec.offset + wkv::seqfile::kSectionHeaderBytes;
    if (sec.offset + wkv::seqfile::kTrailerBytes > good.size()) continue;
    for (uint64_t cut : {sec.offset, sec.offset + 20, payload, payload + sec.bytes / 2, payload + sec.bytes - 1}) {
      // The reader takes the last 32 bytes for the trailer: a cut is named
      // as the section those bytes fall in, the one it cuts when that
      // section goes on for 32 bytes more.
      if (cut + wkv::seqfile::kTrailerBytes > good.size() || cut < wkv::seqfile::kSuperblockBytes + 32) continue;
      expect_cut(cut, cut >= payload + 32 && cut < payload + sec.bytes ? name : "section ");
    }
    expect_cut(payload + sec.bytes, "");  // at the boundary after it
  }
  for (size_t n = good.size() - wkv::seqfile::kTrailerBytes; n < good.size(); ++n) expect_cut(n, "");
  EXPECT_EQ(stats(saved.engine).sequences, 0u);
}

TEST(SeqFileCorruption, AppendedBytesAndSwappedSectionsAreFound) {
  ScratchDir dir;
  Saved saved(Shape{}, dir.file("seq.wkv"));
  std::vector<uint8_t> b = read_bytes(saved.path);
  b.push_back(0);
  write_bytes(dir.file("long.wkv"), b);
  std::string msg;
  EXPECT_EQ(load_code(saved.engine, dir.file("long.wkv"), &msg), WKV_ERR_CORRUPT);
  // Two layers' payloads of the same size exchanged: each checksum holds,
  // each header names its place, but the order does not.
  const std::vector<wkv::SectionInfo> sec = sections_of(saved.path);
  b = read_bytes(saved.path);
  std::vector<uint8_t> swapped = b;
  const size_t first = 0, second = 1 + 4 * Shape{}.kv_heads;  // the two layer sections
  std::copy_n(b.begin() + static_cast<std::ptrdiff_t>(sec[first].offset), 48 + 24,
              swapped.begin() + static_cast<std::ptrdiff_t>(sec[second].offset));
  write_bytes(dir.file("swapped.wkv"), swapped);
  EXPECT_EQ(load_code(saved.engine, dir.file("swapped.wkv"), &msg), WKV_ERR_CORRUPT);
  EXPECT_NE(msg.find("section 9 (layer 1)"), std::string::npos) << msg;
}

TEST(SeqFileCrashSafety, FilesAreCreated0600AndNoTemporaryFileStays) {
  ScratchDir dir;
  Saved saved(Shape{}, dir.file("seq.wkv"));
  struct stat st;
  ASSERT_EQ(::stat(saved.path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(dir.names(), std::vector<std::string>{"seq.wkv"});
  // Replacing keeps 0600 whatever the old file's mode was.
  ASSERT_EQ(::chmod(saved.path.c_str(), 0644), 0);
  wavekv::Sequence seq = wavekv::Sequence::load(saved.engine, saved.path);
  seq.save(saved.path, WKV_SAVE_NO_FSYNC);
  ASSERT_EQ(::stat(saved.path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // A file name with what a shell would expand is just a name.
  const std::string odd = dir.file("~$HOME *;.wkv");
  seq.save(odd);
  EXPECT_EQ(read_bytes(odd).size(), read_bytes(saved.path).size());
}

// Faults of the I/O layer, through the internal API: each reported as its
// error, the old file whole, nothing half-loaded, the engine usable.
class SeqFileFaults : public testing::Test {
 protected:
  using Op = wkv::FaultyIO::Op;
  using Kind = wkv::FaultyIO::Kind;

  void SetUp() override {
    wkv_config c = file_config(shape);
    ASSERT_TRUE(wkv::Engine::open(&c, &e).is_ok());
    ASSERT_TRUE(wkv::Sequence::create(e, &seq).is_ok());
    Context ctx(shape);
    std::vector<uint8_t> k, v;
    ctx.tokens(600, &k, &v);
    for (uint32_t l = 0; l < shape.layers; ++l) {
      ASSERT_TRUE(e->append(*seq, l, k.data(), v.data(), 600, shape.kv_heads * shape.head_dim, shape.head_dim,
                            nullptr)
                      .is_ok());
      ASSERT_TRUE(e->end_prompt(*seq, l, nullptr).is_ok());
    }
    path = dir.file("seq.wkv");
    ASSERT_TRUE(e->save(*seq, e->io(), path, 0).is_ok());
    good = read_bytes(path);
  }

  // The file without its superblock, which holds the time of the save.
  static std::vector<uint8_t> sections_and_trailer(const std::vector<uint8_t> &b) {
    return std::vector<uint8_t>(b.begin() + wkv::seqfile::kSuperblockBytes, b.end());
  }

  wkv_stats engine_stats() {
    e->buffers().quiesce(5000);
    wkv_stats s;
    wkv_stats_init(&s);
    e->fill_stats(&s);
    return s;
  }

  // Runs a save with `f` injected on every call of its op up to the
  // number a clean save makes.
  void expect_failed_saves(Op op, Kind kind, int err, size_t bytes = 0) {
    wkv::FaultyIO io(e->io());
    ASSERT_TRUE(e->save(*seq, io, path, 0).is_ok());
    good = read_bytes(path);
    const uint64_t calls = io.calls(op);
    ASSERT_GT(calls, 0u);
    for (uint64_t n = 1; n <= calls; ++n) {
      SCOPED_TRACE(testing::Message() << "call " << n << " of " << calls);
      io.inject({op, kind, n, false, err, bytes});
      const wkv::Status st = e->save(*seq, io, path, 0);
      if (op == Op::kFsync && n == calls) {
        // The directory's fsync, after the rename: the new file is in
        // place, its durability unknown, and the caller told so.
        EXPECT_EQ(st.code(), WKV_ERR_IO);
        continue;
      }
      EXPECT_EQ(st.code(), WKV_ERR_IO) << st.message();
      EXPECT_NE(st.message().find(wkv::errno_text(err)), std::string::npos) << st.message();
      EXPECT_EQ(read_bytes(path), good) << "the previous file is whole";
      EXPECT_EQ(dir.names(), std::vector<std::string>{"seq.wkv"}) << "no temporary file stays";
    }
  }

  Shape shape{2, 4, 2, 64, WKV_DTYPE_F16};
  ScratchDir dir;
  std::shared_ptr<wkv::Engine> e;
  std::shared_ptr<wkv::Sequence> seq;
  std::string path;
  std::vector<uint8_t> good;
};

TEST_F(SeqFileFaults, WriteErrorsLeaveThePreviousFileWhole) {
  expect_failed_saves(Op::kWrite, Kind::kFail, EIO);
  expect_failed_saves(Op::kWrite, Kind::kFail, ENOSPC);
  expect_failed_saves(Op::kWrite, Kind::kTorn, EIO, 100);
  expect_failed_saves(Op::kFsync, Kind::kFail, EIO);
  expect_failed_saves(Op::kCreate, Kind::kFail, EACCES);
  expect_failed_saves(Op::kRename, Kind::kFail, EXDEV);
  expect_failed_saves(Op::kTruncate, Kind::kFail, EFBIG);
}

TEST_F(SeqFileFaults, ShortReadsAndWritesAreCompleted) {
  for (size_t bytes : {1, 7, 4096}) {
    wkv::FaultyIO io(e->io());
    io.inject({Op::kWrite, Kind::kShort, 1, true, 0, bytes});
    const std::string p = dir.file("short.wkv");
    ASSERT_TRUE(e->save(*seq, io, p, wkv::kSaveNoFsync).is_ok());
    EXPECT_GT(io.calls(Op::kWrite), good.size() / std::max<size_t>(bytes, 1) / 2) << "writes were cut short";
    EXPECT_EQ(sections_and_trailer(read_bytes(p)), sections_and_trailer(good));
    io.inject({Op::kRead, Kind::kShort, 1, true, 0, bytes});
    std::shared_ptr<wkv::Sequence> back;
    const wkv::Status st = e->load(io, p, &back);
    ASSERT_TRUE(st.is_ok()) << st.message();
    EXPECT_EQ(back->layer(1).tokens, 600u);
    ::unlink(p.c_str());
  }
}

TEST_F(SeqFileFaults, ReadErrorsLoadNothingAndTheEngineKeepsWorking) {
  const wkv_stats before = engine_stats();
  wkv::FaultyIO io(e->io());
  std::shared_ptr<wkv::Sequence> back;
  ASSERT_TRUE(e->load(io, path, &back).is_ok());
  back.reset();
  const uint64_t reads = io.calls(Op::kRead);
  for (int err : {EIO, EBADF}) {
    for (uint64_t n = 1; n <= reads; ++n) {
      io.inject({Op::kRead, Kind::kFail, n, false, err, 0});
      const wkv::Status st = e->load(io, path, &back);
      EXPECT_EQ(st.code(), WKV_ERR_IO) << "read " << n << ": " << st.message();
      EXPECT_EQ(back, nullptr);
    }
  }
  // An interrupted read is read again.
  io.inject({Op::kRead, Kind::kFail, reads / 2, false, EINTR, 0});
  ASSERT_TRUE(e->load(io, path, &back).is_ok());
  back.reset();
  io.inject({Op::kOpenRead, Kind::kFail, 1, false, EACCES, 0});
  EXPECT_EQ(e->load(io, path, &back).code(), WKV_ERR_IO);
  io.inject({Op::kSize, Kind::kFail, 1, false, EIO, 0});
  EXPECT_EQ(e->load(io, path, &back).code(), WKV_ERR_IO);
  const wkv_stats after = engine_stats();
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.pages_used, before.pages_used) << "every page of a failed load given back";
  io.clear();
  ASSERT_TRUE(e->load(io, path, &back).is_ok());
  EXPECT_EQ(back->layer(0).tokens, 600u);
}

// A save blocked in its writes holds no lock another sequence's decoding
// needs.
TEST_F(SeqFileFaults, SavingOneSequenceDoesNotStopAnotherFromDecoding) {
  std::shared_ptr<wkv::Sequence> other;
  ASSERT_TRUE(e->load(e->io(), path, &other).is_ok());
  std::mutex mu;
  std::condition_variable cv;
  bool saving = false, decoded = false;
  wkv::FaultyIO io(e->io());
  io.on_write = [&](uint64_t, size_t) {
    std::unique_lock<std::mutex> lock(mu);
    saving = true;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return decoded; });
  };
  std::thread saver([&] { EXPECT_TRUE(e->save(*seq, io, dir.file("blocked.wkv"), 0).is_ok()); });
  struct Release {  // the saver goes on whatever the checks below find
    std::mutex &mu;
    std::condition_variable &cv;
    bool &decoded;
    std::thread &saver;
    ~Release() {
      {
        std::lock_guard<std::mutex> lock(mu);
        decoded = true;
      }
      cv.notify_all();
      saver.join();
    }
  } release{mu, cv, decoded, saver};
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return saving; }));
  }
  // The save is inside a write: decode the other sequence, twice per layer.
  Context ctx(shape);
  const std::vector<uint8_t> q = ctx.query();
  std::shared_ptr<wkv::StepTracker> t;
  ASSERT_TRUE(e->buffers().new_tracker(&t).is_ok());
  wkv::Plan plan(e, t);
  std::vector<uint8_t> out(q.size());
  for (int i = 0; i < 2; ++i)
    for (uint32_t l = 0; l < shape.layers; ++l) {
      ASSERT_TRUE(e->lookup(plan, &other, 1, l, q.data(), 0, shape.head_dim, nullptr).is_ok());
      ASSERT_TRUE(e->assemble(plan, nullptr).is_ok());
      ASSERT_TRUE(e->attend(plan, out.data(), 0, shape.head_dim, nullptr, nullptr).is_ok());
    }
  {
    std::lock_guard<std::mutex> lock(mu);
    decoded = true;
  }
  cv.notify_all();
  saver.join();
  saver = std::thread([] {});  // joined again by release
  EXPECT_EQ(read_bytes(dir.file("blocked.wkv")).size(), good.size());
}

// The fuzz target's seeds (tests/fuzz/corpus/file_reader): a mode byte and
// a file of each kind, small enough to mutate fast. WKV_WRITE_FUZZ_SEEDS=1
// writes them anew (after a change of the format); then each is checked to
// load into the fuzz target's engine.
TEST(FuzzSeeds, LoadIntoTheFuzzTargetsEngine) {
  const std::string seeds = WKV_FUZZ_SEEDS;
  // The last two are of 8-bit pages (format 2; mode bit 1: the target's
  // engine of 8-bit pages).
  const char *const names[] = {"empty",      "sink",        "prompt", "generating", "generating-repair",
                               "int8-prompt", "int8-generating"};
  const Shape shape{1, 2, 1, 64, WKV_DTYPE_F16};
  wkv_config c8 = fuzz_config();
  c8.page_format = WKV_PAGE_FORMAT_INT8;
  wavekv::Engine storage(fuzz_config()), eight(c8);
  ScratchDir dir;
  if (std::getenv("WKV_WRITE_FUZZ_SEEDS")) {
    Context ctx(shape, 3);
    std::vector<uint8_t> k, v;
    const uint32_t tokens[] = {0, 3, 100, 100, 100, 100, 100};
    for (int i = 0; i < 7; ++i) {
      wavekv::Sequence seq(i >= 5 ? eight : storage);
      if (tokens[i]) {
        ctx.tokens(tokens[i], &k, &v);
        seq.append(0, k.data(), v.data(), tokens[i]);
      }
      if (i == 3 || i == 4 || i == 6) {
        seq.end_prompt(0);
        ctx.tokens(40, &k, &v);
        seq.append(0, k.data(), v.data(), 40);  // a generated segment, and a tail
      }
      seq.save(dir.file("seed"), WKV_SAVE_NO_FSYNC);
      std::vector<uint8_t> b = read_bytes(dir.file("seed"));
      b.insert(b.begin(), static_cast<uint8_t>((i == 4 ? 1 : 0) | (i >= 5 ? 2 : 0)));
      write_bytes(seeds + "/" + names[i], b);
    }
  }
  for (const char *name : names) {
    SCOPED_TRACE(name);
    const std::vector<uint8_t> b = read_bytes(seeds + "/" + name);
    ASSERT_GT(b.size(), 1u);
    EXPECT_LT(b.size(), 50u << 10) << "seeds stay small";
    write_bytes(dir.file("seed"), std::vector<uint8_t>(b.begin() + 1, b.end()));
    wavekv::Sequence seq = wavekv::Sequence::load(b[0] & 2 ? eight : storage, dir.file("seed"));
  }
}
