// Replacement policies of the device block cache: which resident frame to
// give up next. One small interface, so that CLOCK or a score-aware policy
// can replace LRU.
#pragma once

#include <cstdint>
#include <vector>

namespace wkv {

class ReplacementPolicy {
 public:
  virtual ~ReplacementPolicy() = default;
  // A frame became resident.
  virtual void on_insert(uint32_t frame) = 0;
  // A resident frame was read by a step.
  virtual void on_access(uint32_t frame) = 0;
  // A frame stopped being resident.
  virtual void on_erase(uint32_t frame) = 0;
  // The next victim among resident frames, or -1 if none is resident.
  virtual int64_t victim() = 0;
};

// Least recently used, as an intrusive doubly linked list over frames.
class LruPolicy final : public ReplacementPolicy {
 public:
  explicit LruPolicy(uint32_t frames);
  void on_insert(uint32_t frame) override;
  void on_access(uint32_t frame) override;
  void on_erase(uint32_t frame) override;
  int64_t victim() override;

 private:
  void unlink(uint32_t f);
  void push_front(uint32_t f);
  static constexpr uint32_t kNil = 0xffffffffu;
  std::vector<uint32_t> prev_, next_;
  std::vector<char> linked_;
  uint32_t head_ = kNil, tail_ = kNil;  // head = most recent
};

}  // namespace wkv
