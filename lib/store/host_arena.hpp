// Host arenas: page slots in large chunks of host memory.
//
// Chunks are mapped anonymously, bound to one NUMA node when the machine has
// several (libnuma), and handed to an optional registration hook (the CUDA
// backend pins and maps them so that kernels read pages directly). A page is
// a fixed-size slot: K rows then V rows of one (sequence, layer, KV head).
//
// Page ids are dense: id = chunk * pages_per_chunk + slot. Chunk bases are
// published through atomics, so page_ptr() needs no lock while another thread
// adds a chunk.
//
// Budget: the bytes of all chunks never exceed budget_bytes (when nonzero);
// the last chunk is cut to fit. allocate() is all-or-nothing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "lib/common/meta_alloc.hpp"
#include "lib/common/status.hpp"

namespace wkv {

using PageId = uint32_t;
constexpr PageId kNoPage = 0xffffffffu;

class HostArena {
 public:
  // Called on each new chunk before use (e.g. cudaHostRegister), and on its
  // release. A failing register hook fails the allocation that needed it.
  using RegisterFn = std::function<Status(void *base, size_t bytes)>;
  using UnregisterFn = std::function<void(void *base, size_t bytes)>;

  struct Options {
    size_t page_bytes = 0;      // one slot, a multiple of 64
    size_t chunk_bytes = 64u << 20;
    uint64_t budget_bytes = 0;  // 0 = unlimited
    int numa_node = -1;         // -1 = no binding
    RegisterFn on_register;
    UnregisterFn on_unregister;
    // Keep two chunks' pages ready: once fewer are free after an
    // allocation, a background thread adds chunks (maps, binds and
    // registers them: pinning 512 MiB takes 100 to 150 ms) until there are,
    // so that a growth on the decoding path does not wait for one. (Half a
    // chunk was too little: a growth round of 7 sequences x 4 layers takes
    // some 112 MiB within a few tokens, and allocations waited 7 to 31 ms
    // for the next chunk.) Chunks count against the budget like any other;
    // when the budget has no room one is not added.
    bool ahead = false;
  };

  struct Stats {
    uint64_t chunks = 0;
    uint64_t bytes_reserved = 0;  // chunk bytes
    uint64_t pages_total = 0;     // slots in all chunks
    uint64_t pages_used = 0;
    uint64_t chunks_ahead = 0;    // chunks the background thread added
  };

  explicit HostArena(Options opts);
  ~HostArena();
  HostArena(const HostArena &) = delete;
  HostArena &operator=(const HostArena &) = delete;

  // Allocates n pages into out[0..n). All or nothing: WKV_ERR_BUDGET when
  // the budget cannot hold them, WKV_ERR_OUT_OF_MEMORY when the OS refuses.
  Status allocate(uint32_t n, PageId *out);
  // Returns n pages to the free list. Pre: each was allocated and not freed.
  // Never allocates or throws (destructors call it).
  void release(const PageId *ids, uint32_t n) noexcept;

  // The slot of a page. Pre: id was allocated.
  uint8_t *page_ptr(PageId id) const {
    return chunk_base_[id / pages_per_chunk_].load(std::memory_order_acquire) +
           static_cast<size_t>(id % pages_per_chunk_) * opts_.page_bytes;
  }
  size_t page_bytes() const { return opts_.page_bytes; }
  uint32_t pages_per_chunk() const { return pages_per_chunk_; }
  int numa_node() const { return opts_.numa_node; }
  Stats stats() const;

  // Stops the chunk thread of Options::ahead (waits for a chunk it is
  // adding); chunks are added when needed from then on. For owners whose
  // registration hook uses what they destroy before the arena.
  void stop_ahead();

  // Fault injection for tests: the next `n` chunk allocations fail as if the
  // OS refused them (the chunk thread of Options::ahead may take one).
  void inject_chunk_failures(uint32_t n) { inject_failures_.store(n); }

 private:
  static constexpr uint32_t kMaxChunks = 1u << 16;

  // Pre: `held` holds mu_ and no chunk is being added. Maps and registers
  // the chunk with mu_ released (adding_ set meanwhile), publishes it under
  // mu_.
  Status add_chunk(std::unique_lock<std::mutex> &held);
  // Pre: mu_ held. Asks the background thread for a chunk when few pages
  // are free (Options::ahead).
  void want_ahead(std::unique_lock<std::mutex> &held);
  void ahead_loop();

  Options opts_;
  uint32_t pages_per_chunk_;
  std::unique_ptr<std::atomic<uint8_t *>[]> chunk_base_;
  mutable std::mutex mu_;  // guards everything below
  MetaVector<size_t> chunk_bytes_;
  MetaVector<PageId> free_;
  uint64_t bytes_reserved_ = 0;
  uint64_t pages_total_ = 0;
  uint64_t pages_used_ = 0;
  std::atomic<uint32_t> inject_failures_{0};
  std::condition_variable cv_;  // a chunk added, a chunk wanted, stop
  bool adding_ = false;         // a chunk is being mapped and registered
  bool ahead_wanted_ = false, stop_ = false;
  uint64_t chunks_ahead_ = 0;
  std::thread ahead_;           // started at the first want
};

// The NUMA node nearest a PCI device ("0000:3b:00.0"), or -1 if unknown.
int numa_node_of_pci(const char *bus_id);
// Number of configured NUMA nodes (1 without libnuma).
int numa_nodes();

}  // namespace wkv
