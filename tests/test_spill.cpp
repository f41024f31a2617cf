// The spill tier: the spill file on its own (both I/O paths, extents,
// budget, checksums, injected faults) and sequences evicted to it and
// restored through the C ABI (explicitly and by their next use), with what
// must never happen checked: wrong KV after a restore, a stale plan reading
// given-back pages, a failed eviction losing data.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "files_support.hpp"
#include "spill_support.hpp"
#include "lib/store/spill.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

// Pieces of odd sizes (a page slot of head_dim 80 is 3840 bytes), more
// bytes than the staging buffers hold at once.
std::vector<std::vector<uint8_t>> random_pieces(std::mt19937_64 &rng, size_t count, size_t piece) {
  std::vector<std::vector<uint8_t>> out(count, std::vector<uint8_t>(piece));
  for (auto &p : out)
    for (auto &b : p) b = static_cast<uint8_t>(rng());
  return out;
}

std::vector<wkv::SpillPiece> as_pieces(std::vector<std::vector<uint8_t>> &v) {
  std::vector<wkv::SpillPiece> out;
  for (auto &p : v) out.push_back(wkv::SpillPiece{p.data(), p.size()});
  return out;
}

// A spill file in dir, through io_uring where it works or pread/pwrite.
wkv::Status open_spill(const ScratchDir &dir, bool no_uring, std::unique_ptr<wkv::SpillFile> *out) {
  wkv::SpillFile::Options o;
  o.dir = dir.path();
  o.no_uring = no_uring;
  return wkv::SpillFile::open(o, out);
}

class SpillFileModes : public testing::TestWithParam<bool> {};

}  // namespace

// Extents round-trip on both I/O paths, checksummed; space is reused.
TEST_P(SpillFileModes, ExtentsRoundTripAndTheirSpaceIsReused) {
  ScratchDir dir;
  std::unique_ptr<wkv::SpillFile> f;
  ASSERT_TRUE(open_spill(dir, GetParam(), &f).is_ok());
  std::printf("spill io bits 0x%x\n", f->io_bits());
  if (GetParam()) {
    EXPECT_EQ(f->io_bits() & WKV_SPILL_IO_URING, 0u);
  }
  EXPECT_TRUE(dir.names().empty()) << "the spill file has no name";
  std::mt19937_64 rng(3);
  auto a = random_pieces(rng, 2900, 3840);  // ~10.6 MiB: more than the stages in flight
  auto b = random_pieces(rng, 7, 1000);
  wkv::SpillExtent ea, eb;
  auto pa = as_pieces(a), pb = as_pieces(b);
  ASSERT_TRUE(f->write(pa.data(), pa.size(), &ea).is_ok());
  ASSERT_TRUE(f->write(pb.data(), pb.size(), &eb).is_ok());
  EXPECT_EQ(ea.offset % wkv::kSpillBlock, 0u);
  EXPECT_EQ(ea.bytes, 2900u * 3840u);
  EXPECT_EQ(f->bytes_used(), ea.span + eb.span);
  auto a2 = random_pieces(rng, 2900, 3840), b2 = random_pieces(rng, 7, 1000);
  auto pa2 = as_pieces(a2), pb2 = as_pieces(b2);
  ASSERT_TRUE(f->read(eb, pb2.data(), pb2.size()).is_ok());
  ASSERT_TRUE(f->read(ea, pa2.data(), pa2.size()).is_ok());
  EXPECT_TRUE(a == a2);
  EXPECT_TRUE(b == b2);
  // Released space is found again: the file does not grow.
  const uint64_t len = f->file_bytes();
  f->release(ea);
  wkv::SpillExtent ec;
  ASSERT_TRUE(f->write(pa.data(), pa.size(), &ec).is_ok());
  EXPECT_EQ(ec.offset, ea.offset);
  EXPECT_EQ(f->file_bytes(), len);
  f->release(ec);
  f->release(eb);
  EXPECT_EQ(f->bytes_used(), 0u);
  EXPECT_EQ(f->bytes_written(), ea.span + eb.span + ec.span);
}

// A flipped bit is found: the read is an error, never data.
TEST_P(SpillFileModes, AFlippedBitFailsTheChecksum) {
  ScratchDir dir;
  std::unique_ptr<wkv::SpillFile> f;
  ASSERT_TRUE(open_spill(dir, GetParam(), &f).is_ok());
  std::mt19937_64 rng(4);
  auto a = random_pieces(rng, 300, 4096);
  auto pa = as_pieces(a);
  wkv::SpillExtent e;
  ASSERT_TRUE(f->write(pa.data(), pa.size(), &e).is_ok());
  flip_byte(f->fd(), e.offset + 777777);
  if (HasFatalFailure()) return;
  wkv::Status st = f->read(e, pa.data(), pa.size());
  EXPECT_EQ(st.code(), WKV_ERR_CORRUPT) << st.message();
  EXPECT_NE(st.message().find("checksum"), std::string::npos) << st.message();
}

// Pages written in runs and read back scattered (the cold tier's path):
// slots of 4 KiB at aligned addresses (read straight into them where
// io_uring is in use) and of 3840 bytes at unaligned ones (staged), more
// than a queue's worth at once; a flipped bit fails its own page only.
TEST_P(SpillFileModes, PagesWrittenInRunsReadBackScattered) {
  ScratchDir dir;
  std::unique_ptr<wkv::SpillFile> f;
  ASSERT_TRUE(open_spill(dir, GetParam(), &f).is_ok());
  std::mt19937_64 rng(9);
  for (const size_t bytes : {size_t(4096), size_t(3840)}) {
    SCOPED_TRACE(std::to_string(bytes) + "-byte pages");
    constexpr size_t n = 300;
    std::vector<uint8_t> src(n * bytes);
    for (uint8_t &b : src) b = static_cast<uint8_t>(rng());
    std::vector<const uint8_t *> items(n);
    for (size_t k = 0; k < n; ++k) items[k] = src.data() + k * bytes;
    std::vector<wkv::SpillExtent> ext(n);
    ASSERT_TRUE(f->write_many(items.data(), n, bytes, ext.data()).is_ok());
    // Destinations: aligned slots for whole blocks, odd offsets otherwise.
    const size_t pitch = bytes % 4096 == 0 ? bytes : bytes + 8;
    const size_t total = (n * pitch + 4096 + 4095) / 4096 * 4096;  // aligned_alloc wants whole alignments
    uint8_t *block = static_cast<uint8_t *>(std::aligned_alloc(4096, total));
    ASSERT_NE(block, nullptr);
    std::vector<uint8_t *> dst(n);
    std::vector<wkv::SpillExtent> order(n);
    for (size_t k = 0; k < n; ++k) {
      const size_t from = (k * 7) % n;  // scattered: not the file's order
      order[k] = ext[from];
      dst[k] = block + k * pitch + (bytes % 4096 == 0 ? 0 : 8);
    }
    flip_byte(f->fd(), ext[5].offset + 17);
    if (HasFatalFailure()) return;
    std::vector<wkv::Status> each(n);
    ASSERT_TRUE(f->read_many(order.data(), dst.data(), n, each.data()).is_ok());
    for (size_t k = 0; k < n; ++k) {
      const size_t from = (k * 7) % n;
      if (from == 5) {
        EXPECT_EQ(each[k].code(), WKV_ERR_CORRUPT) << each[k].message();
        continue;
      }
      ASSERT_TRUE(each[k].is_ok()) << "page " << from << ": " << each[k].message();
      ASSERT_EQ(0, std::memcmp(dst[k], items[from], bytes)) << "page " << from;
    }
    std::free(block);
    for (const wkv::SpillExtent &e : ext) f->release(e);
  }
}

// Several extents in one pass (an eviction's): heads of different page
// counts, one empty; they read back in one pass with every checksum; a
// flipped bit fails its own extent only; each extent is released alone.
TEST_P(SpillFileModes, ExtentsWrittenAndReadInOnePass) {
  ScratchDir dir;
  std::unique_ptr<wkv::SpillFile> f;
  ASSERT_TRUE(open_spill(dir, GetParam(), &f).is_ok());
  std::mt19937_64 rng(12);
  const size_t counts[] = {700, 0, 1, 333, 1200};  // pages of 3840 bytes per extent
  constexpr size_t n = 5;
  std::vector<std::vector<uint8_t>> data;
  std::vector<size_t> first;
  for (size_t c : counts) {
    first.push_back(data.size());
    auto more = random_pieces(rng, c, 3840);
    data.insert(data.end(), more.begin(), more.end());
  }
  first.push_back(data.size());
  auto pieces = as_pieces(data);
  std::vector<wkv::SpillExtent> ext(n);
  ASSERT_TRUE(f->write_extents(pieces.data(), first.data(), n, ext.data()).is_ok());
  EXPECT_EQ(ext[1].span, 0u) << "an empty extent holds nothing";
  for (size_t k = 0; k < n; ++k) EXPECT_EQ(ext[k].bytes, counts[k] * 3840);
  auto back = random_pieces(rng, data.size(), 3840);
  auto pb = as_pieces(back);
  std::vector<wkv::Status> each(n);
  ASSERT_TRUE(f->read_extents(ext.data(), pb.data(), first.data(), n, each.data()).is_ok());
  for (size_t k = 0; k < n; ++k) EXPECT_TRUE(each[k].is_ok()) << k << ": " << each[k].message();
  EXPECT_TRUE(back == data);
  flip_byte(f->fd(), ext[3].offset + 4097);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(f->read_extents(ext.data(), pb.data(), first.data(), n, each.data()).is_ok());
  for (size_t k = 0; k < n; ++k) EXPECT_EQ(each[k].code(), k == 3 ? WKV_ERR_CORRUPT : WKV_OK) << k;
  for (const wkv::SpillExtent &e : ext) f->release(e);
  EXPECT_EQ(f->bytes_used(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Io, SpillFileModes, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool> &p) { return p.param ? "Pread" : "Default"; });

TEST(SpillFile, TheBudgetIsHeldAndADirectoryThatCannotHoldItIsAnError) {
  ScratchDir dir;
  wkv::SpillFile::Options o;
  o.dir = dir.path();
  o.budget_bytes = 64 * 1024;
  std::unique_ptr<wkv::SpillFile> f;
  ASSERT_TRUE(wkv::SpillFile::open(o, &f).is_ok());
  std::vector<uint8_t> big(60 * 1024, 1), more(8 * 1024, 2);
  wkv::SpillPiece p1{big.data(), big.size()}, p2{more.data(), more.size()};
  wkv::SpillExtent e1, e2;
  ASSERT_TRUE(f->write(&p1, 1, &e1).is_ok());
  wkv::Status st = f->write(&p2, 1, &e2);
  EXPECT_EQ(st.code(), WKV_ERR_BUDGET) << st.message();
  EXPECT_EQ(f->bytes_used(), e1.span);
  f->release(e1);
  EXPECT_TRUE(f->write(&p2, 1, &e2).is_ok());

  o.dir = dir.file("missing/below");
  std::unique_ptr<wkv::SpillFile> g;
  st = wkv::SpillFile::open(o, &g);
  EXPECT_EQ(st.code(), WKV_ERR_IO);
  EXPECT_NE(st.message().find("missing/below"), std::string::npos) << st.message();
}

// Faults of the pread/pwrite path: each an error naming the system's
// words, nothing kept from a failed write; short transfers are completed.
TEST(SpillFile, InjectedFaultsAreReportedAndLoseNothing) {
  ScratchDir dir;
  wkv::FaultyIO io(wkv::posix_io());
  wkv::SpillFile::Options o;
  o.dir = dir.path();
  o.io = &io;
  std::unique_ptr<wkv::SpillFile> f;
  ASSERT_TRUE(wkv::SpillFile::open(o, &f).is_ok());
  EXPECT_EQ(f->io_bits() & WKV_SPILL_IO_URING, 0u);
  std::mt19937_64 rng(5);
  auto a = random_pieces(rng, 600, 4000);
  auto pa = as_pieces(a);
  using F = wkv::FaultyIO;
  struct Case {
    F::Fault fault;
    int code;
    const char *words;
  };
  const Case cases[] = {
      {{F::Op::kWrite, F::Kind::kFail, 2, false, EIO, 0}, WKV_ERR_IO, "Input/output error"},
      {{F::Op::kWrite, F::Kind::kFail, 1, false, ENOSPC, 0}, WKV_ERR_IO, "No space left"},
      {{F::Op::kWrite, F::Kind::kTorn, 1, false, EIO, 512}, WKV_ERR_IO, "Input/output error"},
      // Short transfers of whole blocks, as O_DIRECT's are.
      {{F::Op::kWrite, F::Kind::kShort, 1, true, 0, 3 * 4096}, WKV_OK, nullptr},
  };
  for (const Case &c : cases) {
    io.inject(c.fault);
    wkv::SpillExtent e;
    wkv::Status st = f->write(pa.data(), pa.size(), &e);
    EXPECT_EQ(st.code(), c.code) << st.message();
    if (c.words) {
      EXPECT_NE(st.message().find(c.words), std::string::npos) << st.message();
    }
    if (c.code != WKV_OK) {
      EXPECT_EQ(f->bytes_used(), 0u);
      continue;
    }
    io.clear();
    // Reads: an error, a short read completed, then the data.
    auto back = random_pieces(rng, 600, 4000);
    auto pb = as_pieces(back);
    io.inject({F::Op::kRead, F::Kind::kFail, 1, false, EIO, 0});
    st = f->read(e, pb.data(), pb.size());
    EXPECT_EQ(st.code(), WKV_ERR_IO) << st.message();
    io.inject({F::Op::kRead, F::Kind::kShort, 1, true, 0, 2 * 4096});
    st = f->read(e, pb.data(), pb.size());
    EXPECT_TRUE(st.is_ok()) << st.message();
    EXPECT_TRUE(back == a);
    f->release(e);
  }
  io.clear();
  // Several extents in one pass: a failed write keeps none of them; a
  // failed read fails the call.
  const size_t first[] = {0, 200, 200, 600};
  wkv::SpillExtent ext[3];
  io.inject({F::Op::kWrite, F::Kind::kFail, 2, false, EIO, 0});
  wkv::Status st = f->write_extents(pa.data(), first, 3, ext);
  EXPECT_EQ(st.code(), WKV_ERR_IO) << st.message();
  EXPECT_EQ(f->bytes_used(), 0u);
  io.clear();
  ASSERT_TRUE(f->write_extents(pa.data(), first, 3, ext).is_ok());
  auto back = random_pieces(rng, 600, 4000);
  auto pb = as_pieces(back);
  wkv::Status each[3];
  io.inject({F::Op::kRead, F::Kind::kFail, 3, false, EIO, 0});
  st = f->read_extents(ext, pb.data(), first, 3, each);
  EXPECT_EQ(st.code(), WKV_ERR_IO) << st.message();
  io.clear();
  ASSERT_TRUE(f->read_extents(ext, pb.data(), first, 3, each).is_ok());
  EXPECT_TRUE(back == a);
  for (const wkv::SpillExtent &e : ext) f->release(e);
  EXPECT_EQ(f->bytes_used(), 0u);
}

// Sequences ------------------------------------------------------------------

namespace {

wkv_config spill_config(const Shape &s, const std::string &dir, uint64_t budget = 0, uint32_t flags = 0) {
  wkv_config c = file_config(s);
  c.spill_dir = dir.c_str();
  c.spill_budget_bytes = budget;
  c.flags |= flags;
  return c;
}

wkv_stats stats_of(const wavekv::Engine &e) { return e.stats(); }

// What wkv_seq_info says of every layer: evicted (every page in the spill
// file) or in memory (none there, without cold pages).
void expect_evicted(const wavekv::Sequence &seq, const Shape &s, bool evicted) {
  for (uint32_t l = 0; l < s.layers; ++l) {
    const wkv_seq_info i = seq.info(l);
    EXPECT_GT(i.pages, 0u) << "layer " << l;
    EXPECT_EQ(i.evicted, evicted ? 1u : 0u) << "layer " << l;
    EXPECT_EQ(i.reserved, 0u) << "layer " << l;
    EXPECT_EQ(i.spilled_pages, evicted ? i.pages : 0u) << "layer " << l;
  }
}

}  // namespace

TEST(Evict, WithoutASpillDirectoryIsRefused) {
  const Shape s;
  wavekv::Engine e(file_config(s));
  wavekv::Sequence seq(e);
  Context ctx(s);
  fill(seq, s, ctx);
  EXPECT_EQ(wkv_seq_evict(seq.get()), WKV_ERR_STATE);
  EXPECT_NE(std::string(wkv_last_error()).find("spill_dir"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(wkv_seq_restore(seq.get()), WKV_OK);  // in memory: nothing to do
}

// Evicted, a sequence gives its pages back; its next use restores it, and
// it decodes bit for bit as before, on both I/O paths and with page slots
// that are not multiples of 4 KiB (head_dim 80).
TEST(Evict, ARestoredSequenceDecodesBitForBitAsBefore) {
  for (uint32_t flags : {0u, uint32_t(WKV_CONFIG_SPILL_NO_URING)})
    for (uint32_t d : {64u, 80u}) {
      SCOPED_TRACE(testing::Message() << "flags " << flags << " head_dim " << d);
      ScratchDir dir;
      Shape s;
      s.head_dim = d;
      wavekv::Engine e(spill_config(s, dir.path(), 0, flags));
      wavekv::Sequence seq(e), other(e);
      Context ctx(s), ctx2(s, 9);
      fill(seq, s, ctx);
      fill(other, s, ctx2);
      const std::vector<uint8_t> q = ctx.query();
      const std::vector<uint8_t> before = decode_all(e, seq.get(), s, q);
      const std::vector<uint8_t> other_before = decode_all(e, other.get(), s, q);
      const wkv_stats s0 = stats_of(e);
      EXPECT_NE(s0.spill_io, 0u);
      EXPECT_EQ(s0.spill_io & WKV_SPILL_IO_URING, flags ? 0u : s0.spill_io & WKV_SPILL_IO_URING);
      expect_evicted(seq, s, false);
      seq.evict();
      expect_evicted(seq, s, true);
      seq.evict();  // again: nothing to do
      expect_evicted(seq, s, true);
      expect_evicted(other, s, false);
      const wkv_stats s1 = stats_of(e);
      EXPECT_EQ(s1.evicted_sequences, 1u);
      EXPECT_GT(s1.spill_bytes_used, 0u);
      EXPECT_LT(s1.pages_used, s0.pages_used);
      EXPECT_GE(s1.spill_bytes_written, (s0.pages_used - s1.pages_used) * s0.page_bytes);
      // The other sequence is untouched.
      EXPECT_TRUE(decode_all(e, other.get(), s, q) == other_before);
      // The next lookup restores.
      EXPECT_TRUE(decode_all(e, seq.get(), s, q) == before);
      expect_evicted(seq, s, false);
      const wkv_stats s2 = stats_of(e);
      EXPECT_EQ(s2.evicted_sequences, 0u);
      EXPECT_EQ(s2.spill_bytes_used, 0u);
      EXPECT_EQ(s2.pages_used, s0.pages_used);
      EXPECT_EQ(s2.spill_bytes_read, s1.spill_bytes_used);
      // Explicitly, and then appends and saves of an evicted sequence.
      seq.evict();
      expect_evicted(seq, s, true);
      seq.restore();
      expect_evicted(seq, s, false);
      EXPECT_TRUE(decode_all(e, seq.get(), s, q) == before);
      seq.evict();
      seq.save(dir.file("saved.wkv"));
      EXPECT_EQ(stats_of(e).evicted_sequences, 0u);
      seq.evict();
      std::vector<uint8_t> k, v;
      ctx.tokens(1, &k, &v);
      seq.append(0, k.data(), v.data(), 1);
      EXPECT_EQ(stats_of(e).evicted_sequences, 0u);
      wavekv::Sequence loaded = wavekv::Sequence::load(e, dir.file("saved.wkv"));
      EXPECT_TRUE(decode_all(e, loaded.get(), s, q) == before);
    }
}

// A plan that looked a sequence up before its eviction must look it up
// again: its assemble is refused rather than reading pages given back.
TEST(Evict, APlanLookedUpBeforeTheEvictionMustLookUpAgain) {
  ScratchDir dir;
  const Shape s;
  wavekv::Engine e(spill_config(s, dir.path()));
  wavekv::Sequence seq(e);
  Context ctx(s);
  fill(seq, s, ctx);
  const std::vector<uint8_t> q = ctx.query();
  wavekv::Plan plan(e);
  wkv_seq *sp = seq.get();
  plan.lookup(&sp, 1, 0, q.data());
  seq.evict();
  EXPECT_EQ(wkv_assemble(plan.get(), nullptr), WKV_ERR_STATE);
  plan.lookup(&sp, 1, 0, q.data());  // restores
  plan.assemble();
  std::vector<uint8_t> out(q.size());
  plan.attend(out.data());
}

// Over budget: refused, and the sequence is as it was, in memory.
TEST(Evict, OverTheBudgetNothingIsLost) {
  ScratchDir dir;
  const Shape s;
  wavekv::Engine e(spill_config(s, dir.path(), 8192));
  wavekv::Sequence seq(e);
  Context ctx(s);
  fill(seq, s, ctx);
  const std::vector<uint8_t> q = ctx.query();
  const std::vector<uint8_t> before = decode_all(e, seq.get(), s, q);
  const wkv_stats s0 = stats_of(e);
  EXPECT_EQ(wkv_seq_evict(seq.get()), WKV_ERR_BUDGET);
  EXPECT_NE(std::string(wkv_last_error()).find("budget"), std::string::npos) << wkv_last_error();
  const wkv_stats s1 = stats_of(e);
  EXPECT_EQ(s1.evicted_sequences, 0u);
  EXPECT_EQ(s1.spill_bytes_used, 0u);
  EXPECT_EQ(s1.pages_used, s0.pages_used);
  expect_evicted(seq, s, false);
  EXPECT_TRUE(decode_all(e, seq.get(), s, q) == before);
}

// A flipped bit in the spill file: the restore is refused as corrupt, the
// sequence stays evicted (every use of it fails the same way), the other
// sequences decode, and destroying it gives its space back.
TEST(Evict, ACorruptExtentIsAnErrorForItsSequenceOnly) {
  ScratchDir dir;
  const Shape s;
  wavekv::Engine e(spill_config(s, dir.path()));
  wavekv::Sequence other(e);
  Context ctx(s), ctx2(s, 9);
  fill(other, s, ctx2);
  const std::vector<uint8_t> q = ctx.query();
  const std::vector<uint8_t> other_before = decode_all(e, other.get(), s, q);
  {
    wavekv::Sequence seq(e);
    fill(seq, s, ctx);
    seq.evict();
    const int fd = reopen_spill_file(dir.path());
    ASSERT_GE(fd, 0);
    flip_byte(fd, 4096 + 5);
    ::close(fd);
    if (HasFatalFailure()) return;
    EXPECT_EQ(wkv_seq_restore(seq.get()), WKV_ERR_CORRUPT);
    EXPECT_NE(std::string(wkv_last_error()).find("checksum"), std::string::npos) << wkv_last_error();
    expect_evicted(seq, s, true);  // it stays evicted
    wkv_seq *sp = seq.get();
    wavekv::Plan plan(e);
    std::vector<uint8_t> out(q.size());
    EXPECT_EQ(wkv_decode(plan.get(), &sp, 1, 0, q.data(), 0, 0, out.data(), 0, 0, nullptr), WKV_ERR_CORRUPT);
    EXPECT_EQ(stats_of(e).evicted_sequences, 1u);
    EXPECT_TRUE(decode_all(e, other.get(), s, q) == other_before);
  }
  const wkv_stats st = stats_of(e);
  EXPECT_EQ(st.evicted_sequences, 0u);
  EXPECT_EQ(st.spill_bytes_used, 0u);
  EXPECT_TRUE(decode_all(e, other.get(), s, q) == other_before);
}
