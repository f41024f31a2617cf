/*
 * The C ABI test: every function of wavekv.h, called from C and compiled as
 * C99, in phases (after RocksDB's db/c_test.c). Every return code is checked,
 * and with it wkv_last_error(): non-empty after a failure, "" after a success.
 *
 * Attention results are checked against an exact reference computed here in
 * double (softmax(q.k / sqrt(d)) v over every token of the layer), on engines
 * that retrieve every cluster (retrieval_frac 1, estimation_frac 0), where the
 * engine's answer must be exact up to f32 rounding.
 *
 * Exit status: 0 when every check passed, 1 at the first failure, with a line
 * naming the phase, the check and wkv_last_error(). A CUDA engine that this
 * build or machine cannot open is reported as skipped, never as passed.
 */
#define _POSIX_C_SOURCE 200809L /* getpid, fileno: the save/load phase's files */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/types.h>
#include <unistd.h>

#include "wavekv/wavekv.h"

/* What a program built against wavekv 0.1's header binds wkv_config_init to
 * (its struct ended after `seed`): the old symbol version. */
__asm__(".symver wkv_config_init_v0_1,wkv_config_init@WAVEKV_0.1");
#ifdef __cplusplus
extern "C"
#endif
void wkv_config_init_v0_1(wkv_config *cfg);

/* ... and wkv_stats_init of a program built against 0.3 (its struct ended
 * after evicted_sequences). */
__asm__(".symver wkv_stats_init_v0_3,wkv_stats_init@WAVEKV_0.3");
#ifdef __cplusplus
extern "C"
#endif
void wkv_stats_init_v0_3(wkv_stats *stats);

/* ... and of a program built against 0.4 or 0.5 (its struct ended after
 * spill_write_errors). */
__asm__(".symver wkv_stats_init_v0_4,wkv_stats_init@WAVEKV_0.4");
#ifdef __cplusplus
extern "C"
#endif
void wkv_stats_init_v0_4(wkv_stats *stats);

/* ... and of a program built against 0.6 (its struct ended after
 * cache_records_dropped). */
__asm__(".symver wkv_stats_init_v0_6,wkv_stats_init@WAVEKV_0.6");
#ifdef __cplusplus
extern "C"
#endif
void wkv_stats_init_v0_6(wkv_stats *stats);

/* ... and of a program built against 0.7 (its struct ended after
 * growth_waits). */
__asm__(".symver wkv_stats_init_v0_7,wkv_stats_init@WAVEKV_0.7");
#ifdef __cplusplus
extern "C"
#endif
void wkv_stats_init_v0_7(wkv_stats *stats);

/* ... and of a program built against 0.8 to 0.12 (its struct ended after
 * decode_graphs). */
__asm__(".symver wkv_stats_init_v0_8,wkv_stats_init@WAVEKV_0.8");
#ifdef __cplusplus
extern "C"
#endif
void wkv_stats_init_v0_8(wkv_stats *stats);

/* ... and wkv_seq_info_init of a program built against 0.1 to 0.5 (its
 * struct ended after pages). */
__asm__(".symver wkv_seq_info_init_v0_1,wkv_seq_info_init@WAVEKV_0.1");
#ifdef __cplusplus
extern "C"
#endif
void wkv_seq_info_init_v0_1(wkv_seq_info *info);

/* The model shape of every engine in this test. */
#define NL 2          /* layers */
#define NQ 4          /* query heads */
#define NKV 2         /* KV heads */
#define D 64          /* head_dim */
#define GRP (NQ / NKV) /* query heads per KV head */
#define CAP 700       /* tokens a reference sequence can hold per layer */

/* Checks ------------------------------------------------------------------ */

static const char *g_phase = "start";
static long g_checks = 0;
static int g_skipped = 0;

static void phase(const char *name) {
  g_phase = name;
  printf("phase: %s\n", name);
  fflush(stdout);
}

static void fail_at(int line, const char *what) {
  const char *msg = wkv_last_error();
  fprintf(stderr, "FAIL [phase %s] c_api_test.c:%d: %s (wkv_last_error: \"%s\")\n", g_phase, line,
          what, msg ? msg : "(null)");
  exit(1);
}

#define CHECK(cond, what)                        \
  do {                                           \
    if (!(cond)) fail_at(__LINE__, (what));      \
    g_checks++;                                  \
  } while (0)

/* Checks a status and the thread's message that goes with it. */
static void expect_rc(int rc, int want, const char *call, int line) {
  const char *msg = wkv_last_error();
  char what[512];
  if (rc != want) {
    snprintf(what, sizeof what, "%s returned %d (%s), expected %s", call, rc, wkv_status_name(rc),
             wkv_status_name(want));
    fail_at(line, what);
  }
  if (msg == NULL) {
    snprintf(what, sizeof what, "%s: wkv_last_error() returned NULL", call);
    fail_at(line, what);
  }
  if (want == WKV_OK && msg[0] != '\0') {
    snprintf(what, sizeof what, "%s succeeded but wkv_last_error() is not \"\"", call);
    fail_at(line, what);
  }
  if (want != WKV_OK && msg[0] == '\0') {
    snprintf(what, sizeof what, "%s failed with %s but wkv_last_error() is empty", call,
             wkv_status_name(want));
    fail_at(line, what);
  }
  g_checks++;
}

#define EXPECT_OK(call) expect_rc((call), WKV_OK, #call, __LINE__)
#define EXPECT_ERR(call, code) expect_rc((call), (code), #call, __LINE__)

/* Data ------------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

/* xorshift64*: a uniform float in [-1, 1). */
static float frand(void) {
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return (float)((double)((g_rng * 0x2545f4914f6cdd1dull) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* What the test appended to one sequence: k, v [CAP][NKV][D] per layer. */
typedef struct ref_seq {
  uint32_t len[NL];
  float k[NL][CAP * NKV * D];
  float v[NL][CAP * NKV * D];
} ref_seq;

static ref_seq *ref_new(void) {
  ref_seq *r = (ref_seq *)calloc(1, sizeof *r);
  if (!r) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return r;
}

/* Draws n new tokens at the end of a layer (not yet counted in len). */
static void ref_gen(ref_seq *r, uint32_t layer, uint32_t n) {
  size_t i, b = (size_t)r->len[layer] * NKV * D, e = b + (size_t)n * NKV * D;
  if (r->len[layer] + n > CAP) {
    fprintf(stderr, "reference sequence full\n");
    exit(1);
  }
  for (i = b; i < e; ++i) {
    r->k[layer][i] = frand();
    r->v[layer][i] = frand();
  }
}

static const float *ref_k(const ref_seq *r, uint32_t layer, uint32_t t, uint32_t h) {
  return &r->k[layer][((size_t)t * NKV + h) * D];
}
static const float *ref_v(const ref_seq *r, uint32_t layer, uint32_t t, uint32_t h) {
  return &r->v[layer][((size_t)t * NKV + h) * D];
}

/* Memory layouts of the k and v given to wkv_seq_append. */
enum layout {
  LAYOUT_PACKED,      /* [t][h][D], strides 0 */
  LAYOUT_INTERLEAVED, /* one buffer [t][h][2D]: k then v of each row */
  LAYOUT_HEAD_MAJOR,  /* [h][t][D]: token_stride D, head_stride n*D */
  LAYOUT_PADDED       /* [t][h][D + 8] + 16 per token, gaps NaN */
};

#define PAD_HEAD (D + 8)
#define PAD_TOKEN (NKV * PAD_HEAD + 16)

/* Appends tokens [t0, t0 + n) of the reference's layer to seq in a layout. */
static int append_from(wkv_seq *seq, const ref_seq *r, uint32_t layer, uint32_t t0, uint32_t n,
                       enum layout lay) {
  float *kb = NULL, *vb = NULL;
  const float *kp, *vp;
  int64_t ts = 0, hs = 0;
  size_t elems = 0;
  uint32_t t, h;
  int rc;
  switch (lay) {
    case LAYOUT_PACKED: elems = (size_t)n * NKV * D; break;
    case LAYOUT_INTERLEAVED: elems = (size_t)n * NKV * 2 * D; break;
    case LAYOUT_HEAD_MAJOR: elems = (size_t)n * NKV * D; break;
    case LAYOUT_PADDED: elems = (size_t)n * PAD_TOKEN; break;
  }
  kb = (float *)malloc(elems * sizeof(float));
  vb = (float *)malloc(elems * sizeof(float));
  if (!kb || !vb) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  for (t = 0; t < elems; ++t) kb[t] = vb[t] = (float)NAN; /* gaps must never be read */
  for (t = 0; t < n; ++t)
    for (h = 0; h < NKV; ++h) {
      size_t ko = 0, vo = 0;
      switch (lay) {
        case LAYOUT_PACKED: ko = vo = ((size_t)t * NKV + h) * D; break;
        case LAYOUT_INTERLEAVED: ko = vo = ((size_t)t * NKV + h) * 2 * D; vo += D; break;
        case LAYOUT_HEAD_MAJOR: ko = vo = ((size_t)h * n + t) * D; break;
        case LAYOUT_PADDED: ko = vo = (size_t)t * PAD_TOKEN + (size_t)h * PAD_HEAD; break;
      }
      /* The interleaved layout keeps k and v in one buffer (kb). */
      memcpy(kb + ko, ref_k(r, layer, t0 + t, h), D * sizeof(float));
      memcpy((lay == LAYOUT_INTERLEAVED ? kb : vb) + vo, ref_v(r, layer, t0 + t, h), D * sizeof(float));
    }
  kp = kb;
  vp = vb;
  switch (lay) {
    case LAYOUT_PACKED: ts = hs = 0; break;
    case LAYOUT_INTERLEAVED: ts = 2 * NKV * D; hs = 2 * D; vp = kb + D; break;
    case LAYOUT_HEAD_MAJOR: ts = D; hs = (int64_t)n * D; break;
    case LAYOUT_PADDED: ts = PAD_TOKEN; hs = PAD_HEAD; break;
  }
  rc = wkv_seq_append(seq, layer, kp, vp, n, ts, hs, NULL);
  free(kb);
  free(vb);
  return rc;
}

/* Appends fresh random tokens to one or two sequences holding the same data
 * (seq_b may be NULL), in chunks, checking the token count after each. */
static void append_chunks(wkv_seq *seq_a, enum layout lay_a, wkv_seq *seq_b, enum layout lay_b,
                          ref_seq *r, uint32_t layer, const uint32_t *chunks, uint32_t n_chunks) {
  uint32_t c;
  wkv_seq_info info;
  for (c = 0; c < n_chunks; ++c) {
    const uint32_t t0 = r->len[layer];
    ref_gen(r, layer, chunks[c]);
    EXPECT_OK(append_from(seq_a, r, layer, t0, chunks[c], lay_a));
    if (seq_b) EXPECT_OK(append_from(seq_b, r, layer, t0, chunks[c], lay_b));
    r->len[layer] += chunks[c];
    wkv_seq_info_init(&info);
    EXPECT_OK(wkv_seq_info_get(seq_a, layer, &info));
    CHECK(info.tokens == r->len[layer], "info.tokens counts every appended token");
  }
}

/* Reference attention ----------------------------------------------------- */

/* Exact attention of query heads q [NQ][D] over every token of a layer, in
 * double: out [NQ][D] and lse [NQ] (natural log of the softmax denominator of
 * scores scaled by 1/sqrt(D)). */
static void ref_attention(const ref_seq *r, uint32_t layer, const float *q, double *out, double *lse) {
  static double score[CAP];
  const uint32_t n = r->len[layer];
  const double scale = 1.0 / sqrt((double)D);
  uint32_t h, t, i;
  for (h = 0; h < NQ; ++h) {
    const uint32_t kvh = h / GRP;
    const float *qh = q + (size_t)h * D;
    double m = -INFINITY, sum = 0.0;
    double *o = out + (size_t)h * D;
    for (t = 0; t < n; ++t) {
      const float *k = ref_k(r, layer, t, kvh);
      double s = 0.0;
      for (i = 0; i < D; ++i) s += (double)qh[i] * k[i];
      score[t] = s * scale;
      if (score[t] > m) m = score[t];
    }
    for (i = 0; i < D; ++i) o[i] = 0.0;
    for (t = 0; t < n; ++t) {
      const float *v = ref_v(r, layer, t, kvh);
      const double w = exp(score[t] - m);
      sum += w;
      for (i = 0; i < D; ++i) o[i] += w * v[i];
    }
    for (i = 0; i < D; ++i) o[i] /= sum;
    lse[h] = m + log(sum);
  }
}

/* Relative L2 distance of got from want (n values). */
static double rel_l2(const float *got, const double *want, size_t n) {
  double num = 0.0, den = 0.0;
  size_t i;
  for (i = 0; i < n; ++i) {
    const double d = (double)got[i] - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  if (!(num == num)) return INFINITY; /* NaN in got */
  return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static double rel_l2_f(const float *got, const float *want, size_t n) {
  double num = 0.0, den = 0.0;
  size_t i;
  for (i = 0; i < n; ++i) {
    const double d = (double)got[i] - (double)want[i];
    num += d * d;
    den += (double)want[i] * want[i];
  }
  if (!(num == num)) return INFINITY;
  return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* A random query batch [n][NQ][D], scaled so that softmax is far from flat. */
static void random_q(float *q, uint32_t n_seqs) {
  size_t i;
  for (i = 0; i < (size_t)n_seqs * NQ * D; ++i) q[i] = 3.0f * frand();
}

/* Checks out [n_seqs][NQ][D] (packed) against the reference of each
 * sequence at a layer, within tol relative L2 over the whole batch. */
static void check_against_ref(const float *out, const float *q, const ref_seq *const *refs,
                              uint32_t n_seqs, uint32_t layer, double tol, const char *what) {
  static double want[8 * NQ * D], lse[NQ];
  char msg[256];
  uint32_t s;
  double err;
  for (s = 0; s < n_seqs; ++s)
    ref_attention(refs[s], layer, q + (size_t)s * NQ * D, want + (size_t)s * NQ * D, lse);
  err = rel_l2(out, want, (size_t)n_seqs * NQ * D);
  snprintf(msg, sizeof msg, "%s: relative L2 error %.3g vs the exact reference exceeds %.1g", what, err, tol);
  CHECK(err <= tol, msg);
}

/* The caller's own attention over an execution buffer (f32), in double:
 * out [n_seqs][NQ][D] and lse [n_seqs][NQ], from q packed [n_seqs][NQ][D]. */
static void xbuf_attention(const wkv_xbuf_view *xv, uint32_t n_seqs, const float *q, float *out,
                           float *lse) {
  const float *K = (const float *)xv->k, *V = (const float *)xv->v;
  const double scale = 1.0 / sqrt((double)D);
  double *score = (double *)malloc((xv->n_tokens + 1) * sizeof(double));
  double o[D];
  uint32_t s, h, i;
  int32_t t;
  if (!score) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  for (s = 0; s < n_seqs; ++s)
    for (h = 0; h < NQ; ++h) {
      const uint32_t run = s * NKV + h / GRP;
      const int32_t b = xv->offsets[run], e = xv->offsets[run + 1];
      const float *qh = q + ((size_t)s * NQ + h) * D;
      double m = -INFINITY, sum = 0.0;
      for (t = b; t < e; ++t) {
        double dot = 0.0;
        for (i = 0; i < D; ++i) dot += (double)qh[i] * K[(size_t)t * D + i];
        score[t - b] = dot * scale;
        if (score[t - b] > m) m = score[t - b];
      }
      for (i = 0; i < D; ++i) o[i] = 0.0;
      for (t = b; t < e; ++t) {
        const double w = exp(score[t - b] - m);
        sum += w;
        for (i = 0; i < D; ++i) o[i] += w * V[(size_t)t * D + i];
      }
      for (i = 0; i < D; ++i) out[((size_t)s * NQ + h) * D + i] = (float)(sum > 0.0 ? o[i] / sum : 0.0);
      lse[(size_t)s * NQ + h] = (float)(sum > 0.0 ? m + log(sum) : -INFINITY);
    }
  free(score);
}

/* Engines ----------------------------------------------------------------- */

/* The test's engine configuration: small, f32, CPU. */
static void base_config(wkv_config *c) {
  wkv_config_init(c);
  c->n_layers = NL;
  c->n_q_heads = NQ;
  c->n_kv_heads = NKV;
  c->head_dim = D;
  c->dtype = WKV_DTYPE_F32;
  c->segment_tokens = 256;
  c->update_segment_tokens = 64;
  c->cluster_tokens = 8;
  c->window_tokens = 16;
  c->sink_tokens = 4;
  c->threads = 2;
}

static void expect_open_fails(const wkv_config *c, int code, const char *what) {
  wkv_engine *e = NULL;
  int rc = wkv_engine_open(c, &e);
  char msg[256];
  snprintf(msg, sizeof msg, "wkv_engine_open (%s)", what);
  expect_rc(rc, code, msg, __LINE__);
  wkv_engine_close(e); /* NULL expected; harmless otherwise */
}

static void expect_info(const wkv_seq *s, uint32_t layer, uint64_t tokens, uint64_t sink, uint64_t tail,
                        uint64_t segments, uint32_t generating, const char *what) {
  wkv_seq_info in;
  char msg[256];
  wkv_seq_info_init(&in);
  EXPECT_OK(wkv_seq_info_get(s, layer, &in));
  snprintf(msg, sizeof msg,
           "%s: info {tokens %llu sink %llu tail %llu clustered %llu segments %llu generating %u}, "
           "expected {%llu %llu %llu %llu %llu %u}",
           what, (unsigned long long)in.tokens, (unsigned long long)in.sink, (unsigned long long)in.tail,
           (unsigned long long)in.clustered, (unsigned long long)in.segments, in.generating,
           (unsigned long long)tokens, (unsigned long long)sink, (unsigned long long)tail,
           (unsigned long long)(tokens - sink - tail), (unsigned long long)segments, generating);
  CHECK(in.size == sizeof in, msg);
  CHECK(in.tokens == tokens && in.sink == sink && in.tail == tail && in.segments == segments &&
            in.generating == generating,
        msg);
  CHECK(in.clustered + in.sink + in.tail == in.tokens, "clustered + sink + tail == tokens");
  CHECK(segments == 0 ? in.clusters == 0 && in.pages == 0 : in.clusters >= segments * NKV && in.pages > 0,
        "clusters and pages exist exactly when segments do");
}

/* Decodes n_seqs sequences at a layer with a fresh random q and checks the
 * result against the exact reference (full-retrieval engines only). */
static void decode_and_check(wkv_plan *p, wkv_seq *const *seqs, const ref_seq *const *refs, uint32_t n_seqs,
                             uint32_t layer, const char *what) {
  static float q[8 * NQ * D], out[8 * NQ * D];
  random_q(q, n_seqs);
  EXPECT_OK(wkv_decode(p, seqs, n_seqs, layer, q, 0, 0, out, 0, 0, NULL));
  check_against_ref(out, q, refs, n_seqs, layer, 1e-5, what);
}

/* Phases ------------------------------------------------------------------ */

static void test_versions(void) {
  static const char *const names[] = {
      "WKV_OK",           "WKV_ERR_INVALID_ARGUMENT", "WKV_ERR_INVALID_HANDLE", "WKV_ERR_OUT_OF_RANGE",
      "WKV_ERR_UNSUPPORTED", "WKV_ERR_BUDGET",        "WKV_ERR_OUT_OF_MEMORY",  "WKV_ERR_DEVICE",
      "WKV_ERR_IO",       "WKV_ERR_CORRUPT",          "WKV_ERR_STATE",          "WKV_ERR_INTERNAL",
      "WKV_ERR_NO_DEVICE"};
  static const int unknown[] = {13, -1, 1000, INT32_MIN};
  char want[32];
  int i;
  const int codes[] = {WKV_OK,         WKV_ERR_INVALID_ARGUMENT, WKV_ERR_INVALID_HANDLE,
                       WKV_ERR_OUT_OF_RANGE, WKV_ERR_UNSUPPORTED, WKV_ERR_BUDGET,
                       WKV_ERR_OUT_OF_MEMORY, WKV_ERR_DEVICE,     WKV_ERR_IO,
                       WKV_ERR_CORRUPT, WKV_ERR_STATE,           WKV_ERR_INTERNAL,
                       WKV_ERR_NO_DEVICE};
  phase("versions");
  CHECK(WKV_VERSION_NUMBER == WKV_VERSION_MAJOR * 10000 + WKV_VERSION_MINOR * 100 + WKV_VERSION_PATCH,
        "WKV_VERSION_NUMBER encodes the macros");
  CHECK(wkv_version() == WKV_VERSION_NUMBER, "wkv_version() == WKV_VERSION_NUMBER");
  snprintf(want, sizeof want, "%d.%d.%d", WKV_VERSION_MAJOR, WKV_VERSION_MINOR, WKV_VERSION_PATCH);
  CHECK(wkv_version_string() != NULL && strcmp(wkv_version_string(), want) == 0,
        "wkv_version_string() is \"major.minor.patch\" of the macros");
  CHECK(wkv_version_string() == wkv_version_string(), "wkv_version_string() is a static string");

  for (i = 0; i < (int)(sizeof codes / sizeof codes[0]); ++i) {
    const char *n = wkv_status_name(codes[i]);
    CHECK(codes[i] == i, "status codes are numbered 0..12 as documented");
    CHECK(n != NULL && strcmp(n, names[i]) == 0, names[i]);
  }
  for (i = 0; i < (int)(sizeof unknown / sizeof unknown[0]); ++i) {
    const char *n = wkv_status_name(unknown[i]);
    int j;
    CHECK(n != NULL && n[0] != '\0', "wkv_status_name of an unknown code is a non-empty string");
    for (j = 0; j < (int)(sizeof names / sizeof names[0]); ++j)
      CHECK(strcmp(n, names[j]) != 0, "an unknown code is not named like a known one");
  }
  CHECK(wkv_last_error() != NULL, "wkv_last_error() is never NULL");
}

static void test_defaults(void) {
  wkv_config c;
  wkv_stats st;
  wkv_seq_info in;
  wkv_xbuf_view xv;
  unsigned char zero[sizeof(wkv_stats)];
  phase("defaults_and_null");
  memset(&c, 0xab, sizeof c);
  wkv_config_init(&c);
  CHECK(c.size == sizeof(wkv_config), "config.size = sizeof(wkv_config)");
  CHECK(c.device == WKV_DEVICE_CPU, "default device is CPU");
  CHECK(c.device_id == 0, "default device_id is 0");
  CHECK(c.n_layers == 0 && c.n_q_heads == 0 && c.n_kv_heads == 0 && c.head_dim == 0,
        "the shape has no default (left 0)");
  CHECK(c.segment_tokens == 8192, "default segment_tokens 8192");
  CHECK(c.update_segment_tokens == 1024, "default update_segment_tokens 1024");
  CHECK(c.cluster_tokens == 16, "default cluster_tokens 16");
  CHECK(c.kmeans_iters == 10, "default kmeans_iters 10");
  CHECK(c.sink_tokens == 4, "default sink_tokens 4");
  CHECK(c.window_tokens == 64, "default window_tokens 64");
  CHECK(c.retrieval_frac == 0.018f, "default retrieval_frac 0.018");
  CHECK(c.estimation_frac == 0.232f, "default estimation_frac 0.232");
  CHECK(c.page_bytes == 2048, "default page_bytes 2048");
  CHECK(c.threads == 0, "default threads 0");
  CHECK(c.flags == 0, "default flags 0");
  CHECK(c.page_format == WKV_PAGE_FORMAT_STORAGE, "default page_format STORAGE");
  CHECK(c.host_budget_bytes == 0, "default host_budget_bytes 0 (unlimited)");
  CHECK(c.host_chunk_bytes == 64ull << 20, "default host_chunk_bytes 64 MiB");
  CHECK(c.device_cache_bytes == 0, "default device_cache_bytes 0");
  CHECK(c.seed == 0x5eed, "default seed 0x5eed");
  CHECK(c.stats_path == NULL, "default stats_path NULL (no statistics file)");
  CHECK(c.stats_interval_ms == 1000, "default stats_interval_ms 1000");
  CHECK(c.method == WKV_METHOD_DEFAULT, "default method: every refinement");
  CHECK(c.reserved1 == 0, "reserved1 initialised to 0");

  memset(zero, 0, sizeof zero);
  memset(&st, 0xff, sizeof st);
  wkv_stats_init(&st);
  CHECK(st.size == sizeof st, "wkv_stats_init sets size");
  CHECK(memcmp((const char *)&st + 4, zero, sizeof st - 4) == 0, "wkv_stats_init zeroes the rest");
  memset(&in, 0xff, sizeof in);
  wkv_seq_info_init(&in);
  CHECK(in.size == sizeof in, "wkv_seq_info_init sets size");
  CHECK(memcmp((const char *)&in + 4, zero, sizeof in - 4) == 0, "wkv_seq_info_init zeroes the rest");
  memset(&xv, 0xff, sizeof xv);
  wkv_xbuf_view_init(&xv);
  CHECK(xv.size == sizeof xv, "wkv_xbuf_view_init sets size");
  CHECK(xv.n_runs == 0 && xv.n_tokens == 0 && xv.head_dim == 0 && xv.dtype == 0 && xv.k == NULL &&
            xv.v == NULL && xv.offsets == NULL,
        "wkv_xbuf_view_init zeroes the rest");

  /* NULL is a no-op for every init, destroy, close and free. */
  wkv_free(NULL);
  wkv_config_init(NULL);
  wkv_stats_init(NULL);
  wkv_seq_info_init(NULL);
  wkv_xbuf_view_init(NULL);
  wkv_engine_close(NULL);
  wkv_seq_destroy(NULL);
  wkv_plan_destroy(NULL);
}

static void test_open_errors(void) {
  wkv_config c;
  wkv_engine *e = NULL;
  phase("engine_open_errors");
  base_config(&c);
  EXPECT_ERR(wkv_engine_open(NULL, &e), WKV_ERR_INVALID_ARGUMENT);
  CHECK(e == NULL, "no engine after a failed open");
  EXPECT_ERR(wkv_engine_open(&c, NULL), WKV_ERR_INVALID_ARGUMENT);

  base_config(&c); c.size = 0;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "size 0");
  base_config(&c); c.n_layers = 0;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "n_layers missing");
  base_config(&c); c.n_q_heads = 0;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "n_q_heads missing");
  base_config(&c); c.n_kv_heads = 0;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "n_kv_heads missing");
  base_config(&c); c.head_dim = 0;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "head_dim missing");
  base_config(&c); c.n_kv_heads = 3;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "n_q_heads 4 not a multiple of n_kv_heads 3");
  base_config(&c); c.head_dim = 100;
  expect_open_fails(&c, WKV_ERR_UNSUPPORTED, "head_dim 100");
  base_config(&c); c.head_dim = 512;
  expect_open_fails(&c, WKV_ERR_UNSUPPORTED, "head_dim 512");
  base_config(&c); c.dtype = 3;
  expect_open_fails(&c, WKV_ERR_UNSUPPORTED, "dtype 3");
  base_config(&c); c.dtype = 0xffffffffu;
  expect_open_fails(&c, WKV_ERR_UNSUPPORTED, "dtype 0xffffffff");
  base_config(&c); c.device = 77;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "device 77");
  base_config(&c); c.retrieval_frac = -0.1f;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "retrieval_frac -0.1");
  base_config(&c); c.retrieval_frac = 1.5f; c.estimation_frac = 0.0f;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "retrieval_frac 1.5");
  base_config(&c); c.estimation_frac = -0.5f;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "estimation_frac -0.5");
  base_config(&c); c.retrieval_frac = 0.0f; c.estimation_frac = 1.01f;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "estimation_frac 1.01");
  base_config(&c); c.retrieval_frac = (float)NAN;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "retrieval_frac NaN");
  base_config(&c); c.retrieval_frac = 0.6f; c.estimation_frac = 0.6f;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "fractions summing to 1.2");
  base_config(&c); c.page_format = 3;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "page_format 3");
  CHECK(strstr(wkv_last_error(), "page_format") != NULL, "the refusal names page_format");
  base_config(&c); c.page_format = 0xffffffffu;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "page_format 0xffffffff");
  base_config(&c); c.reserved1 = 1;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "reserved1 1");
  CHECK(strstr(wkv_last_error(), "reserved1") != NULL, "the refusal names reserved1");
  base_config(&c); c.flags = 1u << 7;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "unknown flag bit 7");
  base_config(&c); c.flags = 0x80000000u | WKV_CONFIG_NO_NUMA;
  expect_open_fails(&c, WKV_ERR_INVALID_ARGUMENT, "unknown flag bit 31 with a known one");

  /* Boundary values that must be accepted. */
  base_config(&c); c.retrieval_frac = 0.25f; c.estimation_frac = 0.75f;
  EXPECT_OK(wkv_engine_open(&c, &e));
  CHECK(e != NULL, "fractions summing to exactly 1 open");
  wkv_engine_close(e);
  e = NULL;
  base_config(&c);
  c.flags = WKV_CONFIG_NO_NUMA | WKV_CONFIG_NO_PINNED | WKV_CONFIG_SPILL_NO_URING | WKV_CONFIG_HOST_META_ROWS;
  c.dtype = WKV_DTYPE_BF16;
  c.head_dim = 128;
  EXPECT_OK(wkv_engine_open(&c, &e));
  CHECK(e != NULL, "every known flag, bf16 and head_dim 128 open");
  wkv_engine_close(e);
  e = NULL;
  base_config(&c); c.page_format = WKV_PAGE_FORMAT_INT8;
  EXPECT_OK(wkv_engine_open(&c, &e));
  CHECK(e != NULL, "page_format INT8 opens an engine");
  {
    wkv_config got;
    uint32_t dev = 99;
    memset(&got, 0xcd, sizeof got);
    got.size = sizeof got;
    EXPECT_OK(wkv_engine_config(e, &got));
    CHECK(got.page_format == WKV_PAGE_FORMAT_INT8, "the effective config says page_format INT8");
    CHECK(got.page_bytes == c.page_bytes && got.dtype == c.dtype, "page_bytes and dtype as given");
    EXPECT_OK(wkv_engine_device(e, &dev));
    CHECK(dev == WKV_DEVICE_CPU, "the INT8 engine is a CPU engine");
  }
  wkv_engine_close(e);
}

static void check_config_roundtrip(wkv_engine *e, const wkv_config *want) {
  wkv_config got;
  unsigned char raw[sizeof(wkv_config)];
  const size_t part = offsetof(wkv_config, dtype) + sizeof(uint32_t);
  size_t i;
  int untouched = 1;
  uint32_t dev = 99;

  memset(&got, 0xcd, sizeof got);
  got.size = sizeof got;
  EXPECT_OK(wkv_engine_config(e, &got));
  CHECK(got.size == sizeof got, "config.size is kept");
  CHECK(got.device == WKV_DEVICE_CPU, "effective device is CPU");
  CHECK(got.device_id == want->device_id, "device_id round-trips");
  CHECK(got.n_layers == want->n_layers && got.n_q_heads == want->n_q_heads &&
            got.n_kv_heads == want->n_kv_heads && got.head_dim == want->head_dim && got.dtype == want->dtype,
        "the shape round-trips");
  CHECK(got.segment_tokens == want->segment_tokens && got.update_segment_tokens == want->update_segment_tokens &&
            got.cluster_tokens == want->cluster_tokens && got.kmeans_iters == want->kmeans_iters &&
            got.sink_tokens == want->sink_tokens && got.window_tokens == want->window_tokens,
        "token counts round-trip");
  CHECK(got.retrieval_frac == want->retrieval_frac && got.estimation_frac == want->estimation_frac,
        "fractions round-trip");
  CHECK(got.page_bytes == want->page_bytes && got.threads == want->threads && got.flags == want->flags &&
            got.page_format == want->page_format,
        "page_bytes, threads, flags, page_format round-trip");
  CHECK(got.host_budget_bytes == want->host_budget_bytes && got.host_chunk_bytes == want->host_chunk_bytes &&
            got.seed == want->seed,
        "budget, chunk and seed round-trip");
  CHECK(got.method == want->method && got.reserved1 == 0, "method round-trips");

  /* A caller built against an older, shorter wkv_config. */
  memset(raw, 0xcd, sizeof raw);
  {
    uint32_t sz = (uint32_t)part;
    memcpy(raw, &sz, sizeof sz);
  }
  EXPECT_OK(wkv_engine_config(e, (wkv_config *)(void *)raw));
  memcpy(&got, raw, sizeof got);
  CHECK(got.size == part, "a short config.size is kept");
  CHECK(got.n_layers == want->n_layers && got.head_dim == want->head_dim && got.dtype == want->dtype,
        "the fields a short size covers are filled");
  for (i = part; i < sizeof raw; ++i) untouched &= raw[i] == 0xcd;
  CHECK(untouched, "bytes beyond a short config.size are untouched");

  EXPECT_ERR(wkv_engine_config(NULL, &got), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_engine_config(e, NULL), WKV_ERR_INVALID_ARGUMENT);
  got.size = 0;
  EXPECT_ERR(wkv_engine_config(e, &got), WKV_ERR_INVALID_ARGUMENT);

  EXPECT_OK(wkv_engine_device(e, &dev));
  CHECK(dev == WKV_DEVICE_CPU, "wkv_engine_device says CPU");
  EXPECT_ERR(wkv_engine_device(NULL, &dev), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_engine_device(e, NULL), WKV_ERR_INVALID_ARGUMENT);
}

static void test_devices(void) {
  wkv_config c;
  wkv_engine *e = NULL;
  uint32_t dev = 99;
  int rc;
  phase("devices");
  base_config(&c);
  c.device = WKV_DEVICE_AUTO;
  EXPECT_OK(wkv_engine_open(&c, &e));
  EXPECT_OK(wkv_engine_device(e, &dev));
  CHECK(dev == WKV_DEVICE_CPU || dev == WKV_DEVICE_CUDA, "AUTO resolves to CPU or CUDA");
  {
    wkv_config got;
    got.size = sizeof got;
    EXPECT_OK(wkv_engine_config(e, &got));
    CHECK(got.device == dev, "the effective config names the resolved device");
  }
  wkv_engine_close(e);
  e = NULL;

  base_config(&c);
  c.device = WKV_DEVICE_CUDA;
  rc = wkv_engine_open(&c, &e);
  if (rc == WKV_OK) {
    expect_rc(rc, WKV_OK, "wkv_engine_open(CUDA)", __LINE__);
    EXPECT_OK(wkv_engine_device(e, &dev));
    CHECK(dev == WKV_DEVICE_CUDA, "a CUDA engine says CUDA");
    wkv_engine_close(e);
    printf("  cuda engine: opened\n");
  } else {
    CHECK(rc == WKV_ERR_UNSUPPORTED || rc == WKV_ERR_NO_DEVICE,
          "a CUDA engine opens or fails with UNSUPPORTED / NO_DEVICE");
    expect_rc(rc, rc, "wkv_engine_open(CUDA)", __LINE__);
    CHECK(e == NULL, "no engine after a failed CUDA open");
    printf("  cuda engine: skipped (%s: %s)\n", wkv_status_name(rc), wkv_last_error());
    g_skipped++;
  }
}

/* The engines and sequences shared by the phases below. */
static wkv_engine *g_e;  /* default fractions: estimation non-empty */
static wkv_engine *g_x;  /* retrieval_frac 1, estimation_frac 0: exact */
static wkv_seq *g_ea, *g_eb, *g_xa, *g_xb;
static ref_seq *g_ra, *g_rb;

static void test_open(void) {
  wkv_config c;
  phase("engine_open");
  base_config(&c);
  EXPECT_OK(wkv_engine_open(&c, &g_e));
  CHECK(g_e != NULL, "wkv_engine_open fills *out");
  check_config_roundtrip(g_e, &c);

  base_config(&c);
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  EXPECT_OK(wkv_engine_open(&c, &g_x));
  CHECK(g_x != NULL && g_x != g_e, "a second engine is a distinct handle");
  check_config_roundtrip(g_x, &c);
}

static void test_sequences(void) {
  static const uint32_t a0[] = {1, 3, 17, 64, 100, 255, 160};
  static const uint32_t a1[] = {7, 250, 43, 300};
  static const uint32_t b0[] = {333};
  static const uint32_t b1[] = {100, 175}; /* 275: one token short of a segment */
  static const uint32_t b1_one[] = {1};
  static const uint32_t b1_rest[] = {57};
  wkv_seq *s = NULL;
  wkv_seq_info in;
  phase("sequences");
  EXPECT_ERR(wkv_seq_create(NULL, &s), WKV_ERR_INVALID_HANDLE);
  CHECK(s == NULL, "no sequence after a failed create");
  EXPECT_ERR(wkv_seq_create(g_e, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_OK(wkv_seq_create(g_e, &g_ea));
  EXPECT_OK(wkv_seq_create(g_e, &g_eb));
  EXPECT_OK(wkv_seq_create(g_x, &g_xa));
  EXPECT_OK(wkv_seq_create(g_x, &g_xb));
  CHECK(g_ea && g_eb && g_xa && g_xb && g_ea != g_eb && g_xa != g_xb, "sequences are distinct handles");

  wkv_seq_info_init(&in);
  EXPECT_OK(wkv_seq_info_get(g_ea, 0, &in));
  CHECK(in.tokens == 0 && in.clustered == 0 && in.sink == 0 && in.tail == 0 && in.segments == 0 &&
            in.clusters == 0 && in.pages == 0 && in.generating == 0,
        "a new sequence is empty");
  CHECK(in.evicted == 0 && in.reserved == 0 && in.spilled_pages == 0,
        "a new sequence is not evicted and has no page in the spill file");

  /* The same tokens go to engine E (packed / head-major) and to engine X
   * (interleaved, head-major, padded with NaN gaps, packed). */
  g_ra = ref_new();
  g_rb = ref_new();
  append_chunks(g_xa, LAYOUT_INTERLEAVED, g_ea, LAYOUT_PACKED, g_ra, 0, a0, 7);
  append_chunks(g_xa, LAYOUT_HEAD_MAJOR, g_ea, LAYOUT_PADDED, g_ra, 1, a1, 4);
  append_chunks(g_xb, LAYOUT_PADDED, g_eb, LAYOUT_HEAD_MAJOR, g_rb, 0, b0, 1);
  append_chunks(g_xb, LAYOUT_PACKED, g_eb, LAYOUT_INTERLEAVED, g_rb, 1, b1, 2);
  expect_info(g_xb, 1, 275, 4, 271, 0, 0, "one token short of a complete segment beyond the window");
  append_chunks(g_xb, LAYOUT_PACKED, g_eb, LAYOUT_INTERLEAVED, g_rb, 1, b1_one, 1);
  expect_info(g_xb, 1, 276, 4, 16, 1, 0, "a prompt segment is clustered as it completes");
  append_chunks(g_xb, LAYOUT_PACKED, g_eb, LAYOUT_INTERLEAVED, g_rb, 1, b1_rest, 1);

  /* 600 tokens: sink 4, then every complete 256-token run beyond the
   * 16-token window is clustered: 2 segments, 84 in the tail. */
  expect_info(g_xa, 0, 600, 4, 84, 2, 0, "600 prompt tokens, layer 0");
  expect_info(g_xa, 1, 600, 4, 84, 2, 0, "600 prompt tokens, layer 1");
  expect_info(g_ea, 0, 600, 4, 84, 2, 0, "600 prompt tokens on engine E");
  expect_info(g_xb, 0, 333, 4, 73, 1, 0, "333 prompt tokens, layer 0");
  expect_info(g_eb, 1, 333, 4, 73, 1, 0, "333 prompt tokens on engine E, layer 1");
  wkv_seq_info_init(&in);
  EXPECT_OK(wkv_seq_info_get(g_xa, 0, &in));
  /* f32, head_dim 64: a 2048-byte page holds 8 tokens; 256/8 pages per
   * segment, per KV head. Each segment of 256 asks for 32 clusters. */
  CHECK(in.pages == 2 * NKV * 32, "pages: 32 per segment per KV head");
  CHECK(in.clusters >= 2 * NKV && in.clusters <= 2 * NKV * 32, "clusters: at most 32 per segment per head");
  CHECK(in.evicted == 0 && in.reserved == 0 && in.spilled_pages == 0,
        "without a spill file, no page is in one");

  /* A short wkv_seq_info: only the prefix its size covers is written. */
  {
    unsigned char raw[sizeof(wkv_seq_info)];
    const uint32_t sz = (uint32_t)offsetof(wkv_seq_info, clustered);
    size_t i;
    int untouched = 1;
    memset(raw, 0xee, sizeof raw);
    memcpy(raw, &sz, sizeof sz);
    EXPECT_OK(wkv_seq_info_get(g_xa, 0, (wkv_seq_info *)(void *)raw));
    memcpy(&in, raw, sizeof in);
    CHECK(in.size == sz && in.tokens == 600 && in.generating == 0, "a short info gets its prefix");
    for (i = sz; i < sizeof raw; ++i) untouched &= raw[i] == 0xee;
    CHECK(untouched, "bytes beyond a short info.size are untouched");
  }
}

static void test_append_errors(void) {
  float k[NKV * D * 4], v[NKV * D * 4];
  wkv_plan *p = NULL;
  size_t i;
  phase("append_errors");
  for (i = 0; i < sizeof k / sizeof k[0]; ++i) k[i] = v[i] = frand();
  EXPECT_OK(wkv_plan_create(g_x, &p));
  EXPECT_ERR(wkv_seq_append(NULL, 0, k, v, 1, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_append((wkv_seq *)(void *)p, 0, k, v, 1, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_append((wkv_seq *)(void *)g_x, 0, k, v, 1, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_append(g_xa, 0, NULL, v, 1, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_append(g_xa, 0, k, NULL, 1, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_append(g_xa, 0, k, v, 0, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_append(g_xa, NL, k, v, 1, 0, 0, NULL), WKV_ERR_OUT_OF_RANGE);
  EXPECT_ERR(wkv_seq_append(g_xa, 0xffffffffu, k, v, 1, 0, 0, NULL), WKV_ERR_OUT_OF_RANGE);
  /* head_stride 10 < head_dim 64: the rows of two heads overlap. */
  EXPECT_ERR(wkv_seq_append(g_xa, 0, k, v, 2, 0, 10, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_append(g_xa, 0, k, v, 2, 2 * 10, 10, NULL), WKV_ERR_INVALID_ARGUMENT);
  /* token_stride smaller than the heads of a token. */
  EXPECT_ERR(wkv_seq_append(g_xa, 0, k, v, 2, D, D, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_append(g_xa, 0, k, v, 2, -NKV * D, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_append(g_xa, 0, k, v, 2, 0, -D, NULL), WKV_ERR_INVALID_ARGUMENT);
  expect_info(g_xa, 0, 600, 4, 84, 2, 0, "failed appends appended nothing");
  wkv_plan_destroy(p);
}

/* wkv_seq_end_prompt ends a layer's prompt as its first lookup would: the
 * rest beyond the window is clustered, later tokens are generated ones. */
static void test_end_prompt(void) {
  static const uint32_t chunk[] = {300};
  static const uint32_t one[] = {1};
  ref_seq *r = ref_new();
  wkv_seq *s = NULL;
  wkv_plan *p = NULL;
  phase("end_prompt");
  EXPECT_OK(wkv_seq_create(g_x, &s));
  EXPECT_OK(wkv_plan_create(g_x, &p));
  EXPECT_ERR(wkv_seq_end_prompt(NULL, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_end_prompt((wkv_seq *)(void *)p, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_end_prompt(s, NL, NULL), WKV_ERR_OUT_OF_RANGE);
  append_chunks(s, LAYOUT_PACKED, NULL, LAYOUT_PACKED, r, 0, chunk, 1);
  /* 300 = sink 4 + one segment of 256 + 40 beyond it (the window is 16). */
  expect_info(s, 0, 300, 4, 40, 1, 0, "300 prompt tokens");
  EXPECT_OK(wkv_seq_end_prompt(s, 0, NULL));
  expect_info(s, 0, 300, 4, 16, 2, 1, "the end of the prompt clusters the 24 beyond the window");
  expect_info(s, 1, 0, 0, 0, 0, 0, "another layer is still in its prompt");
  EXPECT_OK(wkv_seq_end_prompt(s, 1, NULL));
  expect_info(s, 1, 0, 0, 0, 0, 0, "a layer without tokens has no prompt to end");
  EXPECT_OK(wkv_seq_end_prompt(s, 0, NULL));
  expect_info(s, 0, 300, 4, 16, 2, 1, "a second end is a no-op");
  append_chunks(s, LAYOUT_PACKED, NULL, LAYOUT_PACKED, r, 0, one, 1);
  expect_info(s, 0, 301, 4, 17, 2, 1, "tokens after the end are generated ones");
  wkv_plan_destroy(p);
  wkv_seq_destroy(s);
  free(r);
}

static void test_info_errors(void) {
  wkv_seq_info in;
  phase("info_errors");
  wkv_seq_info_init(&in);
  EXPECT_ERR(wkv_seq_info_get(NULL, 0, &in), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_info_get((const wkv_seq *)(const void *)g_x, 0, &in), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_info_get(g_xa, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_info_get(g_xa, NL, &in), WKV_ERR_OUT_OF_RANGE);
  in.size = 0;
  EXPECT_ERR(wkv_seq_info_get(g_xa, 0, &in), WKV_ERR_INVALID_ARGUMENT);
}

static void test_decode_exact(void) {
  static float q[2 * NQ * 72 + 64], out[2 * 284 + 64], packed[2 * NQ * D], qp[2 * NQ * D];
  wkv_seq *seqs[2];
  const ref_seq *refs[2];
  wkv_plan *p = NULL;
  uint32_t s, h, i;
  int gaps_ok = 1;
  phase("decode_exact");
  seqs[0] = g_xa; seqs[1] = g_xb;
  refs[0] = g_ra; refs[1] = g_rb;
  EXPECT_ERR(wkv_plan_create(NULL, &p), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_plan_create((wkv_engine *)(void *)g_xa, &p), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_plan_create(g_x, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_OK(wkv_plan_create(g_x, &p));
  CHECK(p != NULL, "wkv_plan_create fills *out");

  /* Packed q and out, layer 0. */
  decode_and_check(p, seqs, refs, 2, 0, "decode layer 0, 600 + 333 tokens");
  /* The first lookup ends the prompt: 68 more tokens beyond the window
   * become a third segment. */
  expect_info(g_xa, 0, 600, 4, 16, 3, 1, "after the first lookup");
  expect_info(g_xb, 0, 333, 4, 16, 2, 1, "after the first lookup (333)");
  expect_info(g_xa, 1, 600, 4, 84, 2, 0, "layer 1 untouched by a layer-0 lookup");

  /* Strided q [s][h][72] + 16 and out [s][h][68] + 12, layer 1; the gaps of
   * out are sentinels that must survive. */
  for (i = 0; i < sizeof q / sizeof q[0]; ++i) q[i] = (float)NAN;
  for (i = 0; i < sizeof out / sizeof out[0]; ++i) out[i] = -12345.0f;
  random_q(qp, 2);
  for (s = 0; s < 2; ++s)
    for (h = 0; h < NQ; ++h) memcpy(&q[s * 304 + h * 72], &qp[(s * NQ + h) * D], D * sizeof(float));
  EXPECT_OK(wkv_decode(p, seqs, 2, 1, q, 304, 72, out, 284, 68, NULL));
  for (s = 0; s < 2; ++s)
    for (h = 0; h < NQ; ++h) memcpy(&packed[(s * NQ + h) * D], &out[s * 284 + h * 68], D * sizeof(float));
  check_against_ref(packed, qp, refs, 2, 1, 1e-5, "decode layer 1 with strided q and out");
  for (i = 0; i < sizeof out / sizeof out[0]; ++i) {
    const uint32_t si = i / 284, r = i % 284;
    const int inside = si < 2 && r < NQ * 68 && r % 68 < D;
    if (!inside) gaps_ok &= out[i] == -12345.0f;
  }
  CHECK(gaps_ok, "decode writes nothing between strided output rows");

  /* One sequence alone, and the other alone: each matches its reference. */
  decode_and_check(p, &seqs[1], &refs[1], 1, 0, "decode one sequence (333)");
  decode_and_check(p, &seqs[0], &refs[0], 1, 1, "decode one sequence (600), layer 1");
  wkv_plan_destroy(p);
}

/* Checks the execution buffer of a full-retrieval lookup: every run holds
 * exactly its sequence's tokens of the layer for its KV head. */
static void check_full_xbuf(const wkv_xbuf_view *xv, const ref_seq *const *refs, uint32_t n_seqs,
                            uint32_t layer) {
  uint32_t r;
  CHECK(xv->size == sizeof *xv, "view.size kept");
  CHECK(xv->n_runs == n_seqs * NKV, "n_runs = n_seqs * n_kv_heads");
  CHECK(xv->head_dim == D && xv->dtype == WKV_DTYPE_F32, "view head_dim and dtype");
  CHECK(xv->k != NULL && xv->v != NULL && xv->offsets != NULL, "view pointers set");
  CHECK(xv->offsets[0] == 0, "offsets[0] == 0");
  for (r = 0; r < xv->n_runs; ++r) CHECK(xv->offsets[r + 1] >= xv->offsets[r], "offsets are monotone");
  CHECK(xv->n_tokens == (uint64_t)xv->offsets[xv->n_runs], "n_tokens == offsets[n_runs]");
  for (r = 0; r < xv->n_runs; ++r) {
    const uint32_t s = r / NKV, h = r % NKV;
    const ref_seq *rs = refs[s];
    const float *K = (const float *)xv->k, *V = (const float *)xv->v;
    double ks = 0, kq = 0, vs = 0, rks = 0, rkq = 0, rvs = 0;
    int32_t t;
    uint32_t i, u;
    char msg[160];
    snprintf(msg, sizeof msg, "run %u holds all %u tokens of its sequence (has %d)", r, rs->len[layer],
             xv->offsets[r + 1] - xv->offsets[r]);
    CHECK((uint32_t)(xv->offsets[r + 1] - xv->offsets[r]) == rs->len[layer], msg);
    for (t = xv->offsets[r]; t < xv->offsets[r + 1]; ++t)
      for (i = 0; i < D; ++i) {
        const double kk = K[(size_t)t * D + i];
        ks += kk;
        kq += kk * kk;
        vs += V[(size_t)t * D + i];
      }
    for (u = 0; u < rs->len[layer]; ++u)
      for (i = 0; i < D; ++i) {
        const double kk = ref_k(rs, layer, u, h)[i];
        rks += kk;
        rkq += kk * kk;
        rvs += ref_v(rs, layer, u, h)[i];
      }
    snprintf(msg, sizeof msg, "run %u: sums of K (%.6f vs %.6f), K^2 and V match the layer's keys", r, ks, rks);
    CHECK(fabs(ks - rks) <= 1e-3 && fabs(kq - rkq) <= 1e-3 && fabs(vs - rvs) <= 1e-3, msg);
  }
}

static void test_split_path(void) {
  static float q[2 * NQ * D], out[2 * NQ * D], own[2 * NQ * D], own_lse[2 * NQ];
  static double want[2 * NQ * D], want_lse[2 * NQ];
  float lse[2 * NQ];
  wkv_seq *seqs[2];
  const ref_seq *refs[2];
  wkv_plan *p = NULL;
  wkv_xbuf_view xv;
  uint32_t s, h;
  phase("split_path");
  seqs[0] = g_xa; seqs[1] = g_xb;
  refs[0] = g_ra; refs[1] = g_rb;
  EXPECT_OK(wkv_plan_create(g_x, &p));
  random_q(q, 2);
  EXPECT_OK(wkv_lookup(p, seqs, 2, 1, q, 0, 0, NULL));
  /* q is copied: changing it after the lookup changes nothing. */
  {
    static float keep[2 * NQ * D];
    memcpy(keep, q, sizeof q);
    random_q(q, 2);
    EXPECT_OK(wkv_assemble(p, NULL));
    memcpy(q, keep, sizeof q);
  }
  wkv_xbuf_view_init(&xv);
  EXPECT_OK(wkv_plan_xbuf(p, &xv));
  check_full_xbuf(&xv, refs, 2, 1);

  for (s = 0; s < 2 * NQ; ++s) lse[s] = (float)NAN;
  EXPECT_OK(wkv_attend(p, out, 0, 0, lse, NULL));
  check_against_ref(out, q, refs, 2, 1, 1e-5, "wkv_attend at full retrieval");
  for (s = 0; s < 2; ++s) ref_attention(refs[s], 1, q + s * NQ * D, want + s * NQ * D, want_lse + s * NQ);
  for (s = 0; s < 2; ++s)
    for (h = 0; h < NQ; ++h) {
      const float l = lse[s * NQ + h];
      CHECK(isfinite(l), "wkv_attend's lse is finite");
      CHECK(fabs(l - want_lse[s * NQ + h]) <= 1e-4, "wkv_attend's lse is the exact log-sum-exp");
    }
  EXPECT_OK(wkv_attend(p, out, 0, 0, NULL, NULL));
  check_against_ref(out, q, refs, 2, 1, 1e-5, "wkv_attend without lse");

  /* The caller's own kernel over the buffer gives the same answer. */
  xbuf_attention(&xv, 2, q, own, own_lse);
  check_against_ref(own, q, refs, 2, 1, 1e-5, "own attention over the execution buffer");
  /* With no estimation zone, merge leaves the caller's result as it is. */
  EXPECT_OK(wkv_merge(p, own, 0, 0, own_lse, 0, NULL));
  check_against_ref(own, q, refs, 2, 1, 1e-5, "merge with an empty estimation zone");
  for (s = 0; s < 2 * NQ; ++s) CHECK(fabs(own_lse[s] - want_lse[s]) <= 1e-4, "merge keeps an exact lse");
  EXPECT_OK(wkv_update(p, NULL));

  /* A short view gets only its prefix. */
  {
    unsigned char raw[sizeof(wkv_xbuf_view)];
    const uint32_t sz = (uint32_t)offsetof(wkv_xbuf_view, head_dim);
    size_t i;
    int untouched = 1;
    wkv_xbuf_view got;
    memset(raw, 0xee, sizeof raw);
    memcpy(raw, &sz, sizeof sz);
    EXPECT_OK(wkv_plan_xbuf(p, (wkv_xbuf_view *)(void *)raw));
    memcpy(&got, raw, sizeof got);
    CHECK(got.size == sz && got.n_runs == 2 * NKV && got.n_tokens == xv.n_tokens, "a short view gets its prefix");
    for (i = sz; i < sizeof raw; ++i) untouched &= raw[i] == 0xee;
    CHECK(untouched, "bytes beyond a short view.size are untouched");
  }
  EXPECT_ERR(wkv_plan_xbuf(NULL, &xv), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_plan_xbuf((const wkv_plan *)(const void *)g_xa, &xv), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_plan_xbuf(p, NULL), WKV_ERR_INVALID_ARGUMENT);
  xv.size = 0;
  EXPECT_ERR(wkv_plan_xbuf(p, &xv), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_assemble(NULL, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_attend(NULL, out, 0, 0, lse, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_attend(p, NULL, 0, 0, lse, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_attend(p, out, 0, 10, lse, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_attend(p, out, -1, 0, lse, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_merge(NULL, out, 0, 0, lse, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_merge(p, NULL, 0, 0, lse, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_merge(p, out, 0, 0, NULL, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_merge(p, out, 0, 10, lse, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_update(NULL, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_update((wkv_plan *)(void *)g_x, NULL), WKV_ERR_INVALID_HANDLE);
  wkv_plan_destroy(p);
}

static void test_merge(void) {
  static float q[2 * NQ * D], att[2 * NQ * D], own[2 * NQ * D], exact[2 * NQ * D];
  static float so[2 * 284], slse[2 * 7];
  float att_lse[2 * NQ], own_lse[2 * NQ], exact_lse[2 * NQ];
  wkv_seq *seqs[2];
  wkv_plan *p = NULL;
  wkv_xbuf_view xv;
  wkv_stats st;
  uint32_t s, h, r;
  double err;
  char msg[160];
  phase("merge");
  seqs[0] = g_ea; seqs[1] = g_eb;
  EXPECT_OK(wkv_plan_create(g_e, &p));
  random_q(q, 2);
  EXPECT_OK(wkv_lookup(p, seqs, 2, 0, q, 0, 0, NULL));
  EXPECT_OK(wkv_assemble(p, NULL));
  wkv_xbuf_view_init(&xv);
  EXPECT_OK(wkv_plan_xbuf(p, &xv));
  CHECK(xv.n_runs == 2 * NKV && xv.offsets[0] == 0 && xv.n_tokens == (uint64_t)xv.offsets[xv.n_runs],
        "view of a partial-retrieval plan");
  for (r = 0; r < xv.n_runs; ++r) {
    const ref_seq *rs = r / NKV == 0 ? g_ra : g_rb;
    const uint32_t n = (uint32_t)(xv.offsets[r + 1] - xv.offsets[r]);
    CHECK(xv.offsets[r + 1] >= xv.offsets[r], "offsets are monotone");
    /* At least sink + window, never more than the layer holds. */
    CHECK(n >= 4 + 16 && n < rs->len[0], "a partial run holds the steady zone and not every token");
  }
  wkv_stats_init(&st);
  EXPECT_OK(wkv_engine_stats(g_e, &st));
  CHECK(st.estimated_clusters > 0, "default fractions estimate some clusters");

  xbuf_attention(&xv, 2, q, own, own_lse);
  memcpy(exact, own, sizeof own);
  memcpy(exact_lse, own_lse, sizeof own_lse);
  /* The same through strided out [s][h][68] + 12 and lse [s][7]. */
  for (s = 0; s < 2; ++s)
    for (h = 0; h < NQ; ++h) {
      memcpy(&so[s * 284 + h * 68], &own[(s * NQ + h) * D], D * sizeof(float));
      slse[s * 7 + h] = own_lse[s * NQ + h];
    }
  EXPECT_OK(wkv_merge(p, own, 0, 0, own_lse, 0, NULL));
  EXPECT_OK(wkv_merge(p, so, 284, 68, slse, 7, NULL));
  EXPECT_OK(wkv_attend(p, att, 0, 0, att_lse, NULL));

  err = rel_l2_f(own, att, 2 * NQ * D);
  snprintf(msg, sizeof msg, "merge of the caller's attention equals wkv_attend (rel L2 %.3g)", err);
  CHECK(err <= 1e-4, msg);
  err = rel_l2_f(exact, att, 2 * NQ * D);
  snprintf(msg, sizeof msg, "the estimate changes the output (rel L2 %.3g from the exact part)", err);
  CHECK(err > 1e-4, msg);
  for (s = 0; s < 2; ++s)
    for (h = 0; h < NQ; ++h) {
      const uint32_t i = s * NQ + h;
      CHECK(isfinite(att_lse[i]) && isfinite(own_lse[i]), "merged lse is finite");
      CHECK(fabs(own_lse[i] - att_lse[i]) <= 1e-4, "merged lse equals wkv_attend's lse");
      CHECK(own_lse[i] > exact_lse[i] + 1e-4, "the estimate adds to the softmax denominator");
      CHECK(slse[s * 7 + h] == own_lse[i], "strided lse merges like packed");
      CHECK(memcmp(&so[s * 284 + h * 68], &own[i * D], D * sizeof(float)) == 0, "strided out merges like packed");
    }
  EXPECT_OK(wkv_update(p, NULL));
  /* lse rows closer than n_q_heads overlap; a failed verb leaves no step. */
  EXPECT_ERR(wkv_merge(p, own, 0, 0, own_lse, 1, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_update(p, NULL), WKV_ERR_STATE);
  EXPECT_ERR(wkv_attend(p, att, 0, 0, att_lse, NULL), WKV_ERR_STATE);

  /* wkv_decode on the same engine gives wkv_attend's answer. */
  EXPECT_OK(wkv_decode(p, seqs, 2, 0, q, 0, 0, own, 0, 0, NULL));
  err = rel_l2_f(own, att, 2 * NQ * D);
  CHECK(err <= 1e-6, "wkv_decode equals lookup + assemble + attend");
  EXPECT_OK(wkv_decode(p, seqs, 2, 1, q, 0, 0, own, 0, 0, NULL));
  wkv_plan_destroy(p);
}

static void test_ordering(void) {
  static const uint32_t prompt[] = {50};
  static const uint32_t ones[] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  static const uint32_t more[] = {54}; /* tail 79: one short of window + 64 */
  static const uint32_t rest[] = {31}, last[] = {5};
  static float q[NQ * D], out[NQ * D];
  float lse[NQ];
  wkv_plan *p = NULL;
  wkv_seq *xc = NULL;
  ref_seq *rc = ref_new();
  const ref_seq *refs[1];
  wkv_xbuf_view xv;
  wkv_stats st0, st1;
  phase("ordering");
  EXPECT_OK(wkv_plan_create(g_x, &p));
  wkv_xbuf_view_init(&xv);
  EXPECT_ERR(wkv_assemble(p, NULL), WKV_ERR_STATE);
  EXPECT_ERR(wkv_attend(p, out, 0, 0, lse, NULL), WKV_ERR_STATE);
  EXPECT_ERR(wkv_merge(p, out, 0, 0, lse, 0, NULL), WKV_ERR_STATE);
  EXPECT_ERR(wkv_update(p, NULL), WKV_ERR_STATE);
  EXPECT_ERR(wkv_plan_xbuf(p, &xv), WKV_ERR_STATE);

  EXPECT_OK(wkv_seq_create(g_x, &xc));
  refs[0] = rc;
  append_chunks(xc, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rc, 0, prompt, 1);
  expect_info(xc, 0, 50, 4, 46, 0, 0, "50 prompt tokens");
  random_q(q, 1);
  EXPECT_OK(wkv_lookup(p, &xc, 1, 0, q, 0, 0, NULL));
  /* The lookup ended the prompt: 30 tokens beyond the window clustered. */
  expect_info(xc, 0, 50, 4, 16, 1, 1, "after the first lookup");
  /* Looked up, not assembled: attend and the view are still out of order. */
  EXPECT_ERR(wkv_attend(p, out, 0, 0, lse, NULL), WKV_ERR_STATE);
  EXPECT_ERR(wkv_plan_xbuf(p, &xv), WKV_ERR_STATE);

  /* An append between lookup and assemble makes the lookup stale. */
  append_chunks(xc, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rc, 0, ones, 1);
  EXPECT_ERR(wkv_assemble(p, NULL), WKV_ERR_STATE);

  /* Generated tokens: each 64-token run beyond the window is clustered. */
  append_chunks(xc, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rc, 0, ones + 1, 8);
  append_chunks(xc, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rc, 0, more, 1);
  expect_info(xc, 0, 113, 4, 79, 1, 1, "one generated token short of an update segment");
  wkv_stats_init(&st0);
  EXPECT_OK(wkv_engine_stats(g_x, &st0));
  append_chunks(xc, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rc, 0, ones, 1);
  /* Its growth begins; it commits 32 tokens later (the growth lag), in the
   * append that brings the sequence to 146 tokens, whatever its size. */
  expect_info(xc, 0, 114, 4, 80, 1, 1, "an update segment completes: still in the tail");
  append_chunks(xc, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rc, 0, rest, 1);
  expect_info(xc, 0, 145, 4, 111, 1, 1, "one token short of the growth's commit point");
  append_chunks(xc, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rc, 0, last, 1);
  expect_info(xc, 0, 150, 4, 52, 2, 1, "100 generated tokens after a 50-token prompt: the growth committed");
  wkv_stats_init(&st1);
  EXPECT_OK(wkv_engine_stats(g_x, &st1));
  CHECK(st1.growths_deferred == st0.growths_deferred + 1, "stats: the segment's growth was deferred to its point");
  CHECK(st1.growth_waits == st0.growth_waits, "stats: its commit did not wait (the CPU clusters at once)");

  /* A fresh lookup works again, over every token. */
  random_q(q, 1);
  EXPECT_OK(wkv_lookup(p, &xc, 1, 0, q, 0, 0, NULL));
  EXPECT_OK(wkv_assemble(p, NULL));
  EXPECT_OK(wkv_plan_xbuf(p, &xv));
  check_full_xbuf(&xv, refs, 1, 0);
  EXPECT_OK(wkv_attend(p, out, 0, 0, lse, NULL));
  check_against_ref(out, q, refs, 1, 0, 1e-5, "attend after a fresh lookup, 150 tokens");
  EXPECT_OK(wkv_update(p, NULL));
  /* Assemble may be repeated while nothing changed. */
  EXPECT_OK(wkv_assemble(p, NULL));
  EXPECT_OK(wkv_attend(p, out, 0, 0, lse, NULL));
  check_against_ref(out, q, refs, 1, 0, 1e-5, "attend after a second assemble");
  EXPECT_ERR(wkv_lookup(p, &xc, 1, 1, q, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT); /* layer 1 is empty */
  wkv_plan_destroy(p);
  wkv_seq_destroy(xc);
  free(rc);
}

static void test_lookup_errors(void) {
  static float q[2 * NQ * D], out[2 * NQ * D];
  wkv_plan *p = NULL, *pe = NULL;
  wkv_seq *empty = NULL, *half = NULL;
  wkv_seq *both[2], *twice[2], *withnull[2], *foreign[2], *mistyped[2], *one[1];
  float k[NKV * D], v[NKV * D];
  uint32_t i;
  phase("lookup_decode_errors");
  random_q(q, 2);
  for (i = 0; i < NKV * D; ++i) k[i] = v[i] = frand();
  EXPECT_OK(wkv_plan_create(g_x, &p));
  EXPECT_OK(wkv_plan_create(g_e, &pe));
  EXPECT_OK(wkv_seq_create(g_x, &empty));
  EXPECT_OK(wkv_seq_create(g_x, &half));
  EXPECT_OK(wkv_seq_append(half, 0, k, v, 1, 0, 0, NULL));
  both[0] = g_xa; both[1] = g_xb;
  twice[0] = g_xa; twice[1] = g_xa;
  withnull[0] = g_xa; withnull[1] = NULL;
  foreign[0] = g_xa; foreign[1] = g_ea;
  mistyped[0] = g_xa; mistyped[1] = (wkv_seq *)(void *)p;

  EXPECT_ERR(wkv_lookup(NULL, both, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_lookup((wkv_plan *)(void *)g_xa, both, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_lookup(p, NULL, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_lookup(p, both, 0, 0, q, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_lookup(p, withnull, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_lookup(p, twice, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_lookup(p, foreign, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_lookup(pe, both, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_lookup(p, mistyped, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_lookup(p, both, 2, NL, q, 0, 0, NULL), WKV_ERR_OUT_OF_RANGE);
  EXPECT_ERR(wkv_lookup(p, both, 2, 0, NULL, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_lookup(p, both, 2, 0, q, 0, 10, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_lookup(p, both, 2, 0, q, D, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_lookup(p, both, 2, 0, q, 0, -D, NULL), WKV_ERR_INVALID_ARGUMENT);
  one[0] = empty;
  EXPECT_ERR(wkv_lookup(p, one, 1, 0, q, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  one[0] = half;
  EXPECT_ERR(wkv_lookup(p, one, 1, 1, q, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  /* After all those, the plan still has no lookup. */
  EXPECT_ERR(wkv_assemble(p, NULL), WKV_ERR_STATE);

  EXPECT_ERR(wkv_decode(NULL, both, 2, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_decode(p, NULL, 2, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_decode(p, both, 0, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_decode(p, withnull, 2, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_decode(p, twice, 2, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_decode(p, foreign, 2, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_decode(p, mistyped, 2, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_decode(p, both, 2, NL, q, 0, 0, out, 0, 0, NULL), WKV_ERR_OUT_OF_RANGE);
  EXPECT_ERR(wkv_decode(p, both, 2, 0, NULL, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_decode(p, both, 2, 0, q, 0, 0, NULL, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_decode(p, both, 2, 0, q, 0, 0, out, 0, 10, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_decode(p, both, 2, 0, q, 0, 10, out, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  one[0] = empty;
  EXPECT_ERR(wkv_decode(p, one, 1, 0, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  one[0] = half;
  EXPECT_ERR(wkv_decode(p, one, 1, 1, q, 0, 0, out, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  /* And the plan still works. */
  {
    const ref_seq *refs[2];
    refs[0] = g_ra; refs[1] = g_rb;
    decode_and_check(p, both, refs, 2, 0, "decode after failed calls");
  }
  wkv_seq_destroy(empty);
  wkv_seq_destroy(half);
  wkv_plan_destroy(p);
  wkv_plan_destroy(pe);
}

static void test_budget(void) {
  static const uint32_t fill[] = {40, 44};
  static const uint32_t one_token[] = {1};
  static const uint32_t bb_prompt[] = {30};
  wkv_config c;
  wkv_engine *b = NULL;
  wkv_seq *ba = NULL, *bb = NULL;
  wkv_plan *pb = NULL, *pb2 = NULL;
  ref_seq *ra = ref_new(), *rb = ref_new();
  const ref_seq *refs[1];
  wkv_stats st;
  static float q[NQ * D];
  phase("budget");
  /* 64 KiB of pages: one slot is 8 tokens of K and V (4 KiB), a 64-token
   * segment of 2 KV heads takes 16 slots: exactly the budget. */
  base_config(&c);
  c.segment_tokens = 64;
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  c.host_budget_bytes = 64 * 1024;
  EXPECT_OK(wkv_engine_open(&c, &b));
  EXPECT_OK(wkv_seq_create(b, &ba));
  EXPECT_OK(wkv_seq_create(b, &bb));
  EXPECT_OK(wkv_plan_create(b, &pb));

  append_chunks(ba, LAYOUT_PACKED, NULL, LAYOUT_PACKED, ra, 0, fill, 2);
  expect_info(ba, 0, 84, 4, 16, 1, 0, "84 tokens fill the budget");
  wkv_stats_init(&st);
  EXPECT_OK(wkv_engine_stats(b, &st));
  CHECK(st.host_budget_bytes == 64 * 1024, "stats report the budget");
  CHECK(st.host_bytes_reserved <= 64 * 1024, "reserved host bytes stay within the budget");
  CHECK(st.pages_used == 16 && st.host_bytes_used == st.pages_used * st.page_bytes,
        "16 pages in use, host_bytes_used = pages_used * page_bytes");

  /* 70 more tokens complete a segment that needs 16 more pages. */
  ref_gen(ra, 0, 70);
  EXPECT_ERR(append_from(ba, ra, 0, 84, 70, LAYOUT_PACKED), WKV_ERR_BUDGET);
  expect_info(ba, 0, 84, 4, 16, 1, 0, "a failed append appends nothing");
  wkv_stats_init(&st);
  EXPECT_OK(wkv_engine_stats(b, &st));
  CHECK(st.pages_used == 16, "a failed append holds no pages");
  CHECK(st.tokens == 84, "stats count only stored tokens");

  refs[0] = ra;
  decode_and_check(pb, &ba, refs, 1, 0, "decode over the 84 stored tokens");
  /* A generated token needs no page: it goes to the tail. */
  append_chunks(ba, LAYOUT_PACKED, NULL, LAYOUT_PACKED, ra, 0, one_token, 1);
  decode_and_check(pb, &ba, refs, 1, 0, "decode over 85 tokens");

  /* Ending a prompt can need pages too: the lookup reports the budget. */
  append_chunks(bb, LAYOUT_PACKED, NULL, LAYOUT_PACKED, rb, 0, bb_prompt, 1);
  EXPECT_OK(wkv_plan_create(b, &pb2));
  random_q(q, 1);
  EXPECT_ERR(wkv_lookup(pb2, &bb, 1, 0, q, 0, 0, NULL), WKV_ERR_BUDGET);
  expect_info(bb, 0, 30, 4, 26, 0, 0, "a lookup that failed on the budget changed nothing");
  EXPECT_ERR(wkv_assemble(pb2, NULL), WKV_ERR_STATE);

  /* Destroying the sequence and the plan that held it gives the pages back. */
  wkv_seq_destroy(ba);
  wkv_plan_destroy(pb);
  wkv_stats_init(&st);
  EXPECT_OK(wkv_engine_stats(b, &st));
  CHECK(st.pages_used == 0 && st.sequences == 1, "a destroyed sequence's pages are free");
  refs[0] = rb;
  decode_and_check(pb2, &bb, refs, 1, 0, "decode once pages are free again");
  expect_info(bb, 0, 30, 4, 16, 1, 1, "the prompt ended at the successful lookup");

  wkv_plan_destroy(pb2);
  wkv_seq_destroy(bb);
  wkv_engine_close(b);
  free(ra);
  free(rb);
}

static void test_stats(void) {
  wkv_stats st;
  char *js = NULL;
  size_t n;
  unsigned char raw[sizeof(wkv_stats)];
  phase("stats");
  wkv_stats_init(&st);
  EXPECT_OK(wkv_engine_stats(g_e, &st));
  CHECK(st.size == sizeof st, "stats.size kept");
  CHECK(st.device == WKV_DEVICE_CPU, "stats.device is CPU");
  CHECK(st.sequences == 2, "engine E holds 2 sequences");
  CHECK(st.tokens == 2 * 600 + 2 * 333, "tokens summed over sequences and layers");
  CHECK(st.segments > 0 && st.clusters >= st.segments, "segments and clusters counted");
  CHECK(st.lookups > 0 && st.retrieved_clusters > 0 && st.estimated_clusters > 0 && st.attended_tokens > 0,
        "lookups, retrieved and estimated clusters, attended tokens counted after decoding");
  CHECK(st.page_bytes > 0 && st.pages_used > 0 && st.host_bytes_used == st.pages_used * st.page_bytes,
        "pages in use, host_bytes_used = pages_used * page_bytes");
  CHECK(st.host_bytes_reserved >= st.host_bytes_used, "reserved covers used");
  CHECK(st.host_budget_bytes == 0, "no budget on engine E");
  CHECK(st.steady_bytes > 0 && st.meta_bytes > 0, "steady and meta bytes counted");
  CHECK(st.cache_frames_given == 0 && st.cache_records_dropped == 0,
        "no device cache frames given nor access records dropped on a CPU engine");
  CHECK(st.device_bytes_reserved == 0 && st.device_bytes_used == 0 && st.meta_device_bytes == 0 &&
            st.meta_host_rows_reserved == 0,
        "a CPU engine holds no device memory and no host rows' pool");

  memset(raw, 0xee, sizeof raw);
  {
    const uint32_t sz = (uint32_t)offsetof(wkv_stats, tokens);
    size_t i;
    int untouched = 1;
    memcpy(raw, &sz, sizeof sz);
    EXPECT_OK(wkv_engine_stats(g_e, (wkv_stats *)(void *)raw));
    memcpy(&st, raw, sizeof st);
    CHECK(st.size == sz && st.sequences == 2 && st.device == WKV_DEVICE_CPU, "a short stats gets its prefix");
    for (i = sz; i < sizeof raw; ++i) untouched &= raw[i] == 0xee;
    CHECK(untouched, "bytes beyond a short stats.size are untouched");
  }
  wkv_stats_init(&st);
  EXPECT_ERR(wkv_engine_stats(NULL, &st), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_engine_stats((wkv_engine *)(void *)g_ea, &st), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_engine_stats(g_e, NULL), WKV_ERR_INVALID_ARGUMENT);
  st.size = 0;
  EXPECT_ERR(wkv_engine_stats(g_e, &st), WKV_ERR_INVALID_ARGUMENT);

  EXPECT_OK(wkv_engine_stats_json(g_e, &js));
  CHECK(js != NULL, "stats JSON returned");
  n = strlen(js);
  CHECK(n > 2 && js[0] == '{' && js[n - 1] == '}', "stats JSON is one object");
  CHECK(strstr(js, "\"tokens\"") != NULL, "stats JSON names \"tokens\"");
  CHECK(strstr(js, "\"cache_frames_given\":0") != NULL && strstr(js, "\"cache_records_dropped\":0") != NULL,
        "stats JSON has cache_frames_given and cache_records_dropped, 0 on a CPU engine");
  CHECK(strstr(js, "\"growths_deferred\":") != NULL && strstr(js, "\"growth_waits\":0") != NULL,
        "stats JSON has growths_deferred and growth_waits (0 on a CPU engine)");
  CHECK(strstr(js, "\"decode_graphs\":0") != NULL, "stats JSON has decode_graphs, 0 on a CPU engine");
  wkv_free(js);
  EXPECT_ERR(wkv_engine_stats_json(NULL, &js), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_engine_stats_json(g_e, NULL), WKV_ERR_INVALID_ARGUMENT);
}

static void test_lifetime(void) {
  static const uint32_t chunks[] = {100};
  static const uint32_t more[] = {20};
  static float q[NQ * D], out[NQ * D];
  wkv_config c;
  wkv_engine *l = NULL;
  wkv_seq *la = NULL;
  wkv_plan *lp = NULL;
  ref_seq *ra = ref_new();
  const ref_seq *refs[1];
  wkv_xbuf_view xv;
  phase("lifetime");
  base_config(&c);
  c.retrieval_frac = 1.0f;
  c.estimation_frac = 0.0f;
  EXPECT_OK(wkv_engine_open(&c, &l));
  EXPECT_OK(wkv_seq_create(l, &la));
  EXPECT_OK(wkv_plan_create(l, &lp));
  append_chunks(la, LAYOUT_PACKED, NULL, LAYOUT_PACKED, ra, 0, chunks, 1);
  refs[0] = ra;

  /* The engine handle goes; its sequence and plan keep working. */
  wkv_engine_close(l);
  decode_and_check(lp, &la, refs, 1, 0, "decode after wkv_engine_close");
  append_chunks(la, LAYOUT_INTERLEAVED, NULL, LAYOUT_PACKED, ra, 0, more, 1);
  decode_and_check(lp, &la, refs, 1, 0, "append and decode after wkv_engine_close");

  /* The sequence goes; the plan's last lookup keeps its data. */
  random_q(q, 1);
  EXPECT_OK(wkv_lookup(lp, &la, 1, 0, q, 0, 0, NULL));
  EXPECT_OK(wkv_assemble(lp, NULL));
  wkv_seq_destroy(la);
  wkv_xbuf_view_init(&xv);
  EXPECT_OK(wkv_plan_xbuf(lp, &xv));
  check_full_xbuf(&xv, refs, 1, 0);
  EXPECT_OK(wkv_attend(lp, out, 0, 0, NULL, NULL));
  check_against_ref(out, q, refs, 1, 0, 1e-5, "attend after the sequence was destroyed");
  EXPECT_OK(wkv_update(lp, NULL));
  wkv_plan_destroy(lp);
  free(ra);
}

/* A sequence named by a lookup that failed its argument checks must not be
 * kept alive by it: destroying the sequence then releases it at once. */
static void test_release_after_failed_lookup(void) {
  float k[NKV * D], v[NKV * D], q[NQ * D];
  wkv_seq *t = NULL;
  wkv_seq *twice[2];
  wkv_plan *p = NULL;
  wkv_stats st;
  uint64_t before;
  uint32_t i;
  phase("release_after_failed_lookup");
  for (i = 0; i < NKV * D; ++i) k[i] = v[i] = frand();
  random_q(q, 1);
  wkv_stats_init(&st);
  EXPECT_OK(wkv_engine_stats(g_e, &st));
  before = st.sequences;
  EXPECT_OK(wkv_seq_create(g_e, &t));
  EXPECT_OK(wkv_seq_append(t, 0, k, v, 1, 0, 0, NULL));
  EXPECT_OK(wkv_plan_create(g_e, &p));
  twice[0] = t;
  twice[1] = t;
  EXPECT_ERR(wkv_lookup(p, twice, 2, 0, q, 0, 0, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_lookup(p, &t, 1, NL, q, 0, 0, NULL), WKV_ERR_OUT_OF_RANGE);
  wkv_seq_destroy(t);
  wkv_stats_init(&st);
  EXPECT_OK(wkv_engine_stats(g_e, &st));
  CHECK(st.sequences == before,
        "a destroyed sequence is released although a failed lookup named it (no plan refers to it)");
  wkv_plan_destroy(p);
}

/* A program built against wavekv 0.1 knows a shorter wkv_config: its
 * wkv_config_init writes no further, and the engine opens with that prefix. */
static void test_old_config(void) {
  const size_t old_size = offsetof(wkv_config, stats_path);
  union {
    wkv_config c;
    unsigned char raw[sizeof(wkv_config) + 64];
  } u;
  wkv_engine *e = NULL;
  size_t i;
  int untouched = 1;
  phase("old_config");
  memset(&u, 0xab, sizeof u);
  wkv_config_init_v0_1(&u.c);
  CHECK(u.c.size == old_size, "0.1's wkv_config_init sets 0.1's size");
  for (i = old_size; i < sizeof u.raw; ++i) untouched &= u.raw[i] == 0xab;
  CHECK(untouched, "0.1's wkv_config_init writes nothing past 0.1's struct");
  CHECK(u.c.seed == 0x5eed && u.c.segment_tokens == 8192, "0.1's fields get their defaults");
  u.c.n_layers = NL;
  u.c.n_q_heads = NQ;
  u.c.n_kv_heads = NKV;
  u.c.head_dim = D;
  EXPECT_OK(wkv_engine_open(&u.c, &e));
  memset(&u, 0xab, sizeof u);
  u.c.size = (uint32_t)old_size;
  EXPECT_OK(wkv_engine_config(e, &u.c));
  untouched = 1;
  for (i = old_size; i < sizeof u.raw; ++i) untouched &= u.raw[i] == 0xab;
  CHECK(untouched && u.c.n_layers == NL, "wkv_engine_config fills a 0.1 struct's prefix only");
  wkv_engine_close(e);
}

/* A program built against an older wavekv knows a shorter wkv_stats: its
 * wkv_stats_init writes no further, and wkv_engine_stats fills that prefix
 * (0.3's struct ended after evicted_sequences, 0.4's and 0.5's after
 * spill_write_errors). */
static void check_old_stats(void (*init)(wkv_stats *), size_t old_size, const char *version) {
  union {
    wkv_stats s;
    unsigned char raw[sizeof(wkv_stats) + 64];
  } u;
  wkv_config cfg;
  wkv_engine *e = NULL;
  size_t i;
  int untouched = 1;
  char what[128];
  memset(&u, 0xab, sizeof u);
  init(&u.s);
  snprintf(what, sizeof what, "%s's wkv_stats_init sets %s's size", version, version);
  CHECK(u.s.size == old_size, what);
  for (i = old_size; i < sizeof u.raw; ++i) untouched &= u.raw[i] == 0xab;
  snprintf(what, sizeof what, "%s's wkv_stats_init writes nothing past %s's struct", version, version);
  CHECK(untouched, what);
  snprintf(what, sizeof what, "%s's fields are zeroed", version);
  CHECK(u.s.evicted_sequences == 0, what);
  wkv_config_init(&cfg);
  cfg.n_layers = NL;
  cfg.n_q_heads = NQ;
  cfg.n_kv_heads = NKV;
  cfg.head_dim = D;
  EXPECT_OK(wkv_engine_open(&cfg, &e));
  EXPECT_OK(wkv_engine_stats(e, &u.s));
  untouched = 1;
  for (i = old_size; i < sizeof u.raw; ++i) untouched &= u.raw[i] == 0xab;
  snprintf(what, sizeof what, "wkv_engine_stats fills a %s struct's prefix only", version);
  CHECK(untouched && u.s.size == old_size, what);
  wkv_engine_close(e);
}

static void test_old_stats(void) {
  phase("old_stats");
  check_old_stats(wkv_stats_init_v0_3, offsetof(wkv_stats, spill_cold_pages), "0.3");
  check_old_stats(wkv_stats_init_v0_4, offsetof(wkv_stats, cache_frames_given), "0.4");
  check_old_stats(wkv_stats_init_v0_6, offsetof(wkv_stats, growths_deferred), "0.6");
  check_old_stats(wkv_stats_init_v0_7, offsetof(wkv_stats, decode_graphs), "0.7");
  check_old_stats(wkv_stats_init_v0_8, offsetof(wkv_stats, device_bytes_reserved), "0.8");
}

/* A program built against wavekv 0.1 to 0.5 knows a shorter wkv_seq_info
 * (it ended after pages): its wkv_seq_info_init writes no further, and
 * wkv_seq_info_get fills that prefix. */
static void test_old_seq_info(void) {
  const size_t old_size = offsetof(wkv_seq_info, evicted);
  union {
    wkv_seq_info s;
    unsigned char raw[sizeof(wkv_seq_info) + 64];
  } u;
  wkv_seq_info now;
  size_t i;
  int untouched = 1;
  phase("old_seq_info");
  memset(&u, 0xab, sizeof u);
  wkv_seq_info_init_v0_1(&u.s);
  CHECK(u.s.size == old_size, "0.1's wkv_seq_info_init sets 0.5's size");
  for (i = old_size; i < sizeof u.raw; ++i) untouched &= u.raw[i] == 0xab;
  CHECK(untouched, "0.1's wkv_seq_info_init writes nothing past 0.5's struct");
  CHECK(u.s.generating == 0 && u.s.tokens == 0 && u.s.pages == 0, "0.5's fields are zeroed");
  wkv_seq_info_init(&now);
  EXPECT_OK(wkv_seq_info_get(g_xa, 0, &now));
  EXPECT_OK(wkv_seq_info_get(g_xa, 0, &u.s));
  untouched = 1;
  for (i = old_size; i < sizeof u.raw; ++i) untouched &= u.raw[i] == 0xab;
  CHECK(untouched && u.s.size == old_size, "wkv_seq_info_get fills a 0.5 struct's prefix only");
  CHECK(now.tokens > 0 && memcmp(u.raw + 4, (const unsigned char *)&now + 4, old_size - 4) == 0,
        "a 0.5 struct gets the fields it knows, as the current struct has them");
}

/* Flips one bit of a file. */
static void flip_bit(const char *path, long offset) {
  FILE *f = fopen(path, "r+b");
  int c;
  CHECK(f != NULL, "open a file to corrupt it");
  fseek(f, offset, SEEK_SET);
  c = fgetc(f);
  fseek(f, offset, SEEK_SET);
  fputc(c ^ 0x10, f);
  fclose(f);
}

static void test_save_load(void) {
  const char *tmp = getenv("TMPDIR");
  char path[512], other_path[600];
  wkv_seq *back = NULL, *seqs[1];
  const ref_seq *refs[1];
  wkv_plan *p = NULL;
  wkv_engine *other = NULL;
  wkv_config c;
  wkv_seq_info a, b;
  FILE *f;
  uint32_t l;
  phase("save_load");
  snprintf(path, sizeof path, "%s/wavekv-c-api-test-%ld.wkv", tmp && *tmp ? tmp : "/tmp", (long)getpid());
  EXPECT_ERR(wkv_seq_save(NULL, path, 0), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_save(g_xa, NULL, 0), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_save(g_xa, path, 0x100), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_OK(wkv_seq_save(g_xa, path, 0));

  /* Loaded into the exact engine: every layer as before, decoding as exact
   * attention over the reference. */
  EXPECT_ERR(wkv_seq_load(NULL, path, &back), WKV_ERR_INVALID_HANDLE);
  EXPECT_ERR(wkv_seq_load(g_x, path, NULL), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_OK(wkv_seq_load(g_x, path, &back));
  CHECK(back != NULL && back != g_xa, "wkv_seq_load makes a new sequence");
  for (l = 0; l < NL; ++l) {
    wkv_seq_info_init(&a);
    wkv_seq_info_init(&b);
    EXPECT_OK(wkv_seq_info_get(g_xa, l, &a));
    EXPECT_OK(wkv_seq_info_get(back, l, &b));
    CHECK(memcmp(&a, &b, sizeof a) == 0, "a loaded layer holds what the saved one held");
  }
  EXPECT_OK(wkv_plan_create(g_x, &p));
  seqs[0] = back;
  refs[0] = g_ra;
  decode_and_check(p, seqs, refs, 1, 0, "decode a loaded sequence, layer 0");
  decode_and_check(p, seqs, refs, 1, 1, "decode a loaded sequence, layer 1");
  wkv_plan_destroy(p);
  wkv_seq_destroy(back);
  back = NULL;

  /* The descriptor forms: written from offset 0, read from offset 0. */
  snprintf(other_path, sizeof other_path, "%s.fd", path);
  f = fopen(other_path, "w+b");
  CHECK(f != NULL, "open a file for wkv_seq_save_fd");
  EXPECT_OK(wkv_seq_save_fd(g_xa, fileno(f), WKV_SAVE_NO_FSYNC));
  EXPECT_OK(wkv_seq_load_fd(g_x, fileno(f), &back));
  CHECK(back != NULL, "wkv_seq_load_fd makes a sequence");
  wkv_seq_destroy(back);
  back = NULL;
  EXPECT_ERR(wkv_seq_load_fd(g_x, -1, &back), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_ERR(wkv_seq_save_fd(g_xa, -1, 0), WKV_ERR_INVALID_ARGUMENT);
  fclose(f);
  remove(other_path);

  /* Another head_dim: refused, saying so. */
  base_config(&c);
  c.head_dim = 128;
  EXPECT_OK(wkv_engine_open(&c, &other));
  EXPECT_ERR(wkv_seq_load(other, path, &back), WKV_ERR_INVALID_ARGUMENT);
  CHECK(back == NULL, "no sequence from a refused file");
  CHECK(strstr(wkv_last_error(), "file has head_dim 64, engine 128") != NULL, "the difference is named");
  wkv_engine_close(other);

  /* A flipped bit; a missing file. */
  flip_bit(path, 1000);
  EXPECT_ERR(wkv_seq_load(g_x, path, &back), WKV_ERR_CORRUPT);
  CHECK(back == NULL && strstr(wkv_last_error(), "section") != NULL, "the corrupt section is named");
  remove(path);
  EXPECT_ERR(wkv_seq_load(g_x, path, &back), WKV_ERR_IO);
}

int main(void) {
  test_versions();
  test_defaults();
  test_open_errors();
  test_devices();
  test_open();
  test_sequences();
  test_append_errors();
  test_end_prompt();
  test_info_errors();
  test_decode_exact();
  test_split_path();
  test_merge();
  test_ordering();
  test_lookup_errors();
  test_budget();
  test_stats();
  test_lifetime();
  test_release_after_failed_lookup();
  test_old_config();
  test_old_stats();
  test_old_seq_info();
  test_save_load();

  phase("teardown");
  wkv_seq_destroy(g_ea);
  wkv_seq_destroy(g_eb);
  wkv_seq_destroy(g_xa);
  wkv_seq_destroy(g_xb);
  wkv_engine_close(g_e);
  wkv_engine_close(g_x);
  free(g_ra);
  free(g_rb);
  printf("c_api_test: %ld checks passed, %d skipped\n", g_checks, g_skipped);
  return 0;
}
