// Replacement policies of the device block cache: which resident frame to
// give up next. One small interface; the engine takes LRU unless
// WKV_CACHE_POLICY names another (make_policy), and bench/RESULTS.md has
// them measured against each other on the serving benchmark.
//
// Calls come from the buffer manager's thread only (under its lock or
// not): no policy is thread-safe on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace wkv {

class ReplacementPolicy {
 public:
  virtual ~ReplacementPolicy() = default;
  // A frame became resident.
  virtual void on_insert(uint32_t frame) = 0;
  // A frame was read by a step; ignored unless it is resident (a frame
  // evicted while the step ran).
  virtual void on_access(uint32_t frame) = 0;
  // on_access of each of n frames (each below the policy's frame count),
  // in order. A step's hits are thousands of frames spread over the cache:
  // a policy may fetch the state of the next ones ahead while it updates
  // the current one.
  virtual void on_access_all(const uint32_t *frames, size_t n) {
    for (size_t i = 0; i < n; ++i) on_access(frames[i]);
  }
  // on_insert of each of n frames (each below the policy's frame count), in
  // order: a step's admissions, as spread as its hits.
  virtual void on_insert_all(const uint32_t *frames, size_t n) {
    for (size_t i = 0; i < n; ++i) on_insert(frames[i]);
  }
  // A frame stopped being resident.
  virtual void on_erase(uint32_t frame) = 0;
  // The next victim among resident frames, or -1 if none is resident.
  virtual int64_t victim() = 0;
};

// Least recently used, with a promotion threshold, kept as a queue: the
// frames in the order they last moved to the front, in a ring of frame ids,
// each frame knowing its current place there; an older entry of a frame
// that moved again, or of one erased, is skipped when the tail reaches it.
// A read frame moves to the front only when more moves to the front than
// three quarters of the resident frames have happened since its own (its
// stamp), that is when it may have reached the queue's last quarter, where
// victims come from ("lazy promotion": Yang et al., FIFO queues are all
// you need for cache eviction, SOSP'23). A step's hits are mostly the
// frames the steps just before it read: each costs a read of its stamp (4
// bytes a frame, dense enough to stay in the CPU's caches); admissions
// append; victims come from a scan along the ring with the next places
// fetched ahead, where a linked list's tail is a chain of dependent cache
// misses (about 50 ns a victim on the H100 machine's host, a third of the
// manager's time at batch 7). When the ring fills with skipped entries it
// is compacted, in order. Stamps, places and the move count wrap at 2^32:
// a frame left unmoved for 2^32 moves may look recent once and wait for
// its next read to move (a choice of victim, never a wrong result).
class LruPolicy final : public ReplacementPolicy {
 public:
  // The move count and places start at `first` (tests of their wrap).
  explicit LruPolicy(uint32_t frames, uint32_t first = 0);
  void on_insert(uint32_t frame) override;
  void on_access(uint32_t frame) override;
  void on_access_all(const uint32_t *frames, size_t n) override;
  void on_insert_all(const uint32_t *frames, size_t n) override;
  void on_erase(uint32_t frame) override;
  int64_t victim() override;

 private:
  static constexpr uint32_t kOut = 0xffffffffu;  // stamp and place of a frame not resident; no frame's otherwise
  void push(uint32_t frame);
  void compact();
  std::vector<uint32_t> stamps_;  // moves_ when each frame last moved to the front (hits read only these)
  std::vector<uint32_t> at_;      // each frame's place in the ring (victims read only these)
  std::vector<uint32_t> ring_;    // frame ids by place (& mask_); a power of two, at least twice the frames
  std::vector<uint32_t> kept_;    // compact's scratch
  uint32_t mask_ = 0;
  uint32_t tail_ = 0, head_ = 0;  // places [tail_, head_) are in the ring; head_ is the next
  uint32_t moves_ = 0;
  uint32_t resident_ = 0;
};

// CLOCK with a two-bit use count (GCLOCK): a frame enters at 1, an access
// raises its count (to 3 at most), the hand lowers the counts it passes and
// gives up the first frame at zero. A frame read on several steps survives as many
// sweeps; one read once goes on the next.
class ClockPolicy final : public ReplacementPolicy {
 public:
  explicit ClockPolicy(uint32_t frames);
  void on_insert(uint32_t frame) override;
  void on_access(uint32_t frame) override;
  void on_erase(uint32_t frame) override;
  int64_t victim() override;

 private:
  static constexpr uint8_t kOut = 0xff;  // not resident
  std::vector<uint8_t> count_;
  uint32_t hand_ = 0, resident_ = 0;
};

// Segmented LRU: a frame enters a probation list and moves to a protected
// one when it is read again; the protected list holds at most
// `protected_frac` of the frames (its oldest go back to probation), and
// victims come from probation first. A burst of frames read once (a new
// query's clusters) then displaces frames read once before it, not those
// the steps keep coming back to.
class SlruPolicy final : public ReplacementPolicy {
 public:
  explicit SlruPolicy(uint32_t frames, float protected_frac = 0.8f);
  void on_insert(uint32_t frame) override;
  void on_access(uint32_t frame) override;
  void on_erase(uint32_t frame) override;
  int64_t victim() override;

 private:
  enum : uint8_t { kNone, kProbation, kProtected };
  LruPolicy probation_, protected_;
  std::vector<uint8_t> where_;
  uint32_t protected_n_ = 0, protected_cap_ = 0;
};

// The policy named `name` ("lru", "clock", "slru") over `frames` frames, or
// null for another name.
std::unique_ptr<ReplacementPolicy> make_policy(const std::string &name, uint32_t frames);

}  // namespace wkv
