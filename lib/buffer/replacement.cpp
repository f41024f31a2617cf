#include "lib/buffer/replacement.hpp"

namespace wkv {

LruPolicy::LruPolicy(uint32_t frames, uint32_t first)
    : stamps_(frames, kOut), at_(frames, kOut), tail_(first), head_(first), moves_(first) {
  size_t cap = 64;
  while (cap < 2 * static_cast<size_t>(frames)) cap *= 2;
  ring_.assign(cap, kOut);
  mask_ = static_cast<uint32_t>(cap - 1);
  kept_.reserve(frames);  // compact allocates nothing
}

void LruPolicy::push(uint32_t f) {
  if (static_cast<size_t>(head_ - tail_) + 2 > ring_.size()) compact();
  if (head_ == kOut) ring_[head_++ & mask_] = kOut;  // kOut is no frame's place
  ring_[head_ & mask_] = f;
  at_[f] = head_++;
  if (moves_ == kOut) ++moves_;  // nor its stamp
  stamps_[f] = moves_++;
}

void LruPolicy::compact() {
  // The live entries, oldest first, at places from 0: at most one a frame,
  // so at most half the ring, and the next compaction is half a ring of
  // moves away. Stamps stay.
  kept_.clear();
  const uint32_t n = static_cast<uint32_t>(at_.size());
  for (uint32_t p = tail_; p != head_; ++p) {
    const uint32_t f = ring_[p & mask_];
    if (f < n && at_[f] == p) kept_.push_back(f);
  }
  tail_ = head_ = 0;
  for (uint32_t f : kept_) {
    ring_[head_ & mask_] = f;
    at_[f] = head_++;
  }
}

void LruPolicy::on_insert(uint32_t frame) {
  if (stamps_[frame] == kOut) ++resident_;
  push(frame);
}

void LruPolicy::on_access(uint32_t frame) {
  // Not resident (evicted while the step ran), or not far enough from the
  // front to move.
  const uint32_t s = stamps_[frame];
  if (s == kOut || static_cast<uint32_t>(moves_ - s) <= resident_ / 4 * 3) return;
  push(frame);
}

void LruPolicy::on_access_all(const uint32_t *frames, size_t n) {
  // Stamps a few frames ahead: each is a cache miss when they outgrow the
  // CPU's caches.
  constexpr size_t kAhead = 16;
  const uint32_t units = static_cast<uint32_t>(stamps_.size());
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n && frames[i + kAhead] < units) __builtin_prefetch(&stamps_[frames[i + kAhead]]);
    if (frames[i] < units) on_access(frames[i]);
  }
}

void LruPolicy::on_insert_all(const uint32_t *frames, size_t n) {
  constexpr size_t kAhead = 16;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      __builtin_prefetch(&stamps_[frames[i + kAhead]], 1);
      __builtin_prefetch(&at_[frames[i + kAhead]], 1);
    }
    on_insert(frames[i]);
  }
}

void LruPolicy::on_erase(uint32_t frame) {
  if (stamps_[frame] == kOut) return;
  stamps_[frame] = at_[frame] = kOut;
  --resident_;
}

int64_t LruPolicy::victim() {
  // The oldest live entry; the entries passed are dead (their frames moved
  // again or left). The caller erases the victim, whose entry the next
  // call passes.
  constexpr uint32_t kAhead = 16;
  const uint32_t n = static_cast<uint32_t>(at_.size());
  for (; tail_ != head_; ++tail_) {
    if (static_cast<uint32_t>(head_ - tail_) > kAhead) {
      const uint32_t ahead = ring_[(tail_ + kAhead) & mask_];
      if (ahead < n) __builtin_prefetch(&at_[ahead]);
    }
    const uint32_t f = ring_[tail_ & mask_];
    if (f < n && at_[f] == tail_) return f;
  }
  return -1;
}

ClockPolicy::ClockPolicy(uint32_t frames) : count_(frames, kOut) {}

void ClockPolicy::on_insert(uint32_t frame) {
  if (count_[frame] == kOut) ++resident_;
  count_[frame] = 1;  // a sweep's grace: admitted for the steps that follow
}

void ClockPolicy::on_access(uint32_t frame) {
  uint8_t &c = count_[frame];
  if (c != kOut && c < 3) ++c;
}

void ClockPolicy::on_erase(uint32_t frame) {
  if (count_[frame] != kOut) --resident_;
  count_[frame] = kOut;
}

int64_t ClockPolicy::victim() {
  if (resident_ == 0) return -1;
  // Every resident count reaches zero within four sweeps.
  const uint32_t n = static_cast<uint32_t>(count_.size());
  for (uint64_t steps = 0; steps < 4ull * n + 1; ++steps) {
    const uint32_t f = hand_;
    hand_ = hand_ + 1 == n ? 0 : hand_ + 1;
    uint8_t &c = count_[f];
    if (c == kOut) continue;
    if (c == 0) return f;  // the caller erases it
    --c;
  }
  return -1;  // unreachable while resident_ counts right
}

SlruPolicy::SlruPolicy(uint32_t frames, float protected_frac)
    : probation_(frames), protected_(frames), where_(frames, kNone),
      protected_cap_(static_cast<uint32_t>(protected_frac * static_cast<float>(frames))) {}

void SlruPolicy::on_insert(uint32_t frame) {
  on_erase(frame);
  probation_.on_insert(frame);
  where_[frame] = kProbation;
}

void SlruPolicy::on_access(uint32_t frame) {
  switch (where_[frame]) {
    case kProtected:
      protected_.on_access(frame);
      return;
    case kProbation:
      probation_.on_erase(frame);
      protected_.on_insert(frame);
      where_[frame] = kProtected;
      ++protected_n_;
      // The protected list's oldest go back to probation, as its newest.
      while (protected_n_ > protected_cap_) {
        const int64_t old = protected_.victim();
        if (old < 0) break;
        const uint32_t o = static_cast<uint32_t>(old);
        protected_.on_erase(o);
        --protected_n_;
        probation_.on_insert(o);
        where_[o] = kProbation;
      }
      return;
    default:
      return;
  }
}

void SlruPolicy::on_erase(uint32_t frame) {
  if (where_[frame] == kProbation) probation_.on_erase(frame);
  if (where_[frame] == kProtected) {
    protected_.on_erase(frame);
    --protected_n_;
  }
  where_[frame] = kNone;
}

int64_t SlruPolicy::victim() {
  const int64_t v = probation_.victim();
  return v >= 0 ? v : protected_.victim();
}

std::unique_ptr<ReplacementPolicy> make_policy(const std::string &name, uint32_t frames) {
  if (name == "lru") return std::make_unique<LruPolicy>(frames);
  if (name == "clock") return std::make_unique<ClockPolicy>(frames);
  if (name == "slru") return std::make_unique<SlruPolicy>(frames);
  return nullptr;
}

}  // namespace wkv
