#include "lib/buffer/replacement.hpp"

namespace wkv {

LruPolicy::LruPolicy(uint32_t frames) : prev_(frames, kNil), next_(frames, kNil), linked_(frames, 0) {}

void LruPolicy::unlink(uint32_t f) {
  if (!linked_[f]) return;
  if (prev_[f] != kNil) next_[prev_[f]] = next_[f]; else head_ = next_[f];
  if (next_[f] != kNil) prev_[next_[f]] = prev_[f]; else tail_ = prev_[f];
  prev_[f] = next_[f] = kNil;
  linked_[f] = 0;
}

void LruPolicy::push_front(uint32_t f) {
  prev_[f] = kNil;
  next_[f] = head_;
  if (head_ != kNil) prev_[head_] = f;
  head_ = f;
  if (tail_ == kNil) tail_ = f;
  linked_[f] = 1;
}

void LruPolicy::on_insert(uint32_t frame) { unlink(frame); push_front(frame); }
void LruPolicy::on_access(uint32_t frame) {
  if (linked_[frame]) {
    unlink(frame);
    push_front(frame);
  }
}
void LruPolicy::on_access_all(const uint32_t *frames, size_t n) {
  // A frame's links are read before they are written: fetch them, and the
  // list neighbours they name, a few frames ahead (the arrays are a few MB
  // at a large cache: each access would otherwise wait on DRAM in turn).
  constexpr size_t kAhead = 16, kNear = 8;
  const uint32_t units = static_cast<uint32_t>(linked_.size());
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n && frames[i + kAhead] < units) {
      const uint32_t f = frames[i + kAhead];
      __builtin_prefetch(&linked_[f]);
      __builtin_prefetch(&prev_[f]);
      __builtin_prefetch(&next_[f]);
    }
    if (i + kNear < n && frames[i + kNear] < units) {
      const uint32_t f = frames[i + kNear];
      const uint32_t p = prev_[f], q = next_[f];
      if (p != kNil) __builtin_prefetch(&next_[p], 1);
      if (q != kNil) __builtin_prefetch(&prev_[q], 1);
    }
    if (frames[i] < units) on_access(frames[i]);
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
