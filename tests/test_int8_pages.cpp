// 8-bit pages (WKV_PAGE_FORMAT_INT8): the row arithmetic, the page sizes,
// what the execution buffer then holds, files and the spill tier.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "files_checks.hpp"
#include "kernels/dtype.hpp"
#include "lib/common/config.hpp"

namespace {

using namespace wkvtest;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// A row through quantize_row and dequantize_row, in `dtype`.
std::vector<uint8_t> paged(uint32_t dtype, const uint8_t *row, uint32_t d) {
  const wkv::DType dt = static_cast<wkv::DType>(dtype);
  std::vector<float> f(d);
  std::vector<int8_t> q(d);
  float scale = 0;
  wkv::to_float(dt, row, f.data(), d);
  wkv::quantize_row(f.data(), d, q.data(), &scale);
  std::vector<uint8_t> out(size_t(d) * wkv::dtype_bytes(dt));
  EXPECT_TRUE(wkv::dequantize_row(dt, q.data(), scale, d, out.data()));
  return out;
}

TEST(Int8Rows, ScaleIsTheLargestMagnitudeOver127AndValuesRoundToNearestEven) {
  std::vector<float> x(16, 0.0f);
  x[0] = -127.0f;  // scale 1
  x[1] = 0.5f;
  x[2] = 1.5f;
  x[3] = 2.5f;
  x[4] = -63.5f;
  x[5] = 126.49f;
  std::vector<int8_t> q(16, 99);
  float s = 0;
  wkv::quantize_row(x.data(), 16, q.data(), &s);
  EXPECT_EQ(s, 1.0f);
  EXPECT_EQ(q[0], -127);
  EXPECT_EQ(q[1], 0);
  EXPECT_EQ(q[2], 2);
  EXPECT_EQ(q[3], 2);
  EXPECT_EQ(q[4], -64);
  EXPECT_EQ(q[5], 126);
  EXPECT_EQ(q[6], 0);
  // Back, rounded to each dtype.
  float back[16];
  ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kF32, q.data(), s, 16, back));
  EXPECT_EQ(back[0], -127.0f);
  EXPECT_EQ(back[4], -64.0f);
}

TEST(Int8Rows, ErrorIsAtMostHalfAStepBeforeTheDtypesRounding) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (int r = 0; r < 200; ++r) {
    std::vector<float> x(128);
    for (float &v : x) v = n(rng) * (r % 7 == 0 ? 1e-4f : 1.0f);
    std::vector<int8_t> q(128);
    float s = 0;
    wkv::quantize_row(x.data(), 128, q.data(), &s);
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    EXPECT_EQ(s, amax / 127.0f);
    std::vector<float> back(128);
    ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kF32, q.data(), s, 128, back.data()));
    for (int i = 0; i < 128; ++i) {
      EXPECT_LE(std::abs(int(q[i])), 127);
      EXPECT_LE(std::fabs(back[i] - x[i]), 0.5f * s * 1.0001f) << "row " << r << " element " << i;
    }
  }
}

TEST(Int8Rows, ZeroTinyAndNonFiniteRows) {
  std::vector<int8_t> q(64, 7);
  float s = -1;
  std::vector<float> zero(64, 0.0f);
  wkv::quantize_row(zero.data(), 64, q.data(), &s);
  EXPECT_EQ(s, 0.0f);
  for (int8_t v : q) EXPECT_EQ(v, 0);
  // Below kInt8RowFloor: all zero, so that nothing is subnormal.
  std::vector<float> tiny(64, 0x1p-110f);
  tiny[3] = -0x1p-101f;
  std::fill(q.begin(), q.end(), 7);
  wkv::quantize_row(tiny.data(), 64, q.data(), &s);
  EXPECT_EQ(s, 0.0f);
  for (int8_t v : q) EXPECT_EQ(v, 0);
  // A NaN or an infinity: a NaN scale, and the dtype's quiet NaN back.
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(64, 1.0f);
    x[10] = bad;
    wkv::quantize_row(x.data(), 64, q.data(), &s);
    EXPECT_EQ(bits_of(s), wkv::kInt8NanScale);
    uint16_t h[64];
    ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kF16, q.data(), s, 64, h));
    for (uint16_t v : h) EXPECT_EQ(v, 0x7e00u);
    ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kBF16, q.data(), s, 64, h));
    for (uint16_t v : h) EXPECT_EQ(v, 0x7fc0u);
    float f[64];
    ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kF32, q.data(), s, 64, f));
    for (float v : f) EXPECT_EQ(bits_of(v), wkv::kInt8NanScale);
  }
}

TEST(Int8Rows, DequantizationRoundsEachProductToNearestEven) {
  // Every value of q and scales down to where f16 results are subnormal:
  // the vector path (F16C where the CPU has it) against the scalar one.
  std::vector<int8_t> q(256);
  for (int i = 0; i < 256; ++i) q[i] = static_cast<int8_t>(i - 128 == -128 ? -127 : i - 128);
  for (float scale : {1.0f, 0.0078125f, 3.3e-3f, 1e-7f, 6.1e-8f / 127.0f * 3.0f, 511.7f, 0x1p-100f}) {
    uint16_t h[256], b[256];
    ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kF16, q.data(), scale, 256, h));
    ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kBF16, q.data(), scale, 256, b));
    for (int i = 0; i < 256; ++i) {
      const float x = static_cast<float>(q[i]) * scale;
      EXPECT_EQ(h[i], wkv::float_to_f16(x)) << "scale " << scale << ", q " << int(q[i]);
      EXPECT_EQ(b[i], wkv::float_to_bf16(x)) << "scale " << scale << ", q " << int(q[i]);
    }
  }
}

wkv::Config resolved(uint32_t d, uint32_t dtype, uint32_t page_format, uint32_t page_bytes = 2048) {
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = 1;
  c.n_q_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = d;
  c.dtype = dtype;
  c.page_format = page_format;
  c.page_bytes = page_bytes;
  wkv::Config out;
  const wkv::Status st = wkv::resolve_config(&c, &out);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return out;
}

// Centered keys (WKV_PAGE_FORMAT_INT8_CENTERED): the reference is the
// centroid rounded to f16 where it all fits f16, and a row is quantize_row
// of its difference from it, read back by one fused multiply-add.
TEST(Int8CenteredRows, TheReferenceIsTheCentroidInF16AndRowsComeBackAroundIt) {
  const uint32_t d = 128;
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> c(d), ref(d), x(d), r(d);
  for (uint32_t i = 0; i < d; ++i) c[i] = 6.f + 0.3f * g(rng);  // a large shared offset
  ASSERT_TRUE(wkv::centered_reference(c.data(), d, ref.data()));
  for (uint32_t i = 0; i < d; ++i) EXPECT_EQ(ref[i], wkv::f16_to_float(wkv::float_to_f16(c[i]))) << i;
  for (uint32_t i = 0; i < d; ++i) x[i] = c[i] + 0.2f * g(rng);
  // The bytes: quantize_row of the differences.
  std::vector<int8_t> q(d), q2(d);
  float s = 0, s2 = 0;
  wkv::quantize_row_centered(x.data(), ref.data(), d, q.data(), &s);
  for (uint32_t i = 0; i < d; ++i) r[i] = x[i] - ref[i];
  wkv::quantize_row(r.data(), d, q2.data(), &s2);
  EXPECT_EQ(q, q2);
  EXPECT_EQ(bits_of(s), bits_of(s2));
  // Back: fma(q, s, ref) in f32, then the dtype; within half a step of
  // the differences' scale, far closer than the plain row's.
  std::vector<float> back(d);
  ASSERT_TRUE(wkv::dequantize_row_centered(wkv::DType::kF32, q.data(), s, ref.data(), d, back.data()));
  std::vector<float> plain(d);
  std::vector<int8_t> qp(d);
  float sp = 0;
  wkv::quantize_row(x.data(), d, qp.data(), &sp);
  ASSERT_TRUE(wkv::dequantize_row(wkv::DType::kF32, qp.data(), sp, d, plain.data()));
  double err_c = 0, err_p = 0;
  for (uint32_t i = 0; i < d; ++i) {
    EXPECT_EQ(bits_of(back[i]), bits_of(std::fma(float(q[i]), s, ref[i]))) << i;
    EXPECT_LE(std::fabs(back[i] - x[i]), 0.5f * s * (1 + 1e-6f) + std::fabs(x[i]) * 0x1p-23f) << i;
    err_c += (back[i] - x[i]) * (back[i] - x[i]);
    err_p += (plain[i] - x[i]) * (plain[i] - x[i]);
  }
  EXPECT_LT(err_c * 10, err_p) << "a row less its centroid keeps far less of the 8-bit error";
  // In a 16-bit dtype: the f32 value rounded once more.
  std::vector<uint16_t> h(d);
  ASSERT_TRUE(wkv::dequantize_row_centered(wkv::DType::kBF16, q.data(), s, ref.data(), d, h.data()));
  for (uint32_t i = 0; i < d; ++i) EXPECT_EQ(h[i], wkv::float_to_bf16(back[i])) << i;
  // A NaN scale (a row with a NaN or an infinity) reads back as the dtype's NaN.
  x[3] = std::numeric_limits<float>::infinity();
  wkv::quantize_row_centered(x.data(), ref.data(), d, q.data(), &s);
  EXPECT_EQ(bits_of(s), wkv::kInt8NanScale);
  ASSERT_TRUE(wkv::dequantize_row_centered(wkv::DType::kF16, q.data(), s, ref.data(), d, h.data()));
  for (uint32_t i = 0; i < d; ++i) EXPECT_EQ(h[i], 0x7e00u) << i;
}

TEST(Int8CenteredRows, CentroidsOutsideF16sRangeOrNotFiniteHaveNoReference) {
  const uint32_t d = 64;
  std::vector<float> c(d, 1.f), ref(d);
  for (const float bad : {65520.f, -1e6f, std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()}) {
    c[17] = bad;
    EXPECT_FALSE(wkv::centered_reference(c.data(), d, ref.data())) << bad;
  }
  c[17] = 65504.f;  // f16's largest: fits
  ASSERT_TRUE(wkv::centered_reference(c.data(), d, ref.data()));
  // A finite row as large as a float gets no infinite difference: FLT_MAX
  // less a reference within f16's range rounds to FLT_MAX.
  std::vector<float> x(d, 0.f);
  x[17] = -std::numeric_limits<float>::max();
  std::vector<int8_t> q(d);
  float s = 0;
  wkv::quantize_row_centered(x.data(), ref.data(), d, q.data(), &s);
  EXPECT_TRUE(std::isfinite(s)) << s;
  std::vector<float> back(d);
  ASSERT_TRUE(wkv::dequantize_row_centered(wkv::DType::kF32, q.data(), s, ref.data(), d, back.data()));
  // (Read back, it may round past FLT_MAX, as a plain row's -127 x scale
  // may: an infinity of the right sign, never a NaN.)
  EXPECT_TRUE(back[17] < -1e38f) << back[17];
}

TEST(Int8Pages, SlotsHoldAboutTwiceTheTokensInOne4KiBBlock) {
  struct Want {
    uint32_t d, tokens, slot;
  } wants[] = {{64, 30, 4096}, {80, 24, 4096}, {96, 20, 4096}, {128, 15, 4096}, {256, 7, 4096}};
  for (const Want &w : wants) {
    SCOPED_TRACE(w.d);
    const wkv::Config c = resolved(w.d, WKV_DTYPE_BF16, WKV_PAGE_FORMAT_INT8);
    EXPECT_TRUE(c.int8_pages());
    EXPECT_EQ(c.page_tokens(), w.tokens);
    EXPECT_EQ(c.page_slot_bytes(), w.slot);
    EXPECT_EQ(c.page_row_bytes(), w.d);
    EXPECT_EQ(c.page_token_bytes(), w.d + 4);
    EXPECT_EQ(c.page_scales_at(), 2 * w.tokens * w.d);
    EXPECT_LE(c.page_scales_at() + 8 * c.page_tokens(), c.page_slot_bytes());
    EXPECT_EQ(c.row_bytes(), 2 * w.d);  // steady rows stay in the storage dtype
  }
  // Storage pages are what they were: 8 tokens at d = 128, f16.
  const wkv::Config f16 = resolved(128, WKV_DTYPE_F16, WKV_PAGE_FORMAT_STORAGE);
  EXPECT_EQ(f16.page_tokens(), 8u);
  EXPECT_EQ(f16.page_slot_bytes(), 4096u);
  EXPECT_EQ(f16.page_row_bytes(), 256u);
  // Small pages are not padded to a block: 1 token, 264 bytes, 320.
  const wkv::Config small = resolved(128, WKV_DTYPE_F16, WKV_PAGE_FORMAT_INT8, 256);
  EXPECT_EQ(small.page_tokens(), 1u);
  EXPECT_EQ(small.page_slot_bytes(), 320u);
}

// Two engines alike but for their pages, fed the same tokens.
struct Pair {
  Shape s;
  wkv_config cs, ci;
  wavekv::Engine storage, int8;
  wavekv::Sequence a, b;
  Context ctx;
  static wkv_config with_format(wkv_config c, uint32_t f) {
    c.page_format = f;
    return c;
  }
  explicit Pair(const Shape &shape)
      : s(shape),
        cs(file_config(shape)),
        ci(with_format(file_config(shape), WKV_PAGE_FORMAT_INT8)),
        storage(cs),
        int8(ci),
        a(storage),
        b(int8),
        ctx(shape) {
    std::vector<uint8_t> k, v;
    ctx.tokens(700, &k, &v);
    for (uint32_t l = 0; l < s.layers; ++l) {
      a.append(l, k.data(), v.data(), 700);
      b.append(l, k.data(), v.data(), 700);
      a.end_prompt(l);
      b.end_prompt(l);
    }
  }
};

TEST(Int8Pages, TheExecutionBufferHoldsThePagesRowsDequantizedAndTheSteadyRowsAsAppended) {
  for (uint32_t dtype : {WKV_DTYPE_F32, WKV_DTYPE_F16, WKV_DTYPE_BF16}) {
    SCOPED_TRACE(testing::Message() << "dtype " << dtype);
    const uint32_t d = 64;
    Pair p(Shape{1, 4, 2, d, dtype});
    const wkv_seq_info ia = p.a.info(0), ib = p.b.info(0);
    EXPECT_EQ(ib.clusters, ia.clusters) << "the k-means sees the rows as appended";
    EXPECT_EQ(ib.tail, ia.tail);
    EXPECT_LT(ib.pages, ia.pages) << "8-bit pages hold more tokens each";
    wavekv::Plan pa(p.storage), pb(p.int8);
    const std::vector<uint8_t> q = p.ctx.query();
    wkv_seq *sa = p.a.get(), *sb = p.b.get();
    pa.lookup(&sa, 1, 0, q.data());
    pb.lookup(&sb, 1, 0, q.data());
    pa.assemble();
    pb.assemble();
    const wkv_xbuf_view xa = pa.xbuf(), xb = pb.xbuf();
    ASSERT_EQ(xa.n_runs, xb.n_runs);
    for (uint32_t r = 0; r <= xa.n_runs; ++r) ASSERT_EQ(xa.offsets[r], xb.offsets[r]) << "run " << r;
    const size_t row = size_t(d) * wkv::dtype_bytes(static_cast<wkv::DType>(dtype));
    const uint64_t steady = ia.sink + ia.tail;
    uint64_t retrieved = 0;
    for (uint32_t r = 0; r < xa.n_runs; ++r)
      for (int32_t t = xa.offsets[r]; t < xa.offsets[r + 1]; ++t) {
        const uint8_t *ka = static_cast<const uint8_t *>(xa.k) + size_t(t) * row;
        const uint8_t *va = static_cast<const uint8_t *>(xa.v) + size_t(t) * row;
        const uint8_t *kb = static_cast<const uint8_t *>(xb.k) + size_t(t) * row;
        const uint8_t *vb = static_cast<const uint8_t *>(xb.v) + size_t(t) * row;
        if (uint64_t(t - xa.offsets[r]) < steady) {
          EXPECT_EQ(std::memcmp(ka, kb, row), 0) << "run " << r << ", steady row " << t;
          EXPECT_EQ(std::memcmp(va, vb, row), 0) << "run " << r << ", steady row " << t;
          continue;
        }
        ++retrieved;
        EXPECT_EQ(std::memcmp(paged(dtype, ka, d).data(), kb, row), 0) << "run " << r << ", K row " << t;
        EXPECT_EQ(std::memcmp(paged(dtype, va, d).data(), vb, row), 0) << "run " << r << ", V row " << t;
      }
    EXPECT_GT(retrieved, 0u);
    // Attention over them: close to the 16-bit pages' (rows within half a
    // step of 1/127 of their largest magnitude).
    const size_t n_out = size_t(p.s.q_heads) * d;
    std::vector<uint8_t> oa(q.size()), ob(q.size());
    pa.attend(oa.data());
    pb.attend(ob.data());
    pa.update();
    pb.update();
    const std::vector<float> fa = unpack(dtype, oa, n_out), fb = unpack(dtype, ob, n_out);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < n_out; ++i) {
      diff += (double(fa[i]) - fb[i]) * (double(fa[i]) - fb[i]);
      norm += double(fa[i]) * fa[i];
    }
    EXPECT_LT(std::sqrt(diff / norm), 0.05);
  }
}

int load_code(const wavekv::Engine &e, const std::string &path, std::string *msg) {
  wkv_seq *s = nullptr;
  const int rc = wkv_seq_load(e.get(), path.c_str(), &s);
  *msg = wkv_last_error();
  wkv_seq_destroy(s);
  return rc;
}

uint32_t get32(const std::vector<uint8_t> &b, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{b[at + i]} << (8 * i);
  return v;
}

TEST(Int8Pages, FilesRoundTripBitForBitRecordTheFormatAndLoadOnlyIntoTheirFormat) {
  ScratchDir dir;
  const Shape s{2, 4, 2, 64, WKV_DTYPE_BF16};
  wkv_config ci = file_config(s);
  ci.page_format = WKV_PAGE_FORMAT_INT8;
  wavekv::Engine a(ci), b(ci), plain(file_config(s));
  Context ctx(s);
  wavekv::Sequence sa(a);
  fill(sa, s, ctx);
  const std::string path = dir.file("int8.wkv");
  sa.save(path);
  std::vector<uint8_t> bytes = read_bytes(path);
  EXPECT_EQ(get32(bytes, 8), 2u) << "format 2: the oldest that holds 8-bit pages";
  EXPECT_EQ(get32(bytes, 148), uint32_t{WKV_PAGE_FORMAT_INT8});
  wavekv::Sequence sb = wavekv::Sequence::load(b, path);
  for (uint32_t l = 0; l < s.layers; ++l) {
    const wkv_seq_info ia = sa.info(l), ib = sb.info(l);
    EXPECT_EQ(std::memcmp(&ia, &ib, sizeof ia), 0) << "layer " << l;
  }
  expect_same_decodes(b, sb, a, sa, s, ctx, 3);
  // Saved again after the load: the same bytes but the time of saving.
  sb.save(dir.file("again.wkv"));
  sa.save(dir.file("first.wkv"));
  std::vector<uint8_t> x = read_bytes(dir.file("again.wkv")), y = read_bytes(dir.file("first.wkv"));
  ASSERT_EQ(x.size(), y.size());
  EXPECT_EQ(std::memcmp(x.data() + 256, y.data() + 256, x.size() - 256), 0) << "sections differ";

  std::string msg;
  EXPECT_EQ(load_code(plain, path, &msg), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("file has page format int8, engine storage"), std::string::npos) << msg;
  // A file of storage pages stays in format 1, and an 8-bit engine refuses it.
  wavekv::Sequence sp(plain);
  Context ctx2(s);
  fill(sp, s, ctx2);
  sp.save(dir.file("plain.wkv"));
  std::vector<uint8_t> pb = read_bytes(dir.file("plain.wkv"));
  EXPECT_EQ(get32(pb, 8), 1u);
  EXPECT_EQ(load_code(a, dir.file("plain.wkv"), &msg), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("file has page format storage, engine int8"), std::string::npos) << msg;
  // A page format in format 1's reserved bytes, or one unknown: corrupt.
  pb[148] = 1;
  repair_checksums(pb);
  write_bytes(dir.file("v1-int8.wkv"), pb);
  EXPECT_EQ(load_code(a, dir.file("v1-int8.wkv"), &msg), WKV_ERR_CORRUPT);
  EXPECT_NE(msg.find("reserved bytes are not zero"), std::string::npos) << msg;
  bytes[148] = 3;
  repair_checksums(bytes);
  write_bytes(dir.file("format2.wkv"), bytes);
  EXPECT_EQ(load_code(a, dir.file("format2.wkv"), &msg), WKV_ERR_CORRUPT);
  EXPECT_NE(msg.find("unknown page format"), std::string::npos) << msg;

  // Rows and scales no quantization writes, with right checksums: an
  // infinite or a subnormal scale, a value of -128, a zero scale over a
  // row that is not zero. Each is refused as corrupt.
  wkv::Config cfg;
  ASSERT_TRUE(wkv::resolve_config(&ci, &cfg).is_ok());
  const std::vector<wkv::SectionInfo> sections = sections_of(path);
  size_t pages_at = 0;
  for (const wkv::SectionInfo &sec : sections)
    if (sec.kind == wkv::seqfile::Kind::kPages && sec.bytes > 0) {
      pages_at = sec.offset + wkv::seqfile::kSectionHeaderBytes;
      break;
    }
  ASSERT_GT(pages_at, 0u);
  const size_t k_scale = pages_at + cfg.page_scales_at();  // the first page's first K scale
  struct Damage {
    const char *what;
    size_t at;
    std::vector<uint8_t> bytes;
  } damages[] = {
      {"an infinite scale", k_scale, {0x00, 0x00, 0x80, 0x7f}},
      {"a subnormal scale", k_scale, {0x01, 0x00, 0x00, 0x00}},
      {"a negative scale", k_scale + 4, {0x00, 0x00, 0x80, 0xbf}},
      {"a value of -128", pages_at + 5, {0x80}},
      {"a zero scale over a row", k_scale, {0x00, 0x00, 0x00, 0x00}},
  };
  for (const Damage &dm : damages) {
    SCOPED_TRACE(dm.what);
    std::vector<uint8_t> b = read_bytes(path);
    std::copy(dm.bytes.begin(), dm.bytes.end(), b.begin() + static_cast<std::ptrdiff_t>(dm.at));
    repair_checksums(b);
    write_bytes(dir.file("damaged.wkv"), b);
    EXPECT_EQ(load_code(a, dir.file("damaged.wkv"), &msg), WKV_ERR_CORRUPT);
    EXPECT_NE(msg.find("is none that quantization writes"), std::string::npos) << msg;
  }
}

// A file carries no bytes of another sequence: the unused rows of a
// segment's last page, their scales and the slot's padding are zero even
// where the slots held a longer sequence before.
TEST(Int8Pages, AFileZeroesTheUnusedRowsTheirScalesAndThePadding) {
  ScratchDir dir;
  const Shape s{1, 4, 2, 64, WKV_DTYPE_F16};
  wkv_config c = file_config(s);
  c.page_format = WKV_PAGE_FORMAT_INT8;
  wavekv::Engine e(c);
  Context ctx(s);
  std::vector<uint8_t> k, v;
  {
    wavekv::Sequence before(e);  // fills slots, then gives them back
    ctx.tokens(2000, &k, &v);
    before.append(0, k.data(), v.data(), 2000);
    before.end_prompt(0);
  }
  wavekv::Sequence seq(e);
  ctx.tokens(301, &k, &v);
  seq.append(0, k.data(), v.data(), 301);
  seq.end_prompt(0);
  ctx.tokens(77, &k, &v);
  seq.append(0, k.data(), v.data(), 77);
  const std::string path = dir.file("seq.wkv");
  seq.save(path);
  const wkv::LayerSnapshot snap = layer_of(path, 0);
  ASSERT_EQ(snap.heads.size(), 2u);
  wkv::Config cfg;
  ASSERT_TRUE(wkv::resolve_config(&c, &cfg).is_ok());
  const uint32_t pt = cfg.page_tokens(), slot = cfg.page_slot_bytes(), sc = cfg.page_scales_at(), d = 64;
  auto zero = [](const uint8_t *p, size_t n) { return std::all_of(p, p + n, [](uint8_t b) { return b == 0; }); };
  uint64_t checked = 0;
  for (const wkv::HeadSnapshot &h : snap.heads)
    for (const wkv::SegmentDesc &g : h.segments) {
      const uint32_t used = g.tokens - (g.pages - 1) * pt;
      for (uint32_t p = g.page_begin; p < g.page_begin + g.pages; ++p) {
        const uint8_t *page = h.pages.data() + size_t(p) * slot;
        EXPECT_TRUE(zero(page + sc + 8 * pt, slot - sc - 8 * pt)) << "padding of page " << p;
        if (p + 1 < g.page_begin + g.pages || used == pt) continue;
        ++checked;
        EXPECT_TRUE(zero(page + used * d, (pt - used) * d)) << "K rows of page " << p;
        EXPECT_TRUE(zero(page + (pt + used) * d, (pt - used) * d)) << "V rows of page " << p;
        EXPECT_TRUE(zero(page + sc + used * 4, (pt - used) * 4)) << "K scales of page " << p;
        EXPECT_TRUE(zero(page + sc + (pt + used) * 4, (pt - used) * 4)) << "V scales of page " << p;
        EXPECT_FALSE(zero(page + sc + (used - 1) * 4, 4)) << "the last used token keeps its scale";
      }
    }
  EXPECT_GT(checked, 0u);
}

TEST(Int8Pages, AnEvictedSequenceComesBackBitForBit) {
  ScratchDir dir;
  const Shape s{2, 4, 2, 64, WKV_DTYPE_F16};
  wkv_config c = file_config(s);
  c.page_format = WKV_PAGE_FORMAT_INT8;
  c.spill_dir = dir.path().c_str();
  wavekv::Engine e(c), twin(c);
  Context ctx(s), ctx_twin(s);
  wavekv::Sequence seq(e), other(twin);
  fill(seq, s, ctx);
  fill(other, s, ctx_twin);
  seq.evict();
  EXPECT_EQ(seq.info(0).evicted, 1u);
  EXPECT_GT(seq.info(0).spilled_pages, 0u);
  seq.restore();
  EXPECT_EQ(seq.info(0).evicted, 0u);
  for (int step = 0; step < 2; ++step) {
    const std::vector<uint8_t> q = ctx.query();
    ctx_twin.query();
    EXPECT_EQ(decode_all(e, seq.get(), s, q), decode_all(twin, other.get(), s, q)) << "step " << step;
  }
}

// Three engines alike but for their pages (16-bit, 8-bit, 8-bit centered),
// fed the same tokens, whose keys share a large offset, as real models'
// keys do. With every cluster retrieved, the centered engine's execution
// buffer holds the 16-bit engine's rows (same clusters, same order) within
// the 8-bit steps of their differences from the centroids, V rows as the
// 8-bit engine's, and its attention is closer to the 16-bit engine's than
// the plain 8-bit engine's is.
TEST(Int8CenteredPages, KeysComeBackAroundTheirCentroidsCloserThanPlain8BitRows) {
  for (uint32_t dtype : {WKV_DTYPE_F32, WKV_DTYPE_BF16}) {
    SCOPED_TRACE(testing::Message() << "dtype " << dtype);
    const uint32_t d = 64;
    const Shape s{1, 4, 2, d, dtype};
    wkv_config c = file_config(s);
    c.retrieval_frac = 1.0f;
    c.estimation_frac = 0.0f;
    wkv_config c8 = c, cc = c;
    c8.page_format = WKV_PAGE_FORMAT_INT8;
    cc.page_format = WKV_PAGE_FORMAT_INT8_CENTERED;
    wavekv::Engine e16(c), e8(c8), ec(cc);
    wavekv::Sequence a(e16), b(e8), z(ec);
    Context ctx(s);
    std::vector<uint8_t> k, v;
    ctx.tokens(700, &k, &v);
    // The offset: +3 on every key element, rounded to the dtype once here,
    // so that all three engines get the same bytes.
    const wkv::DType dt = static_cast<wkv::DType>(dtype);
    std::vector<float> kf(k.size() / wkv::dtype_bytes(dt));
    wkv::to_float(dt, k.data(), kf.data(), kf.size());
    for (float &x : kf) x += 3.0f;
    wkv::from_float(dt, kf.data(), k.data(), kf.size());
    for (wavekv::Sequence *q : {&a, &b, &z}) {
      q->append(0, k.data(), v.data(), 700);
      q->end_prompt(0);
    }
    EXPECT_EQ(z.info(0).clusters, a.info(0).clusters);
    EXPECT_EQ(z.info(0).pages, b.info(0).pages) << "the same bytes a token as 8-bit pages";
    wavekv::Plan pa(e16), pb(e8), pz(ec);
    const std::vector<uint8_t> q = ctx.query();
    wkv_seq *sa = a.get(), *sb = b.get(), *sz = z.get();
    pa.lookup(&sa, 1, 0, q.data());
    pb.lookup(&sb, 1, 0, q.data());
    pz.lookup(&sz, 1, 0, q.data());
    pa.assemble();
    pb.assemble();
    pz.assemble();
    const wkv_xbuf_view xa = pa.xbuf(), xb = pb.xbuf(), xz = pz.xbuf();
    ASSERT_EQ(xa.n_runs, xz.n_runs);
    const size_t row = size_t(d) * wkv::dtype_bytes(dt);
    const uint64_t steady = a.info(0).sink + a.info(0).tail;
    uint64_t retrieved = 0;
    std::vector<float> fa(d), fz(d);
    for (uint32_t r = 0; r < xa.n_runs; ++r) {
      ASSERT_EQ(xa.offsets[r + 1], xz.offsets[r + 1]) << "run " << r;
      for (int32_t t = xa.offsets[r]; t < xa.offsets[r + 1]; ++t) {
        const uint8_t *ka = static_cast<const uint8_t *>(xa.k) + size_t(t) * row;
        const uint8_t *kz = static_cast<const uint8_t *>(xz.k) + size_t(t) * row;
        const uint8_t *vb = static_cast<const uint8_t *>(xb.v) + size_t(t) * row;
        const uint8_t *vz = static_cast<const uint8_t *>(xz.v) + size_t(t) * row;
        if (uint64_t(t - xa.offsets[r]) < steady) {
          EXPECT_EQ(std::memcmp(ka, kz, row), 0) << "run " << r << ", steady row " << t;
          continue;
        }
        ++retrieved;
        EXPECT_EQ(std::memcmp(vb, vz, row), 0) << "run " << r << ", V row " << t << ": V rows are plain";
        wkv::to_float(dt, ka, fa.data(), d);
        wkv::to_float(dt, kz, fz.data(), d);
        // Within a step of 1/127 of 2 |x| (a difference from a centroid of
        // the cluster's keys is at most about twice the key) and the dtype.
        float amax = 0;
        for (float x : fa) amax = std::max(amax, std::fabs(x));
        for (uint32_t i = 0; i < d; ++i)
          ASSERT_LE(std::fabs(fz[i] - fa[i]), amax / 127.f + std::fabs(fa[i]) * 0x1p-7f)
              << "run " << r << ", K row " << t << ", element " << i;
      }
    }
    EXPECT_GT(retrieved, 0u);
    const size_t n_out = size_t(s.q_heads) * d;
    std::vector<uint8_t> oa(q.size()), ob(q.size()), oz(q.size());
    pa.attend(oa.data());
    pb.attend(ob.data());
    pz.attend(oz.data());
    const std::vector<float> ga = unpack(dtype, oa, n_out), gb = unpack(dtype, ob, n_out),
                             gz = unpack(dtype, oz, n_out);
    double d8 = 0, dc = 0;
    for (size_t i = 0; i < n_out; ++i) {
      d8 += (double(gb[i]) - ga[i]) * (double(gb[i]) - ga[i]);
      dc += (double(gz[i]) - ga[i]) * (double(gz[i]) - ga[i]);
    }
    EXPECT_LT(dc, d8) << "centered keys are closer to 16-bit pages than plain 8-bit rows";
  }
}

// Files of centered pages: format 2 with page format 2, the same bytes after
// a load and a save, decodes alike, and only an engine of the same format
// loads them. Eviction and restore give the same bits.
TEST(Int8CenteredPages, FilesAndTheSpillTierKeepThemBitForBit) {
  ScratchDir dir;
  const Shape s{2, 4, 2, 64, WKV_DTYPE_BF16};
  wkv_config cc = file_config(s);
  cc.page_format = WKV_PAGE_FORMAT_INT8_CENTERED;
  cc.spill_dir = dir.path().c_str();
  wkv_config c8 = file_config(s);
  c8.page_format = WKV_PAGE_FORMAT_INT8;
  wavekv::Engine a(cc), b(cc), eight(c8);
  Context ctx(s);
  wavekv::Sequence sa(a);
  fill(sa, s, ctx);
  const std::string path = dir.file("centered.wkv");
  sa.save(path);
  const std::vector<uint8_t> bytes = read_bytes(path);
  EXPECT_EQ(get32(bytes, 8), 2u);
  EXPECT_EQ(get32(bytes, 148), uint32_t{WKV_PAGE_FORMAT_INT8_CENTERED});
  wavekv::Sequence sb = wavekv::Sequence::load(b, path);
  expect_same_decodes(b, sb, a, sa, s, ctx, 2);
  sb.save(dir.file("again.wkv"));
  sa.save(dir.file("first.wkv"));
  const std::vector<uint8_t> x = read_bytes(dir.file("again.wkv")), y = read_bytes(dir.file("first.wkv"));
  ASSERT_EQ(x.size(), y.size());
  EXPECT_EQ(std::memcmp(x.data() + 256, y.data() + 256, x.size() - 256), 0) << "sections differ";
  std::string msg;
  EXPECT_EQ(load_code(eight, path, &msg), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("file has page format int8-centered, engine int8"), std::string::npos) << msg;
  // Evicted and restored: the same decodes as the sequence loaded beside it.
  sa.evict();
  EXPECT_GT(sa.info(0).spilled_pages, 0u);
  sa.restore();
  expect_same_decodes(b, sb, a, sa, s, ctx, 2);
}

}  // namespace
