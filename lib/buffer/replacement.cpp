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
void LruPolicy::on_erase(uint32_t frame) { unlink(frame); }
int64_t LruPolicy::victim() { return tail_ == kNil ? -1 : static_cast<int64_t>(tail_); }

}  // namespace wkv
