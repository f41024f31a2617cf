// The buffer manager's device played by host memory: words, ring and pool
// in ordinary allocations, unit map entries as host words stored into with
// atomics (the manager's thread clears them while a step reads them). For
// the manager's tests and its benchmarks (`wavekv bench manager`, `wavekv
// bench cache --policy engine`), which play the gather's side themselves,
// with the helpers at the end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "lib/buffer/buffer_manager.hpp"
#include "lib/index/head.hpp"

namespace wkv {

class HostDevice : public BufferManager::Device {
 public:
  HostDevice() = default;
  HostDevice(const HostDevice &) = delete;
  HostDevice &operator=(const HostDevice &) = delete;
  ~HostDevice() override {
    for (uint64_t *p : blocks_) delete[] p;
  }
  Status alloc_words(size_t n, uint64_t **host, uint64_t **dev) override {
    uint64_t *p = block(n * sizeof(uint64_t));
    *host = *dev = p;
    return Status::ok();
  }
  Status alloc_ring(size_t bytes, uint8_t **host, uint8_t **dev) override {
    auto *p = reinterpret_cast<uint8_t *>(block(bytes));
    *host = *dev = p;
    return Status::ok();
  }
  Status alloc_device(size_t bytes, void **dev) override {
    *dev = block(bytes);
    return Status::ok();
  }
  // The copy, then the count (the device's stream order).
  Status publish_frames(const uint32_t *host_slots, const uint32_t *, uint32_t *dev_slots, uint64_t first,
                        uint64_t n, uint32_t cap, uint64_t *avail) override {
    for (uint64_t i = first; i < first + n; ++i)
      __atomic_store_n(&dev_slots[i % cap], host_slots[i % cap], __ATOMIC_RELAXED);
    __atomic_add_fetch(avail, n, __ATOMIC_ACQ_REL);
    return Status::ok();
  }
  Status clear_entries(const uint64_t *entries, uint32_t n) override {
    for (uint32_t i = 0; i < n; ++i)
      __atomic_store_n(reinterpret_cast<uint32_t *>(entries[i]), kNoFrame, __ATOMIC_RELAXED);
    return Status::ok();
  }

 private:
  // Zeroed, 8-byte aligned, freed with the device.
  uint64_t *block(size_t bytes) {
    blocks_.push_back(new uint64_t[(bytes + 7) / 8]());
    return blocks_.back();
  }
  std::vector<uint64_t *> blocks_;
};

// A frame from the pool as a gather takes one (kernels/gather.cu,
// take_frame), or kNoFrame when it is empty.
inline uint32_t take_pool_frame(const FramePool &p) {
  const auto before = static_cast<long long>(__atomic_fetch_sub(p.avail, 1ull, __ATOMIC_ACQ_REL));
  if (before <= 0) {
    __atomic_fetch_add(p.avail, 1ull, __ATOMIC_ACQ_REL);
    return kNoFrame;
  }
  const unsigned long long t = __atomic_fetch_add(p.taken, 1ull, __ATOMIC_ACQ_REL);
  return __atomic_load_n(p.slots + t % p.cap, __ATOMIC_ACQUIRE);
}

// A miss admitted as a gather admits one (kernels/gather.cu): a frame
// from the pool, mapped into the unit's entry by a swap that the first step
// to map the unit wins. The record's entry: the frame (kNoFrame: the pool
// was empty), and the entry's address where this step mapped it (0: the
// frame goes back through the record).
inline AdmitEntry admit_on_host(const FramePool &p, uint32_t *entry, uint32_t run) {
  const uint32_t frame = take_pool_frame(p);
  uint64_t mapped = 0;
  if (frame != kNoFrame) {
    uint32_t expect = kNoFrame;
    if (__atomic_compare_exchange_n(entry, &expect, frame, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
      mapped = reinterpret_cast<uint64_t>(entry);
  }
  return AdmitEntry{mapped, frame, run};
}

// A step's record closed as the gather's last CTA closes it: its admission
// entries, hit log entries (at most the log's room) and misses, then the
// pool's count as the step saw it.
inline void close_record_on_host(const StepRecord &rec, const FramePool &p, uint32_t used, uint32_t hits,
                                 uint32_t missed) {
  rec.header->used = used;
  rec.header->hits = hits < rec.hit_cap ? hits : rec.hit_cap;
  rec.header->missed = missed;
  __atomic_store_n(p.seen, __atomic_load_n(p.taken, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
}

}  // namespace wkv
