// The device block cache's bookkeeping: which page occupies which slot, the
// replacement policy, and the quarantine that keeps a slot from being reused
// while a step in flight may still read it. Pure host logic: the CUDA backend
// moves the bytes and swaps the device mirror; this decides.
//
// Slot life cycle:
//
//   free --admit--> resident --evict--> quarantined(epoch) --release(epoch')--> free
//
// A slot evicted at epoch e is reusable only once every step that began at or
// before e has finished (release_quarantine(safe) with safe > e), because such
// a step may have resolved the page to this slot before the device mirror
// switched back to the host page.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace wkv {

// A page of one (sequence, layer, KV head): its index in that head's page list.
struct PageKey {
  uint64_t seq;
  uint32_t layer_head;  // layer * n_kv_heads + head
  uint32_t page;
  bool operator==(const PageKey &o) const {
    return seq == o.seq && layer_head == o.layer_head && page == o.page;
  }
};

struct PageKeyHash {
  size_t operator()(const PageKey &k) const {
    uint64_t h = k.seq * 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(k.layer_head) << 32 | k.page);
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    return static_cast<size_t>(h ^ (h >> 32));
  }
};

// Chooses victims among resident slots. One small interface so that CLOCK or
// a score-aware policy can replace LRU.
class ReplacementPolicy {
 public:
  virtual ~ReplacementPolicy() = default;
  virtual void on_insert(uint32_t slot) = 0;
  virtual void on_access(uint32_t slot) = 0;
  virtual void on_erase(uint32_t slot) = 0;
  // The next victim, or -1 if none is resident.
  virtual int64_t victim() = 0;
};

// Least recently used, as an intrusive doubly linked list over slots.
class LruPolicy final : public ReplacementPolicy {
 public:
  explicit LruPolicy(uint32_t slots);
  void on_insert(uint32_t slot) override;
  void on_access(uint32_t slot) override;
  void on_erase(uint32_t slot) override;
  int64_t victim() override;

 private:
  void unlink(uint32_t s);
  void push_front(uint32_t s);
  static constexpr uint32_t kNil = 0xffffffffu;
  std::vector<uint32_t> prev_, next_;
  std::vector<char> linked_;
  uint32_t head_ = kNil, tail_ = kNil;  // head = most recent
};

class BlockCache {
 public:
  struct Admission {
    int64_t slot = -1;      // -1: nothing could be freed
    bool evicted = false;   // the slot's previous page was evicted
    PageKey victim{};       // that page
    uint32_t victim_slot = 0;  // and the slot it held (now quarantined)
  };

  BlockCache(uint32_t slots, std::unique_ptr<ReplacementPolicy> policy);

  uint32_t slots() const { return static_cast<uint32_t>(owner_.size()); }
  uint32_t resident() const { return static_cast<uint32_t>(map_.size()); }
  uint32_t quarantined() const { return static_cast<uint32_t>(quarantine_.size()); }

  // The slot holding `key`, or -1. Counts as an access when `touch`.
  int64_t find(const PageKey &key, bool touch);

  // Finds a slot for `key` (not resident): a free slot, else the policy's
  // victim, whose page is evicted into quarantine at `epoch` (and reported
  // so the caller can switch its mirror back), after which a free slot is
  // taken if any. The new page is resident from now on; the caller copies it.
  Admission admit(const PageKey &key, uint64_t epoch);

  // Evicts every page of a sequence (it was destroyed) into quarantine.
  // Returns the slots it held.
  std::vector<uint32_t> drop_sequence(uint64_t seq, uint64_t epoch);

  // Frees quarantined slots evicted at an epoch < safe_epoch.
  void release_quarantine(uint64_t safe_epoch);

  // Re-stamps quarantined slots of epoch `from` with `to`: a caller that
  // learns the true eviction epoch only later (after the device mirror has
  // switched) admits with a provisional epoch and fixes it here.
  void restamp_quarantine(uint64_t from, uint64_t to);

 private:
  struct Quarantined {
    uint32_t slot;
    uint64_t epoch;
  };
  std::unique_ptr<ReplacementPolicy> policy_;
  std::unordered_map<PageKey, uint32_t, PageKeyHash> map_;
  std::vector<PageKey> owner_;   // [slots]
  std::vector<char> occupied_;   // [slots]: resident
  std::vector<uint32_t> free_;
  std::vector<Quarantined> quarantine_;
};

}  // namespace wkv
