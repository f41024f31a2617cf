/*
 * libwavekv loaded the way language runtimes load it: with dlopen, into a
 * process whose C++ runtime is already loaded and in use by someone else
 * (here libstdc++ opened with RTLD_LOCAL first, as a Python extension module
 * such as NumPy's or PyTorch's brings it in). Every error path and
 * wkv_engine_stats_json must work there: a libwavekv that replaced the
 * process's allocator crashed in both.
 *
 *     loader_test LIBWAVEKV [LIBSTDCXX]
 *
 * Exit status 0 when every check passes, 1 otherwise.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wavekv/wavekv.h"

static int failures = 0;

#define CHECK(cond, ...)                          \
  do {                                            \
    if (!(cond)) {                                \
      fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);               \
      fprintf(stderr, "\n");                      \
      ++failures;                                 \
    }                                             \
  } while (0)

typedef void (*config_init_fn)(wkv_config *);
typedef int (*engine_open_fn)(const wkv_config *, wkv_engine **);
typedef void (*engine_close_fn)(wkv_engine *);
typedef int (*stats_json_fn)(wkv_engine *, char **);
typedef const char *(*last_error_fn)(void);
typedef void (*free_fn)(void *);
typedef int (*seq_create_fn)(wkv_engine *, wkv_seq **);
typedef void (*seq_destroy_fn)(wkv_seq *);
typedef int (*seq_append_fn)(wkv_seq *, uint32_t, const void *, const void *, uint32_t, int64_t, int64_t,
                             void *);

static void *sym(void *lib, const char *name) {
  void *p = dlsym(lib, name);
  if (!p) {
    fprintf(stderr, "missing symbol %s: %s\n", name, dlerror());
    exit(1);
  }
  return p;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s LIBWAVEKV [LIBSTDCXX]\n", argv[0]);
    return 2;
  }
  /* 1. Someone else's C++ runtime, loaded privately, and in use: it
   *    allocates with its own operator new before and after libwavekv. */
  const char *cxx = argc > 2 ? argv[2] : "libstdc++.so.6";
  void *stdcxx = dlopen(cxx, RTLD_NOW | RTLD_LOCAL);
  if (!stdcxx) {
    fprintf(stderr, "cannot load %s: %s\n", cxx, dlerror());
    return 1;
  }
  void *(*cxx_new)(size_t) = (void *(*)(size_t))sym(stdcxx, "_Znwm");
  void (*cxx_delete)(void *) = (void (*)(void *))sym(stdcxx, "_ZdlPv");
  void *before = cxx_new(1000);
  void *before_c = malloc(1000);

  /* 2. libwavekv, privately too. */
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
    return 1;
  }
  config_init_fn config_init = (config_init_fn)sym(lib, "wkv_config_init");
  engine_open_fn engine_open = (engine_open_fn)sym(lib, "wkv_engine_open");
  engine_close_fn engine_close = (engine_close_fn)sym(lib, "wkv_engine_close");
  stats_json_fn stats_json = (stats_json_fn)sym(lib, "wkv_engine_stats_json");
  last_error_fn last_error = (last_error_fn)sym(lib, "wkv_last_error");
  free_fn wkv_free_ = (free_fn)sym(lib, "wkv_free");
  seq_create_fn seq_create = (seq_create_fn)sym(lib, "wkv_seq_create");
  seq_destroy_fn seq_destroy = (seq_destroy_fn)sym(lib, "wkv_seq_destroy");
  seq_append_fn seq_append = (seq_append_fn)sym(lib, "wkv_seq_append");

  /* 3. Error paths: each builds and frees a message. */
  wkv_config cfg;
  config_init(&cfg);
  cfg.n_layers = 1;
  cfg.n_q_heads = 4;
  cfg.n_kv_heads = 3;
  cfg.head_dim = 64;
  cfg.threads = 1;
  wkv_engine *e = NULL;
  for (int i = 0; i < 100; ++i) {
    int rc = engine_open(&cfg, &e);
    CHECK(rc == WKV_ERR_INVALID_ARGUMENT, "open with 4 q heads over 3 kv heads: %d", rc);
    CHECK(strstr(last_error(), "n_kv_heads") != NULL, "message: %s", last_error());
  }
  cfg.n_kv_heads = 2;
  cfg.head_dim = 65;
  CHECK(engine_open(&cfg, &e) == WKV_ERR_UNSUPPORTED, "head_dim 65");
  cfg.head_dim = 64;
  cfg.dtype = WKV_DTYPE_F32;

  /* 4. A working engine: stats as JSON, an append, an error on a live
   *    sequence. */
  int rc = engine_open(&cfg, &e);
  CHECK(rc == WKV_OK, "open: %s", last_error());
  if (rc == WKV_OK) {
    for (int i = 0; i < 100; ++i) {
      char *json = NULL;
      rc = stats_json(e, &json);
      CHECK(rc == WKV_OK && json && json[0] == '{', "stats_json: %d %s", rc, last_error());
      wkv_free_(json);
    }
    wkv_seq *s = NULL;
    CHECK(seq_create(e, &s) == WKV_OK, "seq_create: %s", last_error());
    float kv[2 * 64] = {0};
    for (int i = 0; i < 2 * 64; ++i) kv[i] = (float)(i % 7) - 3.0f;
    CHECK(seq_append(s, 0, kv, kv, 1, 0, 0, NULL) == WKV_OK, "append: %s", last_error());
    CHECK(seq_append(s, 7, kv, kv, 1, 0, 0, NULL) == WKV_ERR_OUT_OF_RANGE, "append to layer 7");
    CHECK(seq_append(s, 0, NULL, kv, 1, 0, 0, NULL) == WKV_ERR_INVALID_ARGUMENT, "append of NULL k");
    seq_destroy(s);
    engine_close(e);
  }

  /* 5. The other runtime's and the C allocator's memory is still theirs. */
  cxx_delete(before);
  free(before_c);
  void *after = cxx_new(5000);
  cxx_delete(after);
  dlclose(lib);
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("loader_test: libwavekv loaded beside a private C++ runtime: all checks passed\n");
  return 0;
}
