#include "lib/buffer/block_cache.hpp"

#include <algorithm>

namespace wkv {

LruPolicy::LruPolicy(uint32_t slots) : prev_(slots, kNil), next_(slots, kNil), linked_(slots, 0) {}

void LruPolicy::unlink(uint32_t s) {
  if (!linked_[s]) return;
  if (prev_[s] != kNil) next_[prev_[s]] = next_[s]; else head_ = next_[s];
  if (next_[s] != kNil) prev_[next_[s]] = prev_[s]; else tail_ = prev_[s];
  prev_[s] = next_[s] = kNil;
  linked_[s] = 0;
}

void LruPolicy::push_front(uint32_t s) {
  prev_[s] = kNil;
  next_[s] = head_;
  if (head_ != kNil) prev_[head_] = s;
  head_ = s;
  if (tail_ == kNil) tail_ = s;
  linked_[s] = 1;
}

void LruPolicy::on_insert(uint32_t slot) { unlink(slot); push_front(slot); }
void LruPolicy::on_access(uint32_t slot) { unlink(slot); push_front(slot); }
void LruPolicy::on_erase(uint32_t slot) { unlink(slot); }
int64_t LruPolicy::victim() { return tail_ == kNil ? -1 : static_cast<int64_t>(tail_); }

BlockCache::BlockCache(uint32_t slots, std::unique_ptr<ReplacementPolicy> policy)
    : policy_(std::move(policy)), owner_(slots), occupied_(slots, 0) {
  map_.reserve(slots);
  free_.reserve(slots);
  for (uint32_t s = slots; s-- > 0;) free_.push_back(s);
}

int64_t BlockCache::find(const PageKey &key, bool touch) {
  auto it = map_.find(key);
  if (it == map_.end()) return -1;
  if (touch) policy_->on_access(it->second);
  return it->second;
}

BlockCache::Admission BlockCache::admit(const PageKey &key, uint64_t epoch) {
  Admission a;
  if (free_.empty()) {
    // 1. Evict the policy's victim into quarantine.
    int64_t v = policy_->victim();
    if (v >= 0) {
      uint32_t s = static_cast<uint32_t>(v);
      a.evicted = true;
      a.victim = owner_[s];
      a.victim_slot = s;
      map_.erase(owner_[s]);
      policy_->on_erase(s);
      occupied_[s] = 0;
      quarantine_.push_back({s, epoch});
    }
  }
  // 2. Take a free slot if one is left (the victim's is not: it is
  //    quarantined until the steps that may read it are done).
  if (free_.empty()) return a;
  uint32_t s = free_.back();
  free_.pop_back();
  owner_[s] = key;
  occupied_[s] = 1;
  map_.emplace(key, s);
  policy_->on_insert(s);
  a.slot = s;
  return a;
}

std::vector<uint32_t> BlockCache::drop_sequence(uint64_t seq, uint64_t epoch) {
  std::vector<uint32_t> dropped;
  for (auto it = map_.begin(); it != map_.end();) {
    if (it->first.seq == seq) {
      uint32_t s = it->second;
      policy_->on_erase(s);
      occupied_[s] = 0;
      quarantine_.push_back({s, epoch});
      dropped.push_back(s);
      it = map_.erase(it);
    } else {
      ++it;
    }
  }
  return dropped;
}

void BlockCache::release_quarantine(uint64_t safe_epoch) {
  auto keep = std::remove_if(quarantine_.begin(), quarantine_.end(), [&](const Quarantined &q) {
    if (q.epoch < safe_epoch) {
      free_.push_back(q.slot);
      return true;
    }
    return false;
  });
  quarantine_.erase(keep, quarantine_.end());
}

}  // namespace wkv

namespace wkv {

void BlockCache::restamp_quarantine(uint64_t from, uint64_t to) {
  for (Quarantined &q : quarantine_)
    if (q.epoch == from) q.epoch = to;
}

}  // namespace wkv
