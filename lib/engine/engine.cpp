#include "lib/engine/engine.hpp"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "lib/buffer/replacement.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"
#include "lib/index/growth.hpp"

namespace wkv {

static_assert(static_cast<uint32_t>(DType::kF32) == WKV_DTYPE_F32 &&
                  static_cast<uint32_t>(DType::kF16) == WKV_DTYPE_F16 &&
                  static_cast<uint32_t>(DType::kBF16) == WKV_DTYPE_BF16,
              "the kernels' dtypes are the ABI's");

#if defined(WKV_WITH_CUDA)
// The CUDA backend, when the build has it; fills *out or returns why not.
Status make_cuda_backend(Engine &engine, std::unique_ptr<Backend> *out, HostArena::Options *arena_opts);
bool cuda_device_usable(int device_id);
#endif

// An environment variable that picks one of two behaviours: *second is
// whether it names `second` (unset: `first`); any other value is an error
// naming the variable and both choices.
static Status env_choice(const char *var, const char *first, const char *second, bool *is_second) {
  const char *v = std::getenv(var);
  *is_second = v && std::strcmp(v, second) == 0;
  if (v && !*is_second && std::strcmp(v, first) != 0)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "environment variable %s='%s' is neither '%s' nor '%s'", var, v,
                     first, second);
  return Status::ok();
}

Status Engine::open(const wkv_config *user, std::shared_ptr<Engine> *out) {
  Config cfg;
  WKV_RETURN_IF_ERROR(resolve_config(user, &cfg));
  // The device cache's replacement policy (lib/buffer/replacement.hpp).
  const char *policy = std::getenv("WKV_CACHE_POLICY");
  if (!policy) policy = "lru";
  if (!make_policy(policy, 1))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                     "environment variable WKV_CACHE_POLICY='%s' is not a replacement policy (lru, clock or slru)",
                     policy);
  // Which steps a frame evicted from the device cache waits for before it
  // is reused (lib/buffer/buffer_manager.hpp, "Quarantine"): those seen
  // reading unit map entries when it was cleared, or every step begun.
  bool every_step = false;
  WKV_RETURN_IF_ERROR(env_choice("WKV_QUARANTINE", "readers", "steps", &every_step));
  // The reserve of free frames it keeps (BufferManager::Options::Reserve):
  // for the steps that may take frames before an eviction's are free
  // (readers), or for a whole burst of a token's layers (burst).
  bool burst = false;
  WKV_RETURN_IF_ERROR(env_choice("WKV_CACHE_RESERVE", "readers", "burst", &burst));
  // The metadata allocator is loaded here (a dlopen, once a process), on
  // the opening thread, before the engine's pool and the callers' threads
  // append: not on the first append, where several threads may meet it.
  (void)meta_allocator_name();
  std::shared_ptr<Engine> e(new Engine());
  e->cfg_ = cfg;
  HostArena::Options ao;
  ao.page_bytes = cfg.page_slot_bytes();
  ao.chunk_bytes = cfg.c.host_chunk_bytes;
  ao.budget_bytes = cfg.c.host_budget_bytes;
  ao.numa_node = -1;

  uint32_t device = cfg.c.device;
#if defined(WKV_WITH_CUDA)
  if (device == WKV_DEVICE_AUTO) device = cuda_device_usable(cfg.c.device_id) ? WKV_DEVICE_CUDA : WKV_DEVICE_CPU;
  e->cfg_.c.device = device;
  if (device == WKV_DEVICE_CUDA) WKV_RETURN_IF_ERROR(make_cuda_backend(*e, &e->backend_, &ao));
#else
  if (device == WKV_DEVICE_AUTO) device = WKV_DEVICE_CPU;
  if (device == WKV_DEVICE_CUDA)
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "this build of wavekv has no CUDA backend (built without nvcc)");
  e->cfg_.c.device = device;
#endif
  try {
    e->pool_ = std::make_unique<ThreadPool>(cfg.c.threads);
    e->arena_ = std::make_unique<HostArena>(std::move(ao));
    if (device == WKV_DEVICE_CPU) e->backend_ = make_cpu_backend(*e);
    BufferManager::Options bo;
    bo.units = e->backend_->cache_units();
    bo.policy = policy;
    bo.reader_quarantine = !every_step;
    bo.reserve = burst ? BufferManager::Options::Reserve::kBurst : BufferManager::Options::Reserve::kReaders;
    e->buffers_ = std::make_unique<BufferManager>(bo, e->backend_->buffer_device());
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory opening an engine");
  }
  WKV_RETURN_IF_ERROR(e->buffers_->start());
  // The statistics file: its path copied (the caller's string may go), its
  // first publication made here so that a path that cannot be written fails
  // the open.
  if (cfg.c.stats_path) {
    try {
      e->stats_path_ = cfg.c.stats_path;
      e->cfg_.c.stats_path = e->stats_path_.c_str();
      Engine *raw = e.get();
      e->stats_publisher_ = std::make_unique<StatsPublisher>(e->io(), e->stats_path_, cfg.c.stats_interval_ms,
                                                             [raw] { return raw->stats_json(); });
    } catch (const std::bad_alloc &) {
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory opening an engine");
    }
    Status st = e->stats_publisher_->start();
    if (!st.is_ok()) return WKV_ERROR(st.code(), "stats_path: %s", st.message().c_str());
  }
  if (cfg.c.spill_dir) {
    SpillFile::Options so;
    try {
      e->spill_dir_ = cfg.c.spill_dir;
      e->cfg_.c.spill_dir = e->spill_dir_.c_str();
      so.dir = e->spill_dir_;
    } catch (const std::bad_alloc &) {
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory opening an engine");
    }
    so.budget_bytes = cfg.c.spill_budget_bytes;
    so.no_uring = (cfg.c.flags & WKV_CONFIG_SPILL_NO_URING) != 0;
    Status st = SpillFile::open(so, &e->spill_);
    if (!st.is_ok()) return WKV_ERROR(st.code(), "spill_dir: %s", st.message().c_str());
    // Cold pages of live sequences leave for the spill file under a host
    // budget (lib/engine/cold.hpp).
    if (e->cfg_.cold_pages()) {
      ColdTier::Options co;
      co.device = device != WKV_DEVICE_CPU;
      co.budget_pages = cfg.c.host_budget_bytes / cfg.page_slot_bytes();
      co.page_tokens = cfg.page_tokens();
      co.segment_pages =
          uint64_t(cfg.c.n_kv_heads) * ((cfg.c.segment_tokens + cfg.page_tokens() - 1) / cfg.page_tokens());
      try {
        e->cold_ = std::make_unique<ColdTier>(co, *e->spill_, *e->arena_, e->counters_, *e->backend_, *e->buffers_);
      } catch (const std::exception &) {
        return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of resources starting the spill tier's thread");
      }
    }
  }
  *out = std::move(e);
  return Status::ok();
}

Engine::~Engine() {
  // The arena's chunk thread first: its registration hook uses the engine's
  // fault injector, counters and backend, which go before the arena.
  if (arena_) arena_->stop_ahead();
}

void Engine::fill_stats(wkv_stats *out) {
  HostArena::Stats a = arena_->stats();
  BufferManager::Stats b = buffers_->stats();
  const uint64_t d = cfg_.c.head_dim;
  out->device = cfg_.c.device;
  out->sequences = counters_.sequences.load();
  out->tokens = counters_.tokens.load();
  out->segments = counters_.segments.load();
  out->clusters = counters_.clusters.load();
  out->host_bytes_reserved = a.bytes_reserved;
  out->host_bytes_used = a.pages_used * arena_->page_bytes();
  out->host_budget_bytes = cfg_.c.host_budget_bytes;
  out->page_bytes = arena_->page_bytes();
  out->pages_used = a.pages_used;
  out->pages_free = a.pages_total - a.pages_used;
  out->steady_bytes = counters_.steady_rows.load() * 2ull * cfg_.row_bytes();
  // Per cluster: centroid and value sum (f32), the spread, the mapping
  // table's three words (and on a device backend the mirror's three), and
  // with a 16-bit storage dtype the compact copies the steps read, each in 8
  // bits with a scale a row: on a CPU engine (while they are finite) the
  // centroids and the value means, on a device the centroids and the value
  // sums, or both in f16 where the device backend keeps 16-bit meta rows
  // or d is not a multiple of 32.
  // Not counted: the cold tier's stamps (a word a cluster on a device with
  // a spill file) and regions' spare capacity.
  uint64_t compact = 0;
  if (cfg_.dtype() != DType::kF32) {
    compact = backend_->host_memory() || meta_rows8(*backend_, d) ? 2 * (d + sizeof(float)) : 4 * d;
  }
  const uint64_t words = backend_->host_memory() ? 3 : 6;
  out->meta_bytes = out->clusters * ((2 * d + 1) * sizeof(float) + words * sizeof(uint32_t) + compact);
  // On a device, all of it but the mapping table's host words, and the f32
  // rows where WKV_CONFIG_HOST_META_ROWS keeps them in host memory.
  if (!backend_->host_memory()) {
    out->meta_device_bytes = out->meta_bytes - out->clusters * 3 * sizeof(uint32_t);
    if (backend_->mem_mapped_host(Backend::MemUse::kMetaRows))
      out->meta_device_bytes -= out->clusters * 2 * d * sizeof(float);
  }
  out->lookups = counters_.lookups.load();
  out->retrieved_clusters = counters_.retrieved_clusters.load();
  out->estimated_clusters = counters_.estimated_clusters.load();
  out->attended_tokens = counters_.attended_tokens.load();
  out->evicted_sequences = counters_.evicted_sequences.load();
  if (spill_) {
    out->spill_io = spill_->io_bits();
    out->spill_bytes_used = spill_->bytes_used();
    out->spill_file_bytes = spill_->file_bytes();
    out->spill_budget_bytes = spill_->budget_bytes();
    out->spill_bytes_written = spill_->bytes_written();
    out->spill_bytes_read = spill_->bytes_read();
  }
  out->spill_cold_pages = counters_.cold_pages.load();
  out->spill_pages_written = counters_.cold_pages_written.load();
  out->spill_pages_read = counters_.cold_pages_read.load();
  out->spill_estimated = counters_.cold_estimated.load();
  out->spill_read_errors = counters_.spill_read_errors.load();
  out->spill_write_errors = counters_.spill_write_errors.load();
  out->cache_hits = counters_.cache_hits.load();
  out->cache_misses = counters_.cache_misses.load();
  out->device_cache_bytes = 0;
  out->kmeans_ns = counters_.kmeans_ns.load();
  out->cache_admissions = b.admissions;
  out->cache_evictions = b.evictions;
  out->manager_backlog = b.backlog;
  out->cache_frames_given = b.given;
  out->cache_records_dropped = b.dropped_records;
  out->growths_deferred = counters_.growths_deferred.load();
  out->growth_waits = counters_.growth_waits.load();
  out->decode_graphs = counters_.decode_graphs.load();
  out->pin_fallbacks = counters_.pin_fallbacks.load();
  backend_->fill_stats(out);
}

// A float as the decimal it was written as (0.018, not 0.017999999225).
static double decimal(float x) { return std::strtod(format("%.7g", static_cast<double>(x)).c_str(), nullptr); }

std::string Engine::stats_json() {
  wkv_stats s;
  std::memset(&s, 0, sizeof s);
  s.size = sizeof s;
  fill_stats(&s);
  const wkv_config &c = cfg_.c;
  nlohmann::ordered_json config = {
      {"device", c.device == WKV_DEVICE_CUDA ? "cuda" : "cpu"},
      {"n_layers", c.n_layers},
      {"n_q_heads", c.n_q_heads},
      {"n_kv_heads", c.n_kv_heads},
      {"head_dim", c.head_dim},
      {"dtype", dtype_name(cfg_.dtype())},
      {"segment_tokens", c.segment_tokens},
      {"update_segment_tokens", c.update_segment_tokens},
      {"cluster_tokens", c.cluster_tokens},
      {"kmeans_iters", c.kmeans_iters},
      {"sink_tokens", c.sink_tokens},
      {"window_tokens", c.window_tokens},
      {"retrieval_frac", decimal(c.retrieval_frac)},
      {"estimation_frac", decimal(c.estimation_frac)},
      {"page_bytes", c.page_bytes},
      {"page_tokens", cfg_.page_tokens()},
      {"page_format", page_format_name(cfg_.c.page_format)},
      {"threads", pool_->threads()},
      {"host_budget_bytes", c.host_budget_bytes},
      {"host_chunk_bytes", c.host_chunk_bytes},
      {"method", c.method},
      {"metadata_allocator", meta_allocator_name()},
      {"spill_dir", c.spill_dir ? c.spill_dir : ""},
      {"spill_budget_bytes", c.spill_budget_bytes},
  };
  nlohmann::ordered_json stats = {
      {"sequences", s.sequences},
      {"tokens", s.tokens},
      {"segments", s.segments},
      {"clusters", s.clusters},
      {"host_bytes_reserved", s.host_bytes_reserved},
      {"host_bytes_used", s.host_bytes_used},
      {"pages_used", s.pages_used},
      {"pages_free", s.pages_free},
      {"steady_bytes", s.steady_bytes},
      {"meta_bytes", s.meta_bytes},
      {"lookups", s.lookups},
      {"retrieved_clusters", s.retrieved_clusters},
      {"estimated_clusters", s.estimated_clusters},
      {"attended_tokens", s.attended_tokens},
      {"cache_hits", s.cache_hits},
      {"cache_misses", s.cache_misses},
      {"kmeans_ns", s.kmeans_ns},
      {"device_cache_bytes", s.device_cache_bytes},
      {"cache_admissions", s.cache_admissions},
      {"cache_evictions", s.cache_evictions},
      {"manager_backlog", s.manager_backlog},
      {"pin_fallbacks", s.pin_fallbacks},
      {"spill_io", (s.spill_io & WKV_SPILL_IO_URING ? std::string("io_uring") : s.spill_io ? std::string("pread") : "")
                       + (s.spill_io & WKV_SPILL_IO_DIRECT ? "+direct" : "")},
      {"spill_bytes_used", s.spill_bytes_used},
      {"spill_file_bytes", s.spill_file_bytes},
      {"spill_bytes_written", s.spill_bytes_written},
      {"spill_bytes_read", s.spill_bytes_read},
      {"evicted_sequences", s.evicted_sequences},
      {"spill_cold_pages", s.spill_cold_pages},
      {"spill_pages_written", s.spill_pages_written},
      {"spill_pages_read", s.spill_pages_read},
      {"spill_estimated", s.spill_estimated},
      {"spill_read_errors", s.spill_read_errors},
      {"spill_write_errors", s.spill_write_errors},
      {"cache_frames_given", s.cache_frames_given},
      {"cache_records_dropped", s.cache_records_dropped},
      {"growths_deferred", s.growths_deferred},
      {"growth_waits", s.growth_waits},
      {"decode_graphs", s.decode_graphs},
      {"device_bytes_reserved", s.device_bytes_reserved},
      {"device_bytes_used", s.device_bytes_used},
      {"meta_device_bytes", s.meta_device_bytes},
      {"meta_host_rows_reserved", s.meta_host_rows_reserved},
  };
  // The buffer manager's own figures (BufferManager::Stats): whether its
  // thread keeps up with the steps.
  const BufferManager::Stats b = buffers_->stats();
  nlohmann::ordered_json manager = {
      {"passes", b.passes},
      {"records_taken", b.records_taken},
      {"busy_ns", b.busy_ns},
      {"take_ns", b.take_ns},
      {"victims_ns", b.victims_ns},
      {"clear_ns", b.clear_ns},
      {"release_ns", b.release_ns},
      {"publish_ns", b.publish_ns},
      {"reserve_target", b.reserve_target},
      {"step_releases", b.step_releases},
      {"free_frames", b.free},
      {"quarantined_frames", b.quarantined},
      {"resident_frames", b.resident},
  };
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  nlohmann::ordered_json j = {
      {"version", format("%d.%d.%d", WKV_VERSION_MAJOR, WKV_VERSION_MINOR, WKV_VERSION_PATCH)},
      {"unix_ms", std::chrono::duration_cast<std::chrono::milliseconds>(now).count()},
      {"config", std::move(config)},
      {"stats", std::move(stats)},
      {"buffer_manager", std::move(manager)},
  };
  return j.dump();
}

// Eviction -------------------------------------------------------------------

Status Engine::evict(Sequence &seq) {
  if (!spill_)
    return WKV_ERROR(WKV_ERR_STATE, "the engine has no spill file (wkv_config.spill_dir is NULL)");
  if (seq.evicted()) return Status::ok();
  WKV_RETURN_IF_ERROR(check_unbound(seq, "wkv_seq_evict"));
  // 1. The sequence's own device work (page writes of its growths) ends
  //    before its pages are read here; its cold pages' reads and writes are
  //    settled (they stay in the spill file as they are).
  BufferManager::wait_idle(seq.tracker());
  if (cold_) cold_->settle(seq);
  const uint32_t H = cfg_.c.n_kv_heads;
  const size_t page = arena_->page_bytes();
  // 2. Every head's pages into an extent of their own, all in one pass of
  //    the spill file (no queue drained between heads). All or nothing.
  const uint32_t N = seq.n_layers() * H;
  std::vector<SpillPiece> pieces;
  std::vector<size_t> first;
  std::vector<SpillExtent> ext;
  try {
    first.reserve(N + 1);
    ext.resize(N);
    for (uint32_t i = 0; i < N; ++i) {
      first.push_back(pieces.size());
      for (PageId id : seq.layer(i / H).heads[i % H].map.pages)
        if (id != kNoPage) pieces.push_back(SpillPiece{arena_->page_ptr(id), page});
    }
    first.push_back(pieces.size());
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory evicting a sequence");
  }
  {
    Status st = spill_->write_extents(pieces.data(), first.data(), N, ext.data());
    if (!st.is_ok()) return WKV_ERROR(st.code(), "evicting a sequence: %s", st.message().c_str());
  }
  for (uint32_t i = 0; i < N; ++i) seq.spilled(i / H, i % H) = ext[i];
  // 3. Commit: the pages go once no step in flight reads them; plans that
  //    looked the sequence up must look it up again. The page list keeps
  //    its length: kNoPage throughout, cold pages told apart by their
  //    state (lib/index/head.hpp).
  for (uint32_t l = 0; l < seq.n_layers(); ++l) {
    LayerState &L = seq.layer(l);
    L.version++;
    for (HeadState &hs : L.heads) {
      try {
        MetaVector<PageId> ids;
        for (PageId id : hs.map.pages)
          if (id != kNoPage) ids.push_back(id);
        buffers_->defer([&arena = *arena_, ids = std::move(ids)] {
          arena.release(ids.data(), static_cast<uint32_t>(ids.size()));
        });
      } catch (...) {
        // Out of memory for the release itself: the pages stay allocated
        // (counted in use) rather than being reused under a reader.
      }
      std::fill(hs.map.pages.begin(), hs.map.pages.end(), kNoPage);
    }
  }
  seq.set_evicted(true);
  counters_.evicted_sequences.fetch_add(1);
  return Status::ok();
}

Status Engine::restore(Sequence &seq) {
  if (!seq.evicted()) return Status::ok();
  const uint32_t H = cfg_.c.n_kv_heads, N = seq.n_layers() * H;
  const size_t page = arena_->page_bytes();
  // 1. New pages for every head, filled from the spill file and checked.
  //    On a failure they go back and the sequence stays evicted.
  std::vector<MetaVector<PageId>> ids;
  std::vector<SpillPiece> pieces;
  try {
    ids.resize(N);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory restoring a sequence");
  }
  auto undo = [&] {
    for (MetaVector<PageId> &v : ids)
      if (!v.empty()) arena_->release(v.data(), static_cast<uint32_t>(v.size()));
  };
  // Page p of a head was evicted unless it is a cold page (on disk before).
  auto evicted_page = [](const HeadState &hs, size_t p) {
    return hs.cold.state.size() <= p || hs.cold.state[p] == ColdPages::kResident ||
           hs.cold.state[p] == ColdPages::kKept;
  };
  std::vector<size_t> first;
  std::vector<SpillExtent> ext;
  try {
    first.reserve(N + 1);
    ext.resize(N);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory restoring a sequence");
  }
  for (uint32_t i = 0; i < N; ++i) {
    const SpillExtent &x = seq.spilled(i / H, i % H);
    const HeadState &hs = seq.layer(i / H).heads[i % H];
    const uint32_t n = static_cast<uint32_t>(x.bytes / page);
    Status st = Status::ok();
    uint32_t expect = 0;
    for (size_t p = 0; p < hs.map.pages.size(); ++p) expect += evicted_page(hs, p);
    if (expect != n)
      st = WKV_ERROR(WKV_ERR_INTERNAL, "layer %u head %u: %u pages evicted, %u in its extent", i / H, i % H, expect,
                     n);
    try {
      if (st.is_ok()) {
        ids[i].resize(n);
        first.push_back(pieces.size());
        ext[i] = x;
      }
    } catch (const std::bad_alloc &) {
      st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory restoring a sequence");
    }
    if (st.is_ok() && n > 0) {
      st = arena_->allocate(n, ids[i].data());
      if (!st.is_ok()) ids[i].clear();
    }
    try {
      for (uint32_t p = 0; st.is_ok() && p < n; ++p) pieces.push_back(SpillPiece{arena_->page_ptr(ids[i][p]), page});
    } catch (const std::bad_alloc &) {
      st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory restoring a sequence");
    }
    if (!st.is_ok()) {
      undo();
      return WKV_ERROR(st.code(), "restoring layer %u head %u of an evicted sequence: %s", i / H, i % H,
                       st.message().c_str());
    }
  }
  // Every extent in one pass of the spill file, each checked.
  {
    std::vector<Status> each;
    Status st = Status::ok();
    try {
      first.push_back(pieces.size());
      each.resize(N);
    } catch (const std::bad_alloc &) {
      st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory restoring a sequence");
    }
    if (st.is_ok()) st = spill_->read_extents(ext.data(), pieces.data(), first.data(), N, each.data());
    if (!st.is_ok()) {
      undo();
      return WKV_ERROR(st.code(), "restoring an evicted sequence: %s", st.message().c_str());
    }
    for (uint32_t i = 0; i < N; ++i)
      if (!each[i].is_ok()) {
        undo();
        return WKV_ERROR(each[i].code(), "restoring layer %u head %u of an evicted sequence: %s", i / H, i % H,
                         each[i].message().c_str());
      }
  }
  // The page lists as they will be: each evicted page's new id in place.
  std::vector<MetaVector<PageId>> lists;
  try {
    lists.resize(N);
    for (uint32_t i = 0; i < N; ++i) {
      const HeadState &hs = seq.layer(i / H).heads[i % H];
      lists[i] = hs.map.pages;
      size_t k = 0;
      for (size_t p = 0; p < lists[i].size(); ++p)
        if (evicted_page(hs, p)) lists[i][p] = ids[i][k++];
    }
  } catch (const std::bad_alloc &) {
    undo();
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory restoring a sequence");
  }
  // 2. The device's page table (CUDA), on the I/O stream, before anything
  //    can look the sequence up.
  const IndexContext ix = index();
  void *stream = backend_->io_stream();
  Status st = Status::ok();
  for (uint32_t i = 0; i < N && st.is_ok(); ++i) {
    HeadState &hs = seq.layer(i / H).heads[i % H];
    st = mirror_fill_entries(ix, hs, 0, nullptr, nullptr, nullptr, 0, 0, lists[i].data(),
                             static_cast<uint32_t>(lists[i].size()), stream);
  }
  if (st.is_ok()) st = backend_->mem_sync(stream);
  if (!st.is_ok()) {
    undo();
    return st;
  }
  // 3. Commit.
  for (uint32_t i = 0; i < N; ++i) {
    HeadState &hs = seq.layer(i / H).heads[i % H];
    hs.map.pages = std::move(lists[i]);
    spill_->release(seq.spilled(i / H, i % H));
    seq.spilled(i / H, i % H) = SpillExtent{};
  }
  for (uint32_t l = 0; l < seq.n_layers(); ++l) seq.layer(l).version++;
  seq.set_evicted(false);
  counters_.evicted_sequences.fetch_sub(1);
  return Status::ok();
}

Status Plan::check_versions() const {
  for (uint32_t i = 0; i < n_seqs; ++i)
    if (seqs[i]->layer(layer).version != seq_versions[i])
      return WKV_ERROR(WKV_ERR_STATE,
                       "sequence %u of the plan was appended to (or its rows moved for an append that was refused) "
                       "since the lookup; look up again",
                       i);
  return Status::ok();
}

Plan::~Plan() {
  // A bound plan unbinds first, waiting for the whole device (its replays'
  // stream may be gone): the tokens of steps prepared and never run are
  // taken back, and its sequences are free again.
  if (binding) (void)engine_->unbind(*this, nullptr, true);
  close_lookups();
  engine_->backend().release_plan(*this);
}

void Plan::close_lookups() {
  if (!lookups_open) return;
  for (uint32_t i = 0; i < n_seqs; ++i) seqs[i]->open_lookups(layer).fetch_sub(1, std::memory_order_acq_rel);
  lookups_open = false;
}

namespace {

// A CPU engine's input is read on the host, where every element is checked
// finite before anything changes: a NaN or an infinity in one key would
// reach its cluster's centroid and silence the whole head at every step
// after. Rows of d elements of dtype t at base + (i * seq_stride + t *
// token_stride + h * head_stride) elements, for n_outer x n_tokens x heads.
// `verb` prefixes the message where the caller's layer adds none (null:
// none); a query (token_stride 0) names its query head.
Status check_finite(DType t, const void *base, uint32_t n_outer, uint32_t n_tokens, uint32_t heads, uint32_t d,
                    int64_t seq_stride, int64_t token_stride, int64_t head_stride, const char *verb,
                    const char *what) {
  const size_t esz = dtype_bytes(t);
  for (uint32_t i = 0; i < n_outer; ++i)
    for (uint32_t tok = 0; tok < n_tokens; ++tok)
      for (uint32_t h = 0; h < heads; ++h) {
        const int64_t at = static_cast<int64_t>(i) * seq_stride + static_cast<int64_t>(tok) * token_stride +
                           static_cast<int64_t>(h) * head_stride;
        if (all_finite(t, static_cast<const uint8_t *>(base) + at * static_cast<int64_t>(esz), d)) continue;
        const std::string where = token_stride ? format("sequence %u, token %u, head %u", i, tok, h)
                                               : format("sequence %u, query head %u", i, h);
        return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s%s%s holds a NaN or an infinity (%s)", verb ? verb : "",
                         verb ? ": " : "", what, where.c_str());
      }
  return Status::ok();
}

}  // namespace

Status Engine::append(Sequence &seq, uint32_t layer, const uint8_t *k, const uint8_t *v, uint32_t n,
                      int64_t token_stride, int64_t head_stride, void *stream) {
  Sequence *one = &seq;
  return append_batch(&one, 1, layer, k, v, n, 0, token_stride, head_stride, stream, "wkv_seq_append");
}

Status Engine::append_batch(Sequence *const *seqs, uint32_t n_seqs, uint32_t layer, const uint8_t *k,
                            const uint8_t *v, uint32_t n, int64_t seq_stride, int64_t token_stride,
                            int64_t head_stride, void *stream, const char *verb) {
  const size_t esz = dtype_bytes(cfg_.dtype());
  // Bound sequences take appends only in their binding's captured step.
  bool captured = false;
  if (seqs[0]->binding() && backend_->capturing(stream, &captured).is_ok() && captured)
    return capture_append(seqs, n_seqs, layer, k, v, n, seq_stride, token_stride, head_stride, stream, verb);
  WKV_RETURN_IF_ERROR(backend_->check_stream(stream, verb));
  for (uint32_t i = 0; i < n_seqs; ++i) WKV_RETURN_IF_ERROR(check_unbound(*seqs[i], verb));
  const void *dk = nullptr, *dv = nullptr;
  WKV_RETURN_IF_ERROR(backend_->check_pointer(k, "k", esz, &dk));
  WKV_RETURN_IF_ERROR(backend_->check_pointer(v, "v", esz, &dv));
  // 1. Evicted sequences come back, and every layer gets room for its rows
  //    (nothing a reader sees changes).
  std::vector<StagedAppend> staged;
  std::vector<RowCopy> copies;
  std::vector<StepTracker *> trackers;
  std::vector<uint64_t> epochs;
  try {
    staged.resize(n_seqs);
    copies.reserve(static_cast<size_t>(n_seqs) * cfg_.c.n_kv_heads);
    trackers.reserve(n_seqs);
    epochs.reserve(n_seqs);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for an append to %u sequences", n_seqs);
  }
  const uint64_t token_pitch = static_cast<uint64_t>(token_stride) * esz;
  const uint64_t head_pitch = static_cast<uint64_t>(head_stride) * esz;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    Sequence &seq = *seqs[i];
    WKV_RETURN_IF_ERROR(restore(seq));
    const IndexContext ix = index_for(seq);
    WKV_RETURN_IF_ERROR(stage_append(ix, seq.layer(layer), n, &staged[i], stream));
    WKV_RETURN_IF_ERROR(append_copies(ix, seq.layer(layer), staged[i],
                                      static_cast<uint64_t>(i) * static_cast<uint64_t>(seq_stride) * esz,
                                      token_pitch, head_pitch, &copies));
  }
  // A CPU engine reads the rows here: checked finite once their room is had
  // (a count of tokens that cannot be had is refused before a row is read),
  // before any is copied. A refused append leaves room, not tokens.
  if (backend_->host_memory()) {
    const uint32_t H = cfg_.c.n_kv_heads, d = cfg_.c.head_dim;
    WKV_RETURN_IF_ERROR(
        check_finite(cfg_.dtype(), k, n_seqs, n, H, d, seq_stride, token_stride, head_stride, verb, "k"));
    WKV_RETURN_IF_ERROR(
        check_finite(cfg_.dtype(), v, n_seqs, n, H, d, seq_stride, token_stride, head_stride, verb, "v"));
  }
  // 2. One copy for the batch, then each sequence counts its rows and
  //    grows, inside its tracker's step. Where no sequence's count enqueues
  //    anything (no growth begins or commits: most tokens), the copy's
  //    launch ends the steps too.
  bool quiet = true;
  {
    const IndexContext ix = index();
    for (uint32_t i = 0; i < n_seqs && quiet; ++i) quiet = commit_is_quiet(ix, seqs[i]->layer(layer), staged[i]);
  }
  for (uint32_t i = 0; i < n_seqs; ++i) {
    trackers.push_back(&seqs[i]->tracker());
    epochs.push_back(buffers_->begin(seqs[i]->tracker()));
  }
  bool ended = false;
  Status st =
      quiet ? backend_->copy_rows_then_end(copies.data(), static_cast<uint32_t>(copies.size()),
                                           static_cast<const uint8_t *>(dk), static_cast<const uint8_t *>(dv),
                                           token_pitch, cfg_.row_bytes(), trackers.data(), epochs.data(), n_seqs,
                                           stream, &ended)
            : backend_->copy_rows(copies.data(), static_cast<uint32_t>(copies.size()),
                                  static_cast<const uint8_t *>(dk), static_cast<const uint8_t *>(dv), token_pitch,
                                  cfg_.row_bytes(), stream);
  for (uint32_t i = 0; i < n_seqs && st.is_ok(); ++i) {
    LayerState &L = seqs[i]->layer(layer);
    const size_t pages = L.pages();
    st = commit_append(index_for(*seqs[i]), L, layer, staged[i], stream);
    if (L.pages() != pages) L.grown_epoch = epochs[i];
    if (!st.is_ok() && n_seqs > 1)
      st = Status(st.code(), format("sequence %u: %s (sequences before it hold the new tokens; it and those after "
                                    "it do not)",
                                    i, st.message().c_str()));
  }
  if (ended) return st;  // quiet: the counts cannot fail
  Status marked = backend_->end_work_many(trackers.data(), epochs.data(), n_seqs, stream);
  return st.is_ok() ? marked : st;
}

IndexContext Engine::index_for(Sequence &seq) {
  IndexContext ix = index();
  if (cold_) {
    ix.relieve = [this, &seq](uint64_t n, void *stream) { return cold_->relieve(seq, n, stream); };
    ix.read_cold = [this](const HeadState &hs, uint32_t p, uint8_t *dst) { return cold_->read_page(hs, p, dst); };
    ix.max_growth_segments = cold_->max_growth_segments();
  }
  return ix;
}

Status Engine::end_prompt_locked(Sequence &seq, uint32_t layer, void *stream) {
  const LayerState &L = seq.layer(layer);
  if (L.generating || L.tokens == 0) return Status::ok();
  const uint64_t epoch = buffers_->begin(seq.tracker());
  LayerState &G = seq.layer(layer);
  const size_t pages = G.pages();
  Status st = wkv::end_prompt(index_for(seq), G, layer, stream);
  if (G.pages() != pages) G.grown_epoch = epoch;
  Status marked = backend_->end_work(seq.tracker(), epoch, stream);
  return st.is_ok() ? marked : st;
}

Status Engine::end_prompt(Sequence &seq, uint32_t layer, void *stream) {
  WKV_RETURN_IF_ERROR(check_unbound(seq, "wkv_seq_end_prompt"));
  WKV_RETURN_IF_ERROR(backend_->check_stream(stream, "wkv_seq_end_prompt"));
  WKV_RETURN_IF_ERROR(restore(seq));
  return end_prompt_locked(seq, layer, stream);
}

Status Engine::lookup(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t layer,
                      const void *q, int64_t seq_stride, int64_t head_stride, void *stream,
                      const DecodeOut *decode) {
  plan.stage = Plan::Stage::kEmpty;
  plan.stream = stream;
  plan.close_lookups();  // the plan's last lookup, if not assembled, is abandoned
  // A bound plan's decodes are captured (capture_decode); it runs no other
  // step.
  if (plan.binding) {
    bool captured = false;
    WKV_RETURN_IF_ERROR(backend_->capturing(stream, &captured));
    if (captured && decode) return capture_decode(plan, seqs, n, layer, q, seq_stride, head_stride, *decode, stream);
    return WKV_ERROR(WKV_ERR_STATE,
                     "the plan is bound to a batch whose steps a runtime captures: it decodes only in a capture "
                     "(wkv_decode on a stream being captured) and replays; wkv_plan_unbind it first");
  }
  // 1. Everything checked before anything changes: a refused lookup ends
  //    no prompt.
  WKV_RETURN_IF_ERROR(backend_->check_stream(stream, "wkv_lookup"));
  for (uint32_t i = 0; i < n; ++i) WKV_RETURN_IF_ERROR(check_unbound(*seqs[i], "wkv_lookup"));
  WKV_RETURN_IF_ERROR(backend_->check_pointer(q, "q", dtype_bytes(cfg_.dtype())));
  if (backend_->host_memory())
    WKV_RETURN_IF_ERROR(check_finite(cfg_.dtype(), q, n, 1, cfg_.c.n_q_heads, cfg_.c.head_dim, seq_stride, 0,
                                     head_stride, nullptr, "q"));  // the C ABI names the verb
  // The whole step at once: not with cold pages (their lookups install and
  // ask for pages around the kernels).
  const bool whole = decode && n > 0 && !cold_ && backend_->decodes();
  if (whole) WKV_RETURN_IF_ERROR(backend_->check_pointer(decode->out, "out", dtype_bytes(cfg_.dtype())));
  for (uint32_t i = 0; i < n; ++i) {
    if (seqs[i]->layer(layer).tokens == 0)
      return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "sequence %u has no tokens at layer %u", i, layer);
  }
  // 2. Evicted sequences come back, then the prompt of a layer ends at its
  //    first lookup.
  for (uint32_t i = 0; i < n; ++i) WKV_RETURN_IF_ERROR(restore(*seqs[i]));
  for (uint32_t i = 0; i < n; ++i) WKV_RETURN_IF_ERROR(end_prompt_locked(*seqs[i], layer, stream));

  // 3. Hold the sequences, size the runs.
  WKV_RETURN_IF_ERROR(plan_runs(plan, seqs, n, layer));
  plan.q_src = q;
  plan.q_seq_stride = seq_stride;
  plan.q_head_stride = head_stride;
  if (whole) {
    WKV_RETURN_IF_ERROR(backend_->decode(plan, *decode));
    plan.stage = Plan::Stage::kAssembled;
    plan.rows_laid_out = backend_->decode_lays_out_rows();
    counters_.lookups.fetch_add(n);
    return Status::ok();
  }
  // 4. Score, select, estimate; with cold pages, what came back from the
  //    spill file is installed first, and what the step wanted is asked
  //    for after.
  if (cold_)
    for (uint32_t i = 0; i < n; ++i) cold_->begin_lookup(*seqs[i], layer, stream);
  Status st = backend_->lookup(plan);
  if (st.is_ok() && cold_ && !backend_->host_memory()) {
    // Open until the plan assembles (or abandons the lookup): no page of
    // the layer leaves meanwhile, this lookup's end included.
    for (uint32_t i = 0; i < n; ++i) seqs[i]->open_lookups(layer).fetch_add(1, std::memory_order_acq_rel);
    plan.lookups_open = true;
  }
  if (cold_)
    for (uint32_t i = 0; i < n; ++i) cold_->end_lookup(*seqs[i], layer);
  if (!st.is_ok()) return st;
  plan.stage = Plan::Stage::kLookedUp;
  counters_.lookups.fetch_add(n);
  return Status::ok();
}

Status Engine::plan_runs(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t layer) {
  const uint32_t H = cfg_.c.n_kv_heads, G = cfg_.group();
  try {
    plan.seqs.assign(seqs, seqs + n);
    plan.seq_versions.resize(n);
    for (uint32_t i = 0; i < n; ++i) plan.seq_versions[i] = seqs[i]->layer(layer).version;
    plan.layer = layer;
    plan.n_seqs = n;
    grow_to(plan.runs, static_cast<size_t>(n) * H);
    size_t ret = 0, est = 0, lg = 0;
    for (uint32_t i = 0; i < n; ++i) {
      const LayerState &L = seqs[i]->layer(layer);
      for (uint32_t h = 0; h < H; ++h) {
        RunPlan &r = plan.runs[static_cast<size_t>(i) * H + h];
        const HeadState &hs = L.heads[h];
        r.seq = i;
        r.head = h;
        r.clusters = hs.clusters();
        zone_sizes(cfg_, r.clusters, hs.ones, &r.n_ret, &r.n_one, &r.n_est);
        r.ret_off = ret;
        r.est_off = est;
        r.logits_off = lg;
        r.steady_tokens = hs.sink.n + hs.tail.n;
        r.ret_tokens = 0;
        ret += r.n_ret;
        est += r.n_est;
        lg += static_cast<size_t>(G) * r.clusters;
      }
    }
  } catch (const std::bad_alloc &) {
    plan.seqs.clear();
    plan.n_seqs = 0;
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory sizing the plan");
  }
  return Status::ok();
}

Status Engine::check_unbound(const Sequence &seq, const char *verb) {
  if (!seq.binding()) return Status::ok();
  return WKV_ERROR(WKV_ERR_STATE,
                   "%s: the sequence is bound to a plan whose steps a runtime captures: it takes appends and "
                   "lookups only in that capture's replays (wkv_plan_unbind it first)",
                   verb);
}

Status Engine::assemble(Plan &plan, void *stream) {
  plan.stream = stream;
  const Plan::Stage stage = plan.stage;
  plan.stage = Plan::Stage::kEmpty;
  if (stage == Plan::Stage::kEmpty) return WKV_ERROR(WKV_ERR_STATE, "assemble needs a lookup first");
  Status st = plan.check_versions();
  if (st.is_ok()) st = backend_->check_stream(stream, "wkv_assemble");
  if (st.is_ok()) {
    st = backend_->assemble(plan);
    // The gather (enqueued, or some of it, even if the assemble failed) is
    // the layers' latest reader.
    if (cold_ && !backend_->host_memory()) {
      const uint64_t epoch = plan.tracker().issued();
      for (uint32_t i = 0; i < plan.n_seqs; ++i)
        ColdTier::assembled(plan.seqs[i]->layer(plan.layer), plan.tracker_ptr(), epoch);
    }
  }
  plan.close_lookups();
  WKV_RETURN_IF_ERROR(st);
  plan.stage = Plan::Stage::kAssembled;
  plan.rows_laid_out = true;
  return Status::ok();
}

Status Engine::attend(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                      void *stream) {
  plan.stream = stream;
  if (plan.stage != Plan::Stage::kAssembled) {
    plan.stage = Plan::Stage::kEmpty;
    return WKV_ERROR(WKV_ERR_STATE, "attend needs a lookup and an assemble first");
  }
  if (!plan.rows_laid_out) {
    plan.stage = Plan::Stage::kEmpty;
    return WKV_ERROR(WKV_ERR_STATE,
                     "attend needs an assemble first: the plan's last step was a decode that attended from where its "
                     "rows live and laid out no execution buffer");
  }
  Status st = plan.check_versions();
  if (st.is_ok()) st = backend_->check_stream(stream, "wkv_attend");
  if (st.is_ok()) st = backend_->check_pointer(out, "out", dtype_bytes(cfg_.dtype()));
  if (st.is_ok() && lse) st = backend_->check_pointer(lse, "lse", sizeof(float));
  if (st.is_ok()) st = backend_->attend(plan, out, seq_stride, head_stride, lse);
  if (!st.is_ok()) plan.stage = Plan::Stage::kEmpty;
  return st;
}

Status Engine::merge(Plan &plan, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                     int64_t lse_seq_stride, void *stream) {
  plan.stream = stream;
  if (plan.stage == Plan::Stage::kEmpty) return WKV_ERROR(WKV_ERR_STATE, "merge needs a lookup first");
  Status st = backend_->check_stream(stream, "wkv_merge");
  if (st.is_ok()) st = backend_->check_pointer(out, "out", dtype_bytes(cfg_.dtype()));
  if (st.is_ok()) st = backend_->check_pointer(lse, "lse", sizeof(float));
  if (st.is_ok()) st = backend_->merge(plan, out, seq_stride, head_stride, lse, lse_seq_stride);
  if (!st.is_ok()) plan.stage = Plan::Stage::kEmpty;
  return st;
}

Status Engine::update(Plan &plan, void *stream) {
  plan.stream = stream;
  if (plan.stage != Plan::Stage::kAssembled) {
    const bool looked_up = plan.stage == Plan::Stage::kLookedUp;
    plan.stage = Plan::Stage::kEmpty;
    return WKV_ERROR(WKV_ERR_STATE, looked_up ? "update needs an assemble first (it reports what was read)"
                                              : "update needs a lookup and an assemble first");
  }
  Status st = plan.check_versions();
  if (!st.is_ok()) plan.stage = Plan::Stage::kEmpty;
  // The access record was opened by the assemble and is taken by the
  // buffer manager once the step's kernels have ended; nothing is enqueued.
  return st;
}

}  // namespace wkv
