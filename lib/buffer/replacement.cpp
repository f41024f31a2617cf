#include "lib/buffer/replacement.hpp"

namespace wkv {

LruPolicy::LruPolicy(uint32_t frames) : links_(frames), stamps_(frames, 0) {}

void LruPolicy::unlink(uint32_t f) {
  Link &l = links_[f];
  if (l.prev == kOut) return;
  if (l.prev != kNil) links_[l.prev].next = l.next; else head_ = l.next;
  if (l.next != kNil) links_[l.next].prev = l.prev; else tail_ = l.prev;
  l = Link{};
  --resident_;
}

void LruPolicy::push_front(uint32_t f) {
  links_[f] = Link{kNil, head_};
  stamps_[f] = moves_++;
  if (head_ != kNil) links_[head_].prev = f;
  head_ = f;
  if (tail_ == kNil) tail_ = f;
  ++resident_;
}

void LruPolicy::on_insert(uint32_t frame) { unlink(frame); push_front(frame); }

void LruPolicy::on_access(uint32_t frame) {
  // Not far enough from the front to move, or not resident (a frame
  // evicted while the step ran).
  if (static_cast<uint32_t>(moves_ - stamps_[frame]) <= resident_ / 4 * 3 || !linked(frame)) return;
  unlink(frame);
  push_front(frame);
}

void LruPolicy::on_access_all(const uint32_t *frames, size_t n) {
  // Stamps a few frames ahead: each is a cache miss when the stamps
  // outgrow the CPU's caches.
  constexpr size_t kAhead = 16;
  const uint32_t units = static_cast<uint32_t>(links_.size());
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n && frames[i + kAhead] < units) __builtin_prefetch(&stamps_[frames[i + kAhead]]);
    if (frames[i] < units) on_access(frames[i]);
  }
}

void LruPolicy::on_insert_all(const uint32_t *frames, size_t n) {
  // An admitted frame's links are read (it may be listed) and written.
  constexpr size_t kAhead = 16;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      __builtin_prefetch(&links_[frames[i + kAhead]], 1);
      __builtin_prefetch(&stamps_[frames[i + kAhead]], 1);
    }
    on_insert(frames[i]);
  }
}

void LruPolicy::on_erase(uint32_t frame) { unlink(frame); }
int64_t LruPolicy::victim() { return tail_ == kNil ? -1 : static_cast<int64_t>(tail_); }

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
