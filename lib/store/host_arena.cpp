#include "lib/store/host_arena.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "lib/common/thread_name.hpp"

#if defined(WKV_WITH_NUMA)
#include <numa.h>
#endif

namespace wkv {

int numa_nodes() {
#if defined(WKV_WITH_NUMA)
  if (numa_available() < 0) return 1;
  return numa_num_configured_nodes();
#else
  return 1;
#endif
}

int numa_node_of_pci(const char *bus_id) {
  if (!bus_id) return -1;
  char path[256];
  std::snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", bus_id);
  FILE *f = std::fopen(path, "r");
  if (!f) return -1;
  int node = -1;
  if (std::fscanf(f, "%d", &node) != 1) node = -1;
  std::fclose(f);
  return node;
}

HostArena::HostArena(Options opts) : opts_(std::move(opts)) {
  if (opts_.chunk_bytes < opts_.page_bytes) opts_.chunk_bytes = opts_.page_bytes;
  pages_per_chunk_ = static_cast<uint32_t>(opts_.chunk_bytes / opts_.page_bytes);
  opts_.chunk_bytes = static_cast<size_t>(pages_per_chunk_) * opts_.page_bytes;
  chunk_base_.reset(new std::atomic<uint8_t *>[kMaxChunks]);
  for (uint32_t i = 0; i < kMaxChunks; ++i) chunk_base_[i].store(nullptr, std::memory_order_relaxed);
}

void HostArena::stop_ahead() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (ahead_.joinable()) ahead_.join();
}

HostArena::~HostArena() {
  stop_ahead();
  for (size_t i = 0; i < chunk_bytes_.size(); ++i) {
    uint8_t *base = chunk_base_[i].load();
    if (!base) continue;
    if (opts_.on_unregister) opts_.on_unregister(base, chunk_bytes_[i]);
    munmap(base, chunk_bytes_[i]);
  }
}

Status HostArena::add_chunk(std::unique_lock<std::mutex> &held) {
  size_t index = chunk_bytes_.size();
  if (index >= kMaxChunks)
    return WKV_ERROR(WKV_ERR_BUDGET, "host arena reached its limit of %u chunks", kMaxChunks);
  // Page ids are 32-bit (chunk * pages_per_chunk + slot): the chunk whose
  // ids would not fit is refused rather than wrapped onto earlier pages.
  if ((static_cast<uint64_t>(index) + 1) * pages_per_chunk_ - 1 > kNoPage - 1)
    return WKV_ERROR(WKV_ERR_BUDGET, "host arena reached its limit of 2^32 - 1 pages (%llu chunks of %u pages)",
                     static_cast<unsigned long long>(index), pages_per_chunk_);
  size_t bytes = opts_.chunk_bytes;
  if (opts_.budget_bytes) {
    uint64_t room = opts_.budget_bytes > bytes_reserved_ ? opts_.budget_bytes - bytes_reserved_ : 0;
    room -= room % opts_.page_bytes;
    if (room == 0)
      return WKV_ERROR(WKV_ERR_BUDGET, "host budget of %llu bytes exhausted (%llu pages in use)",
                       static_cast<unsigned long long>(opts_.budget_bytes),
                       static_cast<unsigned long long>(pages_used_));
    bytes = std::min<uint64_t>(bytes, room);
  }
  if (inject_failures_.load() > 0) {
    inject_failures_.fetch_sub(1);
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "host arena: chunk allocation of %zu bytes failed (injected)",
                     bytes);
  }
  // Map, bind and register without the lock: other threads allocate and
  // release meanwhile (only one chunk is added at a time, so `index` and
  // the budget's room stay ours).
  adding_ = true;
  held.unlock();
  Status st = Status::ok();
  void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "host arena: mmap of %zu bytes failed: %s", bytes, std::strerror(errno));
  } else {
    // Large chunks are read page by page at random: huge pages cut TLB misses.
    madvise(p, bytes, MADV_HUGEPAGE);
#if defined(WKV_WITH_NUMA)
    // Bind before first touch, so the pages land on the node nearest the GPU.
    if (opts_.numa_node >= 0 && numa_available() >= 0 && numa_num_configured_nodes() > 1)
      numa_tonode_memory(p, bytes, opts_.numa_node);
#endif
    if (opts_.on_register) {
      st = opts_.on_register(p, bytes);
      if (!st.is_ok()) munmap(p, bytes);
    }
  }
  held.lock();
  adding_ = false;
  cv_.notify_all();
  WKV_RETURN_IF_ERROR(st);
  uint32_t pages = static_cast<uint32_t>(bytes / opts_.page_bytes);
  try {
    chunk_bytes_.push_back(bytes);
    // Room for every page of every chunk, so that release() never
    // allocates (it runs in destructors).
    free_.reserve(pages_total_ + pages);
  } catch (...) {
    if (chunk_bytes_.size() > index) chunk_bytes_.pop_back();
    if (opts_.on_unregister) opts_.on_unregister(p, bytes);
    munmap(p, bytes);
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "host arena: out of memory for chunk metadata");
  }
  chunk_base_[index].store(static_cast<uint8_t *>(p), std::memory_order_release);
  // Push in reverse so that allocation hands out ascending slots.
  PageId first = static_cast<PageId>(index) * pages_per_chunk_;
  for (uint32_t i = pages; i-- > 0;) free_.push_back(first + i);
  bytes_reserved_ += bytes;
  pages_total_ += pages;
  return Status::ok();
}

namespace {
constexpr size_t kAheadChunks = 2;  // chunks' pages kept free ahead of need (Options::ahead)
}  // namespace

void HostArena::want_ahead(std::unique_lock<std::mutex> &held) {
  (void)held;
  if (!opts_.ahead || stop_ || adding_ || ahead_wanted_ || free_.size() >= kAheadChunks * pages_per_chunk_) return;
  if (!ahead_.joinable()) {
    try {
      ahead_ = std::thread([this] { ahead_loop(); });
      name_thread(ahead_, "wkv-pin-ahead");
    } catch (...) {
      return;  // no thread: chunks are added when needed, as without `ahead`
    }
  }
  ahead_wanted_ = true;
  cv_.notify_all();
}

void HostArena::ahead_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || (ahead_wanted_ && !adding_); });
    if (stop_) return;
    ahead_wanted_ = false;
    // Until the pages are there (some came back meanwhile, perhaps). A
    // failure (the budget, the OS) is left for the allocation that needs
    // the pages to report.
    while (!stop_ && !adding_ && free_.size() < kAheadChunks * pages_per_chunk_) {
      if (!add_chunk(lock).is_ok()) break;
      ++chunks_ahead_;
    }
  }
}

Status HostArena::allocate(uint32_t n, PageId *out) {
  if (n == 0) return Status::ok();
  std::unique_lock<std::mutex> lock(mu_);
  while (free_.size() < n) {
    if (adding_) {  // the background thread's chunk may be enough
      cv_.wait(lock);
      continue;
    }
    Status s = add_chunk(lock);
    if (!s.is_ok()) {
      if (s.code() == WKV_ERR_BUDGET)
        return WKV_ERROR(WKV_ERR_BUDGET,
                         "host budget of %llu bytes cannot hold %u more pages of %zu bytes "
                         "(%llu in use, %zu free)",
                         static_cast<unsigned long long>(opts_.budget_bytes), n, opts_.page_bytes,
                         static_cast<unsigned long long>(pages_used_), free_.size());
      return s;
    }
  }
  for (uint32_t i = 0; i < n; ++i) {
    out[i] = free_.back();
    free_.pop_back();
  }
  pages_used_ += n;
  want_ahead(lock);
  return Status::ok();
}

void HostArena::release(const PageId *ids, uint32_t n) noexcept {
  if (n == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  // Capacity for every page was reserved when its chunk was added: no
  // allocation, no throw.
  for (uint32_t i = 0; i < n; ++i) free_.push_back(ids[i]);
  pages_used_ -= n;
}

HostArena::Stats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  s.chunks = chunk_bytes_.size();
  s.bytes_reserved = bytes_reserved_;
  s.pages_total = pages_total_;
  s.pages_used = pages_used_;
  s.chunks_ahead = chunks_ahead_;
  return s;
}

}  // namespace wkv
