/*
 * wavekv: a KV-cache storage engine for long-context LLM inference.
 *
 * This header is the whole public contract of libwavekv. If something is not
 * described here, it is not API.
 *
 * Conventions
 * -----------
 * - Every fallible function returns an int status: WKV_OK (0) on success, one
 *   of the WKV_ERR_* codes otherwise. No function throws, aborts or exits.
 *   After a failure, wkv_last_error() returns a message in words for the
 *   calling thread; the library owns that string.
 * - Handles are opaque values, never addresses the caller may follow. Each
 *   has one create and one destroy function; destroying NULL, or a handle
 *   already destroyed, is a no-op. A destroyed handle, one of another type or
 *   a foreign value is refused with WKV_ERR_INVALID_HANDLE, also after its
 *   slot was reused by a new object.
 * - Structs that may grow begin with a `size` field. Fill them with the
 *   matching *_init function (which sets `size`); the library reads or writes
 *   only the prefix the caller's `size` covers. A program built against an
 *   older header keeps working: when a struct grows, its *_init function
 *   keeps the old size under the old symbol version (wkv_config grew in 0.2
 *   and 0.3: wkv_config_init@WAVEKV_0.1 writes 0.1's struct; wkv_stats grew
 *   in 0.3, 0.4, 0.6, 0.7 and 0.8: wkv_stats_init@WAVEKV_0.1 writes 0.2's,
 *   wkv_stats_init@WAVEKV_0.3 writes 0.3's, wkv_stats_init@WAVEKV_0.4
 *   writes 0.5's, wkv_stats_init@WAVEKV_0.6 writes 0.6's and
 *   wkv_stats_init@WAVEKV_0.7 writes 0.7's; wkv_seq_info grew in 0.6:
 *   wkv_seq_info_init@WAVEKV_0.1 writes 0.5's).
 * - Tensors are raw pointers in the engine's storage dtype (wkv_config.dtype),
 *   with explicit strides counted in elements, not bytes. On a CUDA engine
 *   they are device pointers and streams are cudaStream_t passed as void*
 *   (NULL: the default stream); a host pointer, a pointer or a stream of
 *   another device is refused with WKV_ERR_INVALID_ARGUMENT. On a CPU engine
 *   they are host pointers and the stream argument is ignored.
 * - Memory the library allocates for the caller is released with wkv_free().
 *
 * Threads: functions may be called from any thread. An engine may be used by
 * several threads at once provided that each wkv_seq and each wkv_plan is used
 * by one thread at a time. An engine also runs threads of its own, named so
 * that a runtime can find them (/proc/self/task/TID/comm, top -H, ps -L):
 * wkv-buffers (the buffer manager: replacement, admissions' bookkeeping),
 * wkv-pin-ahead (CUDA: pins the next host arena chunk before it is needed),
 * wkv-stats (with stats_path), wkv-cold (with cold pages), and the worker
 * threads of `threads`. The library binds none of them to a CPU; a runtime
 * that binds its decoding thread may bind these elsewhere (sched_setaffinity
 * with the thread's id), off the decoding thread's core and its SMT sibling.
 *
 * Fork: handles do not cross a fork(). A child process has none of its
 * parent's engine threads (nor its CUDA context), so there every call with a
 * handle made before the fork returns WKV_ERR_STATE, and destroying one
 * (wkv_seq_destroy, wkv_plan_destroy, wkv_engine_close, as a binding's
 * finalizers do when the child exits) ends the handle and releases nothing
 * of the parent's; it returns at once. A child opens CPU engines of its
 * own; CUDA cannot be used in a child forked after its parent initialised
 * it (a child that needs a CUDA engine execs, or is spawned). The parent's
 * handles are unaffected.
 *
 * Streams (CUDA): the work the engine enqueues for a sequence (its appends,
 * its growths, the steps that read it) runs in the order of the streams it
 * was given: appending to a sequence on one stream while a step that reads it
 * runs on another needs the caller's ordering (one stream, or events), as any
 * CUDA library's buffers do. Every call leaves the calling thread's current
 * CUDA device as it found it. Capturing a call into a CUDA graph is refused
 * (WKV_ERR_UNSUPPORTED, nothing enqueued, the capture left valid): a replay
 * would run a step as it was at capture, ignoring later appends and growths.
 * The exception is a bound plan's step (wkv_plan_bind, 0.9), which a runtime
 * captures and replays after a wkv_plan_prepare each.
 *
 * Memory is never freed under a reader: a destroyed sequence or plan, and
 * every buffer a growth replaces, is released in stream order once the steps
 * that were in flight when it was given up have ended, without waiting for
 * the device.
 *
 * The prompt of a layer, appended whole or in chunks, then ended so that its
 * index is built with the prefill rather than at the first decoding step:
 *
 *     wkv_seq_append(seq, layer, k, v, n_prompt, 0, 0, stream);
 *     wkv_seq_end_prompt(seq, layer, stream);
 *
 * A decoding step for one layer (letting wavekv attend):
 *
 *     wkv_seq_append(seq, layer, k, v, 1, 0, 0, stream);  // the new token
 *     wkv_decode(plan, &seq, 1, layer, q, 0, 0, out, 0, 0, stream);
 *
 * or, attending with the runtime's own kernel:
 *
 *     wkv_lookup(plan, &seq, 1, layer, q, 0, 0, stream);
 *     wkv_assemble(plan, stream);
 *     wkv_plan_xbuf(plan, &view);        // ragged K/V of the exact part
 *     ...run your kernel over view, producing out and its log-sum-exp...
 *     wkv_merge(plan, out, 0, 0, lse, 0, stream);
 *     wkv_update(plan, stream);
 */
#ifndef WAVEKV_H
#define WAVEKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define WKV_API __attribute__((visibility("default")))
#else
#define WKV_API
#endif

/* Versions ---------------------------------------------------------------- */

#define WKV_VERSION_MAJOR 0
#define WKV_VERSION_MINOR 13
#define WKV_VERSION_PATCH 0
/* The version as one number: major * 10000 + minor * 100 + patch. */
#define WKV_VERSION_NUMBER \
  (WKV_VERSION_MAJOR * 10000 + WKV_VERSION_MINOR * 100 + WKV_VERSION_PATCH)

/* The run-time library's version, in the WKV_VERSION_NUMBER encoding. */
WKV_API int wkv_version(void);
/* The run-time version as "major.minor.patch"; a static string. */
WKV_API const char *wkv_version_string(void);

/* Status codes ------------------------------------------------------------ */
/* Values are never renumbered or reused. */

enum {
  WKV_OK = 0,
  WKV_ERR_INVALID_ARGUMENT = 1, /* a null pointer, zero size, bad stride, bad value */
  WKV_ERR_INVALID_HANDLE = 2,   /* a null, destroyed or foreign handle */
  WKV_ERR_OUT_OF_RANGE = 3,     /* an index (layer, head, token) past its bound */
  WKV_ERR_UNSUPPORTED = 4,      /* a head_dim, dtype or device this build cannot serve */
  WKV_ERR_BUDGET = 5,           /* the configured byte budget would be exceeded */
  WKV_ERR_OUT_OF_MEMORY = 6,    /* the host or device allocator failed */
  WKV_ERR_DEVICE = 7,           /* the GPU runtime reported an error */
  WKV_ERR_IO = 8,               /* a file read or write failed */
  WKV_ERR_CORRUPT = 9,          /* a file failed its checksum or structure checks */
  WKV_ERR_STATE = 10,           /* a call out of order (assemble before lookup, ...) */
  WKV_ERR_INTERNAL = 11,        /* a bug in wavekv: please report it */
  WKV_ERR_NO_DEVICE = 12        /* a CUDA engine was asked for and no GPU is usable */
};

/* A static, human-readable name for a status code ("WKV_ERR_BUDGET"). */
WKV_API const char *wkv_status_name(int status);

/*
 * The message describing the last failure on the calling thread, or "" if
 * none. Owned by the library; valid until the next wavekv call on the same
 * thread.
 */
WKV_API const char *wkv_last_error(void);

/* Releases memory that wavekv allocated for the caller. NULL is a no-op. */
WKV_API void wkv_free(void *ptr);

/* Configuration ----------------------------------------------------------- */

enum {
  WKV_DTYPE_F32 = 0,  /* for tests and references */
  WKV_DTYPE_F16 = 1,
  WKV_DTYPE_BF16 = 2
};

enum {
  WKV_DEVICE_CPU = 0,  /* the CPU backend: host memory, all cores */
  WKV_DEVICE_CUDA = 1, /* a CUDA GPU (device_id picks which) */
  WKV_DEVICE_AUTO = 2  /* CUDA when this build and machine have a GPU, else CPU */
};

/* Bits of wkv_config.flags. */
enum {
  WKV_CONFIG_NO_NUMA = 1u << 0,   /* do not bind host arenas to a NUMA node */
  WKV_CONFIG_NO_PINNED = 1u << 1, /* use pageable host memory for arenas (CUDA;
                                     needs a device that reads pageable memory) */
  WKV_CONFIG_SPILL_NO_URING = 1u << 2, /* the spill file uses pread/pwrite even
                                          where io_uring is available */
  WKV_CONFIG_HOST_META_ROWS = 1u << 3  /* 0.12, CUDA: the meta index's f32 rows
                                          in pinned host memory (below) */
};

/*
 * WKV_CONFIG_HOST_META_ROWS (0.12). A CUDA engine's decoding steps read the
 * meta index in 8 bits a component (the centroids and value sums, about 280
 * bytes a cluster at head_dim 128 with each cluster's spread, size and
 * place), but it also keeps every cluster's f32 centroid and value sum
 * (8 * head_dim bytes: 1 KiB at 128), which saves write out and which a step
 * reads only where a row's 8-bit copy overflowed (a value not finite). By
 * default they live in device memory: 15.9% of a 16-bit KV's own bytes in
 * all, on the GPU. With this flag they live in pinned host memory that the
 * device maps (a CUDA memory pool on the GPU's NUMA node), which leaves
 * 3.4% on the GPU: 16 GiB less for a 1M-token sequence of 32 layers and 8
 * KV heads, room for a larger device cache. The cost: the same bytes of
 * host memory (outside host_budget_bytes), which is what bounds the batch
 * where every sequence's pages are in host memory (a quarter more than 8-bit
 * pages take); growths write the rows over PCIe, and a head's rows that
 * outgrow their region (at every half again of its clusters) are copied to
 * a larger one over PCIe both ways, on the stream of the append that grows
 * them; a step that reads an overflowed row reads it over PCIe. Results are
 * the same bits either way.
 * wkv_engine_open returns WKV_ERR_UNSUPPORTED where the device or driver has
 * no host memory pools (cudaDevAttrHostNumaMemoryPoolsSupported or
 * cudaDevAttrHostMemoryPoolsSupported; a CUDA runtime from 12.6 on), and
 * for WKV_DTYPE_F32 and WKV_PAGE_FORMAT_INT8_CENTERED, whose steps read the
 * f32 rows themselves; these hold for an engine that opens on a GPU, which
 * with WKV_DEVICE_AUTO depends on the machine. CPU engines keep
 * everything in host memory and ignore the flag.
 */

/*
 * Bits of wkv_config.method: refinements of the paper's method, each a
 * setting that one engine applies to every sequence (docs/accuracy.md says
 * what each does and what it was measured to give). 0 is the paper's method
 * as published; WKV_METHOD_DEFAULT, every refinement, is the default.
 */
enum {
  /* At clustering, a key far from its cluster's centroid (its squared
     distance above 1.5 times the segment's mean, at most 0.5% of a
     segment's keys) leaves the cluster as a cluster of one. Changes the
     index built. */
  WKV_METHOD_OUTLIERS = 1u << 0,
  /* Clusters of one member are ranked apart: the retrieval zone is
     retrieval_frac of the larger clusters plus retrieval_frac (at least one)
     of the clusters of one. */
  WKV_METHOD_ONES = 1u << 1,
  /* A cluster's logit gains half its members' logit variance (from its
     spread, the mean squared distance of its keys to the centroid), for
     scoring and estimation: the mean of exp(logit) over a cluster rather than
     Jensen's lower bound. */
  WKV_METHOD_SPREAD = 1u << 2,
  /* The clusters beyond the estimation zone are estimated too, their value
     taken as the head's mean value, instead of being dropped. */
  WKV_METHOD_TAIL = 1u << 3,
  WKV_METHOD_PAPER = 0u,
  WKV_METHOD_DEFAULT = WKV_METHOD_OUTLIERS | WKV_METHOD_ONES | WKV_METHOD_SPREAD | WKV_METHOD_TAIL
};

/*
 * How K and V rows are kept in pages (wkv_config.page_format, 0.10). Sink and
 * window rows, the execution buffer and every input and output stay in the
 * storage dtype whatever the pages hold.
 */
enum {
  /* Rows in the storage dtype, as appended. */
  WKV_PAGE_FORMAT_STORAGE = 0,
  /* Rows in 8 bits with one f32 scale each (the row's largest magnitude over
     127, values rounded to nearest even): about half the host memory, spill
     file, PCIe and device cache bytes of a 16-bit token (at head_dim 128 a
     page of page_bytes 2048 holds 15 tokens in a 4096-byte slot, against 8).
     Rows are quantized when a segment is clustered (the k-means and the
     cluster index see the rows as appended) and dequantized into the
     execution buffer, so attention to a retrieved token is to its 8-bit
     row; a row with a NaN or an infinity is kept as NaN. Files record the
     format, and load only into an engine of the same format. */
  WKV_PAGE_FORMAT_INT8 = 1,
  /* As WKV_PAGE_FORMAT_INT8, with each K row kept as its difference from
     its cluster's centroid rounded to f16 (the centroid added back when
     the row is read): keys share large offsets, which a plain row's scale
     spends its levels on. Same bytes a token; on the needle workload of
     `wavekv accuracy` about a third of INT8's error over 16-bit pages. A
     row whose centroid has a component that is not finite or lies outside
     f16's range is kept plain. 0.11. On a CUDA engine, decodes lay their
     rows out whatever WKV_DECODE_FROM_FRAMES says (see wkv_decode). */
  WKV_PAGE_FORMAT_INT8_CENTERED = 2
};

/*
 * Everything an engine is opened with. Call wkv_config_init() first: it sets
 * `size` and every default below, then set the model shape.
 *
 * The shape fields n_layers .. head_dim have no default and must be set.
 * Environment variables override fields at open time, for tuning without a
 * rebuild: WKV_THREADS, WKV_SEGMENT_TOKENS, WKV_UPDATE_SEGMENT_TOKENS,
 * WKV_CLUSTER_TOKENS, WKV_KMEANS_ITERS, WKV_SINK_TOKENS, WKV_WINDOW_TOKENS,
 * WKV_RETRIEVAL_FRAC, WKV_ESTIMATION_FRAC, WKV_HOST_BUDGET_BYTES,
 * WKV_HOST_CHUNK_BYTES, WKV_DEVICE_CACHE_BYTES, WKV_METHOD, WKV_PAGE_FORMAT. WKV_CACHE_POLICY
 * (no field) picks the device cache's replacement policy: lru (the
 * default), clock or slru. WKV_QUARANTINE (no field): which steps a frame
 * evicted from the device cache waits for before it is reused, readers (the
 * default: the steps seen reading unit map entries when its entry was
 * cleared) or steps (every step begun by then). WKV_CACHE_RESERVE (no
 * field): the free frames the buffer manager keeps, readers (the default:
 * what the steps running beside each other would miss) or burst (what every
 * layer's next step would). Other values are plain numbers:
 * integers in decimal or 0x hexadecimal that fit the field (32 or 64 bits),
 * fractions in decimal (0.05, 5e-2); no sign, spaces, size suffixes ("64M")
 * or anything after the number. A variable that is set but empty or
 * malformed fails wkv_engine_open with WKV_ERR_INVALID_ARGUMENT and a message
 * naming it. Whether set here or by a variable, fields must also lie within
 * these bounds (WKV_ERR_INVALID_ARGUMENT, naming the field and where its value
 * came from): segment_tokens and update_segment_tokens at most 65536;
 * cluster_tokens at most segment_tokens; sink_tokens and window_tokens at
 * most 2^20; threads at most 4096; host_chunk_bytes at most 1 TiB and at most
 * 2^32 - 1 page slots; host_budget_bytes 0 or at least one page slot;
 * device_cache_bytes at most 1 PiB; method only WKV_METHOD_* bits; page_format a
 * WKV_PAGE_FORMAT_* value. WKV_HOST_CHUNK_BYTES below 1 MiB is
 * refused rather than raised.
 *
 * Statistics file: when stats_path is set, the engine writes the JSON of
 * wkv_engine_stats_json() to that file at open and then every
 * stats_interval_ms from a thread of its own, until it closes; each time
 * the file is replaced whole (a temporary file beside it, mode 0600,
 * renamed over it), so a reader (`wavekv top FILE`) never sees half of one.
 * The path is copied at open and used as given (opened, never expanded);
 * a path that cannot be written fails wkv_engine_open with WKV_ERR_IO, one
 * that names what is not a regular file (a device such as /dev/stdout, a
 * FIFO, a directory) with WKV_ERR_INVALID_ARGUMENT, as wkv_seq_save's.
 * stats_interval_ms must lie in [10, 3600000] when stats_path is set.
 *
 * Spill file: when spill_dir is set, the engine opens its spill file in that
 * directory at open: an anonymous file (O_TMPFILE where the file system has
 * it, else a file of mode 0600 unlinked at once), so that nothing is left
 * behind when the engine closes or the process dies. It is read and written
 * with O_DIRECT where the file system allows (not tmpfs), through io_uring
 * where the kernel allows (not under a seccomp filter that forbids it, nor
 * with WKV_CONFIG_SPILL_NO_URING), else with pread and pwrite; wkv_stats
 * says which (spill_io). A directory that cannot hold the file fails
 * wkv_engine_open with WKV_ERR_IO.
 *
 * Cold pages (0.4; engines with both spill_dir and host_budget_bytes, CUDA
 * engines as well since 0.6.1):
 * a sequence may hold more KV than the budget. When a growth (an append or
 * the end of a prompt that clusters a segment) finds the budget full, the
 * sequence's coldest pages (those whose clusters were retrieved longest ago)
 * are written to the spill file first, in that call; at the end of a lookup
 * that leaves fewer pages free than a reserve (1/32 of the budget), more go
 * on a thread of the engine. A lookup that retrieves a cluster with a page
 * on disk estimates that cluster for the step (from its centroid and value
 * sum, as the estimation zone) and has its pages read back on that thread;
 * a later lookup of the layer attends it exactly. No call waits for those
 * reads. Pages the latest lookup of a layer retrieved are never written out.
 * A read back that fails its checksum or its I/O leaves the page on disk:
 * its clusters are estimated from then on and wkv_seq_save of the sequence
 * fails (WKV_ERR_CORRUPT or WKV_ERR_IO). A growth that needs more pages at
 * once than the budget holds (a segment of every KV head of a layer) fails
 * with WKV_ERR_BUDGET, as does one whose pages cannot leave because the
 * spill file is at spill_budget_bytes. wkv_stats counts all of it
 * (spill_cold_pages and after).
 *
 * On a CUDA engine the device decides what a step retrieves: a page out has
 * a null entry in the device's page table, the lookup estimates a
 * retrieval-zone cluster that has one and reports it, and the layer's next
 * lookup on the host asks for its pages (spill_estimated counts such a
 * cluster then). A sequence's verbs must reach the device in the order they
 * are called (one stream, or streams the caller orders), as for its
 * growths. Pages of a layer that any plan has looked up and not yet
 * assembled are never written out (a lookup no assemble follows holds them
 * until the plan's next lookup or its destruction); a growth that must
 * write pages out first waits for the gathers in flight that read them
 * (WKV_ERR_DEVICE if the device fails meanwhile).
 */
typedef struct wkv_config {
  uint32_t size;            /* sizeof(wkv_config), set by wkv_config_init */
  uint32_t device;          /* WKV_DEVICE_* (WKV_DEVICE_CPU) */
  int32_t device_id;        /* CUDA device ordinal (0) */
  uint32_t n_layers;        /* model layers (required) */
  uint32_t n_q_heads;       /* query heads (required) */
  uint32_t n_kv_heads;      /* KV heads; must divide n_q_heads (required) */
  uint32_t head_dim;        /* 64, 80, 96, 128 or 256 (required) */
  uint32_t dtype;           /* WKV_DTYPE_* of K, V, q and outputs (F16) */
  uint32_t segment_tokens;  /* prompt tokens clustered together (8192) */
  uint32_t update_segment_tokens; /* generated tokens clustered together (1024) */
  uint32_t cluster_tokens;  /* mean tokens per cluster (16) */
  uint32_t kmeans_iters;    /* k-means iterations (10) */
  uint32_t sink_tokens;     /* first tokens always attended (4) */
  uint32_t window_tokens;   /* most recent tokens always attended (64) */
  float retrieval_frac;     /* fraction of clusters attended exactly (0.018) */
  float estimation_frac;    /* fraction of clusters estimated (0.232) */
  uint32_t page_bytes;      /* bytes of K (and of V) per page (2048); with
                               8-bit pages, of K rows and their scales */
  uint32_t threads;         /* worker threads; 0 = one per core (0) */
  uint32_t flags;           /* WKV_CONFIG_* bits (0) */
  uint32_t page_format;     /* WKV_PAGE_FORMAT_* (STORAGE); 0.10, before it
                               reserved0, which had to be 0 */
  uint64_t host_budget_bytes;  /* cap on host page memory; 0 = unlimited (0) */
  uint64_t host_chunk_bytes;   /* host arena chunk size, at most 1 TiB; below
                                  1 MiB raised to 1 MiB (64 MiB) */
  uint64_t device_cache_bytes; /* GPU block cache; 0 = 5% of the device's memory (0) */
  uint64_t seed;               /* seed of k-means initialisation (0x5eed) */
  const char *stats_path;      /* statistics file, or NULL for none (NULL);
                                  wkv_engine_config returns the engine's copy */
  uint32_t stats_interval_ms;  /* how often it is replaced (1000) */
  uint32_t method;             /* WKV_METHOD_* bits (WKV_METHOD_DEFAULT) */
  uint32_t reserved1;          /* must be 0 */
  /* 0.3: the spill tier (wkv_seq_evict). */
  const char *spill_dir;       /* directory of the spill file, or NULL for no
                                  spill tier (NULL); wkv_engine_config returns
                                  the engine's copy */
  uint64_t spill_budget_bytes; /* cap on the spill file's bytes; 0 = unlimited (0) */
} wkv_config;

/* Fills *cfg with the defaults and sets cfg->size. NULL is a no-op. */
WKV_API void wkv_config_init(wkv_config *cfg);

/* Engine ------------------------------------------------------------------ */

typedef struct wkv_engine wkv_engine;

/*
 * Opens an engine. On success *out owns it until wkv_engine_close().
 * Returns WKV_ERR_INVALID_ARGUMENT for a null or malformed config (missing
 * shape, n_q_heads not a multiple of n_kv_heads, fractions outside [0, 1],
 * their sum above 1), WKV_ERR_UNSUPPORTED for an unsupported head_dim or
 * dtype, or CUDA in a CPU-only build, WKV_ERR_NO_DEVICE when CUDA was asked
 * for and no GPU is usable, WKV_ERR_OUT_OF_MEMORY.
 */
WKV_API int wkv_engine_open(const wkv_config *cfg, wkv_engine **out);

/*
 * Closes an engine handle. Sequences and plans made from it that are still
 * alive keep working and keep the engine's memory until the last of them is
 * destroyed; destroy them too. NULL is a no-op.
 */
WKV_API void wkv_engine_close(wkv_engine *engine);

/* Copies the engine's effective configuration (defaults resolved) into *cfg,
 * up to cfg->size bytes. cfg->size must be set by the caller. */
WKV_API int wkv_engine_config(const wkv_engine *engine, wkv_config *cfg);

/* Which backend the engine runs on: WKV_DEVICE_CPU or WKV_DEVICE_CUDA. */
WKV_API int wkv_engine_device(const wkv_engine *engine, uint32_t *device);

/* Statistics of one engine. Counters are totals since the engine opened. */
typedef struct wkv_stats {
  uint32_t size;               /* sizeof(wkv_stats), set by wkv_stats_init */
  uint32_t device;             /* WKV_DEVICE_* the engine runs on */
  uint64_t sequences;          /* live sequences */
  uint64_t tokens;             /* tokens held, summed over sequences and layers */
  uint64_t segments;           /* clustered segments, summed likewise */
  uint64_t clusters;           /* clusters in the meta index, summed likewise */
  uint64_t host_bytes_reserved;/* host arena bytes allocated (chunks) */
  uint64_t host_bytes_used;    /* host page bytes in use */
  uint64_t host_budget_bytes;  /* the cap, 0 = unlimited */
  uint64_t page_bytes;         /* bytes of one page slot (K and V) */
  uint64_t pages_used;         /* pages in use */
  uint64_t pages_free;         /* pages allocated but free */
  uint64_t steady_bytes;       /* bytes of steady-zone (sink + tail) storage */
  uint64_t meta_bytes;         /* bytes of the meta index */
  uint64_t lookups;            /* (sequence, layer) lookups served */
  uint64_t retrieved_clusters; /* clusters attended exactly, summed over lookups */
  uint64_t estimated_clusters; /* clusters estimated, summed over lookups */
  uint64_t attended_tokens;    /* tokens attended exactly, summed over lookups */
  uint64_t cache_hits;         /* retrieved units (page_tokens members of one
                                  cluster) read from the device cache */
  uint64_t cache_misses;       /* retrieved units read from host pages */
  uint64_t device_cache_bytes; /* device block cache size */
  uint64_t kmeans_ns;          /* time spent clustering, nanoseconds (wall
                                  time on the CPU, device time on a GPU) */
  uint64_t cache_admissions;   /* units admitted into the device cache (a miss
                                  is written there as it is assembled) */
  uint64_t cache_evictions;    /* units the device cache gave up */
  uint64_t manager_backlog;    /* decoding steps whose accesses the buffer
                                  manager has not yet applied (0: caught up) */
  uint64_t pin_fallbacks;      /* host arena chunks left pageable because
                                  pinning them failed (CUDA; the device reads
                                  them through HMM, more slowly) */
  /* 0.3: the spill tier. */
  uint64_t spill_io;           /* WKV_SPILL_IO_* bits; 0 without a spill file */
  uint64_t spill_bytes_used;   /* bytes of evicted data in the spill file
                                  (extents, 4 KiB aligned) */
  uint64_t spill_file_bytes;   /* the spill file's length */
  uint64_t spill_budget_bytes; /* the cap, 0 = unlimited */
  uint64_t spill_bytes_written;/* bytes written to it, since open */
  uint64_t spill_bytes_read;   /* bytes read back from it, since open */
  uint64_t evicted_sequences;  /* sequences whose pages are in the spill file */
  /* 0.4: cold pages (engines with a spill_dir and a host budget: pages
     of live sequences written to the spill file when the budget runs short,
     read back when a lookup wants them; see wkv_config.spill_dir). */
  uint64_t spill_cold_pages;   /* pages of live sequences in the spill file now */
  uint64_t spill_pages_written;/* cold pages written out, since open */
  uint64_t spill_pages_read;   /* cold pages read back, since open */
  uint64_t spill_estimated;    /* retrieval-zone clusters estimated instead
                                  because a page of theirs was on disk */
  uint64_t spill_read_errors;  /* cold pages whose read back failed (I/O or
                                  checksum): their clusters are estimated from
                                  then on, and saving the sequence fails */
  uint64_t spill_write_errors; /* writes of cold pages that failed (the pages
                                  stayed in memory) */
  /* 0.6: the device cache's admissions (CUDA engines; 0 on the CPU). */
  uint64_t cache_frames_given; /* free device cache frames decoding steps
                                  took from the buffer manager's pool for
                                  admissions, since open (a step takes one
                                  for each unit it misses while the pool has
                                  frames: misses beyond go unadmitted) */
  uint64_t cache_records_dropped; /* decoding steps that got no access record
                                  because the manager's record ring was full:
                                  their hits and misses are not applied (no
                                  admissions, no recency) */
  /* 0.7: index growth off the decoding path. */
  uint64_t growths_deferred;   /* generated segments whose growth began and
                                  was left to commit later, in the append
                                  that brings the layer past the segment's
                                  end plus the growth lag, since open */
  uint64_t growth_waits;       /* of those, commits whose clustering was not
                                  done at their commit point: the append
                                  waited for it (on a GPU, a host wait for the
                                  device), since open */
  /* 0.8: decode graphs (CUDA engines; 0 on the CPU). */
  uint64_t decode_graphs;      /* decoding steps (wkv_decode of one batch and
                                  layer) run as a replay of their plan's CUDA
                                  graph of the step's kernels, since open */
  /* 0.13: memory by where it lives (CUDA engines; 0 on the CPU, whose
     memory is all host memory: host_bytes_reserved and meta_bytes). */
  uint64_t device_bytes_reserved; /* device memory the engine holds: its
                                  memory pool's reservation (which keeps its
                                  peak: freed blocks stay for reuse, so
                                  k-means workspaces and destroyed sequences
                                  leave it where it was), the device cache,
                                  the buffer manager's blocks */
  uint64_t device_bytes_used;  /* of it, allocated now */
  uint64_t meta_device_bytes;  /* of meta_bytes, the bytes in device memory:
                                  all but the mapping table's host words and,
                                  where WKV_CONFIG_HOST_META_ROWS keeps them
                                  in host memory, the f32 rows */
  uint64_t meta_host_rows_reserved; /* pinned host memory the f32 meta rows'
                                  pool holds with WKV_CONFIG_HOST_META_ROWS
                                  (0 without), keeping its peak likewise, and
                                  not in host_bytes_reserved, the arena's */
} wkv_stats;

/* Bits of wkv_stats.spill_io. */
enum {
  WKV_SPILL_IO_URING = 1u << 0,  /* io_uring (else pread and pwrite) */
  WKV_SPILL_IO_DIRECT = 1u << 1  /* O_DIRECT (else through the page cache) */
};

/* Sets stats->size and zeroes the rest. NULL is a no-op. */
WKV_API void wkv_stats_init(wkv_stats *stats);

/* Fills *stats (up to stats->size bytes, which the caller sets). */
WKV_API int wkv_engine_stats(wkv_engine *engine, wkv_stats *stats);

/*
 * The engine's configuration and statistics as one JSON object, in a
 * NUL-terminated string that the caller releases with wkv_free(): "config",
 * "stats" (the fields of wkv_stats) and "buffer_manager" (its thread's
 * passes, records taken, busy time and the parts of it spent taking
 * records, choosing victims, clearing unit map entries, releasing
 * quarantined frames and publishing free frames, in nanoseconds;
 * "step_releases", the steps whose opening released quarantined frames
 * and published them on the calling thread; the reserve of free frames it
 * aims for; free, quarantined and resident frames). A busy time close to
 * the wall time says the manager falls behind the decoding steps.
 */
WKV_API int wkv_engine_stats_json(wkv_engine *engine, char **json);

/* Sequences --------------------------------------------------------------- */

typedef struct wkv_seq wkv_seq;

/* Creates an empty sequence in the engine. *out owns it until destroyed. */
WKV_API int wkv_seq_create(wkv_engine *engine, wkv_seq **out);

/*
 * Destroys a sequence and releases its pages. A plan that still refers to the
 * sequence keeps its data alive until the plan's next lookup or its
 * destruction; its memory goes once no step in flight reads it (the call
 * never waits for the device). NULL is a no-op.
 */
WKV_API void wkv_seq_destroy(wkv_seq *seq);

/*
 * Appends n_tokens tokens' keys and values for one layer. On a CUDA engine k
 * and v are device pointers read in order on `stream`; the call returns
 * without waiting for the copy, except when a segment completes and is
 * clustered (an index growth), which waits for the stream.
 *
 * k and v are [n_tokens][n_kv_heads][head_dim] in the engine's dtype, with
 * token_stride and head_stride in elements between consecutive tokens and
 * heads; 0 means packed: head_stride 0 is head_dim, token_stride 0 is
 * n_kv_heads * head_stride (tokens one after another, heads as given). The
 * head_dim elements of a row are contiguous; rows must not overlap. Keys are
 * post-RoPE.
 *
 * Before the sequence's first lookup on this layer (or wkv_seq_end_prompt),
 * appended tokens are the prompt (chunked prefill is fine): complete
 * segment_tokens runs beyond the sink and the window are clustered as they
 * complete (a CUDA engine gathers 16 of them per KV head first, so that a
 * prompt of up to 16 segments is clustered in one batch; until then their K
 * and V stay on the device: 16 x segment_tokens x 2 x head_dim x dtype bytes
 * per KV head and layer at most, 512 MiB at 8 KV heads, d=128, f16), and the
 * end of the
 * prompt clusters what remains beyond the window. After it, tokens are
 * generated ones: each update_segment_tokens run beyond the window is
 * clustered and appended to the index off the decoding path. The append
 * that completes the run begins its k-means (CUDA: on the engine's own
 * stream, after the append's copies, without waiting for the caller's
 * stream) and the run stays in the steady zone, attended exactly, until the
 * append that brings the layer 32 tokens further (the growth lag) commits
 * it. Where a segment is cut, and where its growth commits, never depends on
 * how the tokens were split into appends, on timing, on the backend, nor on
 * a save and load in between.
 *
 * Keys and values must be finite. A CPU engine checks every element and
 * refuses a NaN or an infinity, naming the sequence, token and head (one
 * such key would reach its cluster's centroid and silence its head at every
 * later step); a CUDA engine reads k and v on the device and does not check
 * them: there a non-finite key or value leaves its head's outputs undefined
 * from then on. The check comes once the append has room for its rows (an
 * impossible n_tokens is refused before a row is read): a refused append
 * stores no token, but it may have brought an evicted sequence back and
 * moved its rows, so a lookup made before it must be made again
 * (wkv_assemble says so). wkv_seq_load does not check a file's values.
 *
 * Returns WKV_ERR_INVALID_ARGUMENT (null k or v, n_tokens 0, a stride smaller
 * than a row, a NaN or an infinity on a CPU engine), WKV_ERR_OUT_OF_RANGE (layer), WKV_ERR_BUDGET (the host budget
 * cannot hold the pages), WKV_ERR_OUT_OF_MEMORY. On any error nothing is
 * appended and everything stored before is intact; an error of the growth
 * that the append commits fails the append (the run stays in the steady
 * zone, and the next append begins its growth again).
 */
WKV_API int wkv_seq_append(wkv_seq *seq, uint32_t layer, const void *k,
                           const void *v, uint32_t n_tokens,
                           int64_t token_stride, int64_t head_stride,
                           void *stream);

/*
 * Appends n_tokens tokens (1 while decoding; a few for speculative
 * decoding) to one layer of each of n_seqs sequences of one engine, in one
 * call: on a CUDA engine one kernel writes every sequence's rows (no driver
 * copy per sequence or head), so the host's cost hardly depends on the batch.
 * (0.5)
 *
 * Sequence i's keys are at k + i * seq_stride, laid out as wkv_seq_append's
 * ([n_tokens][n_kv_heads][head_dim], token_stride and head_stride in
 * elements, 0 packed); seq_stride in elements, 0 packed (the sequences one
 * after another; any other value is fine, sequences interleaved by token
 * for instance: the tensors are only read). The usual decoding layout, new K
 * of shape [batch][n_kv_heads][head_dim], is all strides 0. The sequences
 * must be distinct and of one engine; no other thread may use them during
 * the call.
 *
 * Everything wkv_seq_append says holds for each sequence: an evicted one is
 * restored first; a segment that completes is clustered (an index growth,
 * which waits for the stream on a CUDA engine).
 *
 * Errors: as wkv_seq_append, plus WKV_ERR_INVALID_ARGUMENT (seqs NULL,
 * n_seqs 0, a sequence listed twice, a negative seq_stride, a batch whose
 * extent 63 bits cannot address), WKV_ERR_INVALID_HANDLE (a destroyed sequence, sequences of two
 * engines). An error found before the copy (arguments, handles, restoring an
 * evicted sequence, room for the rows) appends nothing to any sequence. An
 * error in the growth of sequence i (WKV_ERR_BUDGET, WKV_ERR_OUT_OF_MEMORY;
 * the message names i) leaves sequences before i with their new tokens and
 * i and those after it without: append those again.
 *
 * On a stream being captured into a CUDA graph, with a bound plan's batch
 * (wkv_plan_bind: its sequences in their order, n_tokens 1), the append is
 * captured as a call of the plan's step; otherwise capture is refused, and
 * a bound sequence takes no append but its binding's (WKV_ERR_STATE).
 */
WKV_API int wkv_append_batch(wkv_seq *const *seqs, uint32_t n_seqs, uint32_t layer,
                             const void *k, const void *v, uint32_t n_tokens,
                             int64_t seq_stride, int64_t token_stride,
                             int64_t head_stride, void *stream);

/*
 * Ends the prompt of one layer now: clusters what the prompt holds beyond
 * the window, which the layer's first lookup does otherwise. Call it after a
 * layer's last prompt chunk so that the index build runs with the prefill,
 * not on the first decoding step. Waits for `stream` (an index growth); a
 * no-op for a layer already generating or holding no tokens. Returns WKV_ERR_INVALID_ARGUMENT
 * (unknown sequence, a stream of another device), WKV_ERR_OUT_OF_RANGE
 * (layer), WKV_ERR_BUDGET, WKV_ERR_OUT_OF_MEMORY; on an error the layer is
 * still in its prompt and holds every token it held.
 */
WKV_API int wkv_seq_end_prompt(wkv_seq *seq, uint32_t layer, void *stream);

/* What one layer of a sequence holds. */
typedef struct wkv_seq_info {
  uint32_t size;         /* sizeof(wkv_seq_info), set by wkv_seq_info_init */
  uint32_t generating;   /* 1 once the layer's prompt has ended
                            (wkv_seq_end_prompt or its first lookup) */
  uint64_t tokens;       /* tokens appended to this layer */
  uint64_t clustered;    /* tokens in clustered segments */
  uint64_t sink;         /* tokens in the sink */
  uint64_t tail;         /* unclustered recent tokens, attended exactly */
  uint64_t segments;     /* clustered segments, per KV head */
  uint64_t clusters;     /* clusters summed over KV heads */
  uint64_t pages;        /* pages summed over KV heads */
  /* 0.6 */
  uint32_t evicted;      /* 1 while the sequence is evicted (its pages in
                            the spill file; wkv_seq_restore or its next use
                            brings them back), else 0 */
  uint32_t reserved;     /* 0 (keeps spilled_pages 8-byte aligned) */
  uint64_t spilled_pages; /* pages of this layer (summed over KV heads)
                             whose bytes are in the spill file now: all of
                             them while evicted, else its cold pages */
} wkv_seq_info;

/* Sets info->size and zeroes the rest. NULL is a no-op. */
WKV_API void wkv_seq_info_init(wkv_seq_info *info);

/* Describes one layer of a sequence into *info (up to info->size bytes). */
WKV_API int wkv_seq_info_get(const wkv_seq *seq, uint32_t layer,
                             wkv_seq_info *info);

/* Sequence files ---------------------------------------------------------- */
/*
 * A sequence file holds one sequence (every layer's steady zone, index,
 * mapping and pages) and the settings that shaped it, each part with its
 * checksum; docs/FORMAT.md describes it. A file saved by a CPU engine loads
 * into a CUDA engine and the other way round. A loaded sequence decodes as
 * the saved one did: bit for bit on the same backend, within the dtype's
 * rounding across backends.
 */

/* Bits of the flags of wkv_seq_save and wkv_seq_save_fd. */
enum {
  WKV_SAVE_NO_FSYNC = 1u << 0 /* skip the fsyncs (tests, benchmarks): the
                                 file is still replaced whole or not at all
                                 for other processes, but a power loss may
                                 leave the old file, or a new one that
                                 wkv_seq_load refuses as corrupt */
};

/*
 * Saves a sequence to the file at `path`, crash-safe: the file is written
 * under a temporary name in the same directory (created with mode 0600),
 * fsynced, renamed over `path`, and the directory fsynced, so that `path`
 * holds either its previous contents or the whole new file, never a mix.
 * The path is only opened, never interpreted (no ~, no variables). A
 * symbolic link at `path` is replaced by the file, never followed (in a
 * shared directory another user's link would else send the file wherever
 * it points). A path that names a device, a FIFO, a socket or a directory
 * is refused before anything is written (renaming over it would put a
 * regular file in its place: /dev/null too). The sequence is copied one layer at a time (one layer's data in host memory
 * at a time); on a CUDA engine the call first waits for the work the
 * sequence's appends enqueued, and copies on a stream of the engine's own.
 * Other sequences keep decoding meanwhile; `seq` itself must not be used by
 * another thread until the call returns (as for every wkv_seq).
 *
 * Returns WKV_ERR_INVALID_ARGUMENT (null path, a path ending in '/', unknown
 * flags, a path that names a directory, device, FIFO or socket),
 * WKV_ERR_INVALID_HANDLE, WKV_ERR_IO (the system's words for a
 * failed create, write, fsync or rename: nothing is left at the temporary
 * name and `path` is untouched), WKV_ERR_OUT_OF_MEMORY, WKV_ERR_DEVICE.
 */
WKV_API int wkv_seq_save(const wkv_seq *seq, const char *path, uint32_t flags);

/*
 * Saves a sequence into `fd`, the caller's file open for writing: written
 * from offset 0 with pwrite (the file position is not used or moved),
 * truncated to the file's length and fsynced unless WKV_SAVE_NO_FSYNC; not
 * closed. No rename protects it: a failure leaves a file that wkv_seq_load
 * refuses. fd must be a regular file (not a pipe or socket). Errors as
 * wkv_seq_save's (WKV_ERR_INVALID_ARGUMENT for a negative fd).
 */
WKV_API int wkv_seq_save_fd(const wkv_seq *seq, int fd, uint32_t flags);

/*
 * Loads a sequence from the file at `path` into the engine, as a new
 * sequence that *out owns until wkv_seq_destroy(). All or nothing: the
 * sequence exists only once every layer has been read, checked and
 * imported; after any failure *out is NULL and the engine holds nothing of
 * the file. Every byte is checked against its checksum before it is used.
 *
 * Returns WKV_ERR_INVALID_ARGUMENT (null path or out; a path that is not a
 * regular file, refused at once: a FIFO is not waited on; a file whose shape or
 * layout settings differ from the engine's, naming each difference, e.g.
 * "file has head_dim 64, engine 128"; retrieval and estimation fractions,
 * cluster_tokens, kmeans_iters and seed may differ: the engine's apply from
 * then on), WKV_ERR_IO (the file cannot be opened or read: the system's
 * words), WKV_ERR_CORRUPT (not a sequence file, a failed checksum, a torn
 * or truncated file, values that contradict each other: the message names
 * the section), WKV_ERR_UNSUPPORTED (a format version newer than this
 * library reads, naming both), WKV_ERR_BUDGET, WKV_ERR_OUT_OF_MEMORY,
 * WKV_ERR_DEVICE.
 */
WKV_API int wkv_seq_load(wkv_engine *engine, const char *path, wkv_seq **out);

/*
 * Loads a sequence from `fd`, the caller's file open for reading, from
 * offset 0 with pread (the file position is not used or moved); not
 * closed. Errors as wkv_seq_load's (WKV_ERR_INVALID_ARGUMENT for a
 * negative fd, WKV_ERR_IO for one that is not a regular file).
 */
WKV_API int wkv_seq_load_fd(wkv_engine *engine, int fd, wkv_seq **out);

/*
 * Evicts a sequence: writes the pages of its clustered segments (every
 * layer and KV head) to the engine's spill file and gives their host memory
 * back. The meta index (centroids, value sums) and the steady zone (sink
 * and recent window) stay in memory. The call waits for the sequence's own
 * device work and for the writes; steps of plans already in flight keep
 * the pages they read until they end. A plan that looked the sequence up
 * before the eviction must look it up again (WKV_ERR_STATE otherwise).
 * Every extent written carries a checksum, checked when it is read back.
 *
 * An evicted sequence is restored by wkv_seq_restore or by its next use
 * (wkv_lookup, wkv_decode, wkv_seq_append, wkv_seq_end_prompt,
 * wkv_seq_save), which then pays for the reads. Evicting an evicted
 * sequence, or one without clustered segments, changes nothing and returns
 * WKV_OK. `seq` must not be used by another thread until the call returns.
 *
 * Returns WKV_ERR_STATE (the engine has no spill_dir), WKV_ERR_BUDGET (the
 * spill file would exceed spill_budget_bytes), WKV_ERR_IO (a failed write:
 * the system's words), WKV_ERR_INVALID_HANDLE, WKV_ERR_OUT_OF_MEMORY,
 * WKV_ERR_DEVICE. All or nothing: after a failure the sequence is as it
 * was, in memory, and the spill file holds nothing of it.
 */
WKV_API int wkv_seq_evict(wkv_seq *seq);

/*
 * Restores an evicted sequence: reads its pages back from the spill file
 * into host memory (and, on a CUDA engine, the device's page table), checks
 * every extent's checksum, and gives the spill file's space back. A
 * sequence in memory is left as it is (WKV_OK).
 *
 * Returns WKV_ERR_CORRUPT (an extent whose checksum fails: the message
 * names layer and head; nothing read is used, and the sequence stays
 * evicted, so every use of it fails the same way, while the engine's other
 * sequences are untouched), WKV_ERR_IO (a failed read; the sequence stays
 * evicted and a later call may succeed), WKV_ERR_BUDGET or
 * WKV_ERR_OUT_OF_MEMORY (no host pages for it; it stays evicted),
 * WKV_ERR_INVALID_HANDLE, WKV_ERR_DEVICE.
 */
WKV_API int wkv_seq_restore(wkv_seq *seq);

/* Plans: lookup, assemble, attend, merge, update -------------------------- */

typedef struct wkv_plan wkv_plan;

/*
 * Creates a plan: the reusable state of decoding steps (the selected zones,
 * the estimate, the execution buffer, the access record). Its buffers grow to
 * the largest step seen and are then reused, so a decoding loop allocates
 * nothing per step. A plan serves one step at a time. Whichever verb fails
 * (lookup, assemble, attend, merge, update, decode), the plan holds no step
 * afterwards: a later attend or merge is refused (WKV_ERR_STATE) rather than
 * answering with an earlier step's result.
 */
WKV_API int wkv_plan_create(wkv_engine *engine, wkv_plan **out);

/* Destroys a plan. NULL is a no-op. A bound plan (wkv_plan_bind) is
 * unbound first, which waits for the whole device. */
WKV_API void wkv_plan_destroy(wkv_plan *plan);

/*
 * Lookup: for each of n_seqs sequences at one layer, scores every cluster
 * against the query group of each KV head, selects the retrieval zone (the
 * top retrieval_frac of clusters) and the estimation zone (the next
 * estimation_frac), and computes the estimate of the estimation zone.
 *
 * q is [n_seqs][n_q_heads][head_dim] (post-RoPE) with seq_stride and
 * head_stride in elements (0 = packed, as in wkv_seq_append: seq_stride 0
 * is n_q_heads * head_stride); it is copied, so it may change after
 * the call. Query head h belongs to KV head h / (n_q_heads / n_kv_heads).
 * The plan keeps a reference to each sequence until its next lookup.
 *
 * Returns WKV_ERR_INVALID_ARGUMENT (null seqs or q, n_seqs 0, a sequence
 * listed twice, a sequence with no tokens at this layer, a NaN or an infinity
 * in q on a CPU engine: as for keys, a CUDA engine does not check q),
 * WKV_ERR_INVALID_HANDLE
 * (a sequence of another engine), WKV_ERR_OUT_OF_RANGE (layer),
 * WKV_ERR_BUDGET / WKV_ERR_OUT_OF_MEMORY (clustering the prompt's remainder).
 * On any failure the plan holds no step (assemble and attend need a new
 * lookup). Everything is checked before anything changes: a refused lookup
 * ends no prompt.
 */
WKV_API int wkv_lookup(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs,
                       uint32_t layer, const void *q, int64_t seq_stride,
                       int64_t head_stride, void *stream);

/*
 * Assemble: lays out the exact part of the plan (steady zone and retrieval
 * clusters) in the plan's execution buffer, reading pages from wherever they
 * are (device cache, host arena). Requires a lookup, and that no sequence of
 * the plan was appended to since, nor had its rows moved by an append that
 * was refused (WKV_ERR_STATE otherwise: look up again).
 */
WKV_API int wkv_assemble(wkv_plan *plan, void *stream);

/*
 * The execution buffer, as laid out by wkv_assemble.
 *
 * Ragged, one run of tokens per (sequence, KV head), run r = s * n_kv_heads + h
 * for the s-th sequence of the lookup:
 *
 *     offsets[r] .. offsets[r + 1]   the run's tokens (offsets has n_runs + 1
 *                                    entries, offsets[0] = 0)
 *     k[t * head_dim + i]            key of token t, element i
 *     v[t * head_dim + i]            value of token t, element i
 *
 * in the engine's dtype. The order of tokens within a run is unspecified (the
 * steady zone first, then the retrieval clusters). Keys are post-RoPE, so a
 * kernel attends to a run as a plain non-causal set. The pointers are on the
 * engine's device and stay valid until the plan's next lookup or assemble.
 */
typedef struct wkv_xbuf_view {
  uint32_t size;          /* sizeof(wkv_xbuf_view), set by wkv_xbuf_view_init */
  uint32_t n_runs;        /* n_seqs * n_kv_heads */
  uint64_t n_tokens;      /* offsets[n_runs] (CPU); on a CUDA engine the
                             buffer's capacity, a bound on offsets[n_runs],
                             which is known on the device only */
  uint32_t head_dim;
  uint32_t dtype;         /* WKV_DTYPE_* */
  const void *k;          /* [n_tokens][head_dim] */
  const void *v;          /* [n_tokens][head_dim] */
  const int32_t *offsets; /* [n_runs + 1] */
} wkv_xbuf_view;

/* Sets view->size and zeroes the rest. NULL is a no-op. */
WKV_API void wkv_xbuf_view_init(wkv_xbuf_view *view);

/* Describes the plan's execution buffer into *view. Requires an assemble
 * (WKV_ERR_STATE otherwise, and after a CUDA engine's wkv_decode that
 * attended from where the rows live: see wkv_decode). */
WKV_API int wkv_plan_xbuf(const wkv_plan *plan, wkv_xbuf_view *view);

/*
 * Attend: exact attention of each query head over its run of the execution
 * buffer, merged in log space with the estimate of the estimation zone.
 * out is [n_seqs][n_q_heads][head_dim] in the engine's dtype with seq_stride
 * and head_stride in elements (0 = packed). lse, if not NULL, receives
 * [n_seqs][n_q_heads] floats: the natural log-sum-exp of the merged softmax
 * denominator (scores scaled by 1/sqrt(head_dim)). Requires an assemble.
 */
WKV_API int wkv_attend(wkv_plan *plan, void *out, int64_t seq_stride,
                       int64_t head_stride, float *lse, void *stream);

/*
 * Merge: folds the estimate into an output the caller attended itself over
 * the execution buffer. out is as in wkv_attend and is updated in place; lse
 * is the caller's [n_seqs][n_q_heads] natural log-sum-exp of scaled scores
 * (lse_seq_stride floats between sequences, 0 = n_q_heads), updated in place
 * to the merged value. Requires a lookup.
 */
WKV_API int wkv_merge(wkv_plan *plan, void *out, int64_t seq_stride,
                      int64_t head_stride, float *lse, int64_t lse_seq_stride,
                      void *stream);

/*
 * Update: closes the step. The step's access record (the cache units it read,
 * the misses it admitted into free cache frames as it assembled) was opened
 * by wkv_assemble and is taken by the buffer manager once the step's kernels
 * have ended, off the critical path, whether or not update is called: a step
 * abandoned after its assemble pins nothing for longer than its kernels run.
 * Requires an assemble (WKV_ERR_STATE otherwise); enqueues nothing.
 */
WKV_API int wkv_update(wkv_plan *plan, void *stream);

/*
 * Decode: lookup, assemble, attend and update in one call. Arguments as in
 * wkv_lookup and wkv_attend. On a CUDA engine (without cold pages) the step
 * is one launch: a replay of the plan's CUDA graph of the step's kernels,
 * whose first kernel reads what changes between steps (query, run table,
 * epoch, access record, out and its strides) from the slot of a ring in
 * pinned host memory that the call has just written. The graph is made the
 * second time in a row the batch's shape comes (its sequences' count and
 * the bounds of their indexes, rounded up) and made again when the shape or
 * a buffer of the plan changes, so a plan whose batch changes at every step
 * launches its kernels one by one; so does a step whose slot (of 64) is
 * still read by a step 64 replays earlier that has not ended. A graph the
 * driver refuses is tried again after a backoff. Results are the same
 * either way; wkv_stats.decode_graphs counts the replays. In the
 * environment, read when the engine opens: WKV_DECODE_GRAPHS=0 turns graphs
 * off; WKV_DECODE_RING=0 stages each replay in a launch of its own instead
 * of the ring (two launches a step). Inside the graph the estimate runs
 * beside the gather, one stream priority below the device's highest (which
 * the engine's cache management keeps); the other kernels keep the
 * priority of `stream`, which is part of what the graph is made for (a
 * plan whose steps alternate between streams of two priorities launches
 * one by one). WKV_DECODE_FORK=0: one stream order, at the priority of the
 * stream a replay is launched on.
 *
 * With WKV_DECODE_FROM_FRAMES=1 (read when the engine opens; off by
 * default) the decode's attention reads each row where it lives (a frame
 * of the device cache, the host pages of a miss, the steady zone) and the
 * execution buffer is not laid out: after the decode, wkv_plan_xbuf and
 * wkv_attend return WKV_ERR_STATE until an assemble (the results are
 * those of lookup, assemble and attend either way, bit for bit).
 *
 * A bound plan (wkv_plan_bind) decodes only on a stream being captured,
 * its batch in its order: the decode is captured as a call of its step.
 */
WKV_API int wkv_decode(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs,
                       uint32_t layer, const void *q, int64_t q_seq_stride,
                       int64_t q_head_stride, void *out, int64_t out_seq_stride,
                       int64_t out_head_stride, void *stream);

/* Steps a runtime captures (0.9) ----------------------------------------- */

/*
 * A plan bound to a batch serves a decoding step that a runtime captures
 * into a CUDA graph of its own (with the rest of its model) and replays
 * token after token, each replay preceded by one host call:
 *
 *     wkv_plan_bind(plan, seqs, n, max_steps, stream);
 *     cudaStreamBeginCapture(stream, ...);
 *     for each layer l:                        // in the model's order
 *       ...the runtime's kernels writing k_l, v_l, q_l...
 *       wkv_append_batch(seqs, n, l, k_l, v_l, 1, 0, 0, 0, stream);
 *       wkv_decode(plan, seqs, n, l, q_l, 0, 0, out_l, 0, 0, stream);
 *       ...the runtime's kernels reading out_l...
 *     cudaStreamEndCapture(stream, &graph);  cudaGraphInstantiate(&exec, graph, 0);
 *     per token:
 *       wkv_plan_prepare(plan, stream);        // then, at once:
 *       cudaGraphLaunch(exec, stream);
 *     wkv_plan_unbind(plan, stream);
 *
 * The captured calls are the usual verbs on a stream being captured, with
 * the bound batch (its sequences in their order, one token each for
 * appends); any layers, each at most one append and one decode, in any
 * order: the capture records the step's calls (its program). The captured
 * kernels read what changes from a step to the next (where each row lands,
 * the run tables as appends and growths change them, the step's epochs and
 * access records) from the slots that wkv_plan_prepare writes; the tensors
 * (k, v, q, out, with their strides) are the capture's, as for any kernel a
 * runtime captures. Every replay's appends land and its results are those
 * of the uncaptured verbs given the same tokens and queries, across index
 * growths (at most, after a layer's runs outgrow the selection's split of
 * their capture, a difference in the last bits of sums taken in another
 * order). The host's work per token is wkv_plan_prepare's, the device's a
 * graph of the captured kernels: no launch of wavekv's own, no host
 * synchronization (a growth's commit or k-means begun in a prepare enqueues
 * its few kernels on `stream` before the replay).
 *
 * What the runtime must do (the engine checks it on the device, below):
 * - launch the graph once after each wkv_plan_prepare, on the stream given
 *   to prepare, before the next prepare; prepare may run up to 16 steps
 *   ahead of the device (it waits beyond);
 * - capture the step once per binding, every call of it in the graph;
 * - keep the plan, the sequences' engine and the captured tensors alive
 *   while a graph may be replayed; destroying the plan (or closing the
 *   engine) frees memory the graph reads: a replay after it is undefined.
 *
 * What invalidates a captured step: wkv_plan_unbind (and a later binding
 * of the plan); a fault found on the device: a replay without a prepare
 * before it, a replay missing a captured call or running them out of the
 * captured order, a graph captured under an earlier binding of the plan
 * replayed, a prepare before the previous step's replay was launched. A
 * faulted binding never gives a wrong result: from the fault on, every
 * replay does no work (appends nothing, reads nothing), writes NaN to its
 * outputs, and wkv_plan_prepare fails with WKV_ERR_STATE naming the fault;
 * wkv_plan_unbind then takes back what was counted and never written.
 * While bound, the batch cannot change under the capture: its sequences
 * refuse every other append, lookup, prompt end, save and eviction, and
 * the plan every other step (WKV_ERR_STATE); destroying a sequence's
 * handle leaves the sequence to the binding until it ends.
 */

/*
 * Binds the plan to n_seqs sequences of its engine (distinct, in the order
 * captured calls will list them) for max_steps more tokens each (0: 4096).
 * Every layer of every sequence must hold tokens (bind after the prompts);
 * evicted sequences are restored and the layers' prompts ended (as a lookup
 * would: this waits for `stream`). The plan's device buffers and the slots
 * of the captured calls are reserved here for the largest index the
 * sequences can reach within max_steps (no allocation happens during the
 * capture or the replays). CUDA engines without cold pages
 * (WKV_ERR_UNSUPPORTED otherwise). Returns WKV_ERR_STATE (the plan, or a
 * sequence, bound already), WKV_ERR_INVALID_ARGUMENT (null or repeated
 * sequences, a layer without tokens, a stream of another device),
 * WKV_ERR_UNSUPPORTED (a stream being captured), WKV_ERR_INVALID_HANDLE,
 * WKV_ERR_OUT_OF_MEMORY, WKV_ERR_BUDGET; on an error the plan is not bound
 * (prompts ended stay ended).
 */
WKV_API int wkv_plan_bind(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs, uint32_t max_steps,
                          void *stream);

/*
 * Prepares the next replay of the captured step: for each captured call,
 * in order, what the uncaptured verb does on the host (a growth's commit at
 * its point, room for the new rows, the run table, the step's epoch and
 * access record), written to the call's next slot; growths whose segments
 * the previous step completed begin their k-means (their work, and a
 * commit's, enqueued on `stream` ahead of the replay). Call it, then
 * launch the graph on `stream`. The appends' tokens count from here (as an
 * uncaptured append's count at its call). Returns WKV_ERR_UNSUPPORTED (a
 * stream being captured), WKV_ERR_STATE (not bound,
 * nothing captured, a fault found on the device: its message names it, a
 * step that outgrew the binding's reserve, the step prepared 16 steps
 * before not ended within 30 s), WKV_ERR_BUDGET (max_steps prepared),
 * WKV_ERR_OUT_OF_MEMORY; on an error nothing of the step is prepared (its
 * calls' rows are taken back) and the graph must not be launched for it.
 */
WKV_API int wkv_plan_prepare(wkv_plan *plan, void *stream);

/*
 * Ends the binding: waits for `stream` (the replays'), takes back the
 * tokens of steps prepared and never replayed (and, after a fault, the
 * growths begun meanwhile, which begin again), and frees the sequences and
 * the plan for other use. A graph captured under the binding faults if
 * replayed later (no work, NaN). Returns WKV_ERR_STATE (not bound),
 * WKV_ERR_UNSUPPORTED (a stream being captured), WKV_ERR_INVALID_ARGUMENT
 * (a stream of another device), WKV_ERR_DEVICE. wkv_plan_destroy of a bound plan unbinds it,
 * waiting for the whole device.
 */
WKV_API int wkv_plan_unbind(wkv_plan *plan, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* WAVEKV_H */
