// The C ABI's handles. A handle is not the address of an object: its value
// names a slot of a process-wide table and the slot's generation, so that a
// destroyed handle is refused even after the slot (or the memory the object
// had) is reused, a handle of another type is refused, and destroying a
// handle twice is a no-op. The library never dereferences a handle's value.
//
//   63      56 55                              24 23                  0
//   |  type   |        generation (32 bits)       |    slot (24 bits)  |
//
// A slot's generation moves on at every destroy; a slot whose generation
// would wrap is retired, never reused. Lookups copy the object's shared_ptr
// under the table's lock, so a call holds its object alive even if another
// thread destroys the handle meanwhile (against the header's contract, but
// not a crash).
//
// Handles do not cross a fork: each slot keeps the process that made its
// object. In a forked child the parent's engine threads (and its device
// context) do not exist, so the parent's handles are refused there
// (get() says `foreign`), and their destroy hands the object to forsake()
// rather than run a destructor that would wait for those threads forever.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace wkv::capi {

// This process's id, kept current across forks by a fork handler (a read,
// not a system call). The first call, when the library is loaded
// (capi/wavekv.cpp), registers the handlers.
pid_t process_id();

// Keeps `obj` alive for the rest of the process, reachably, without ever
// destroying it: a forked child's share of its parent's objects.
void forsake(std::shared_ptr<void> obj);

static_assert(sizeof(void *) == 8, "handles encode 64-bit values");

template <typename T, uint8_t Type> class HandleTable {
 public:
  static constexpr uint32_t kMaxSlots = 1u << 24;

  // Registers obj and returns its handle's value, or 0 when every slot is
  // taken. May throw std::bad_alloc (nothing registered then).
  uint64_t insert(std::shared_ptr<T> obj) {
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      if (slots_.size() >= kMaxSlots) return 0;
      free_.reserve(slots_.size() + 1);  // so that remove() never allocates
      slots_.emplace_back();
      slot = static_cast<uint32_t>(slots_.size() - 1);
    }
    slots_[slot].obj = std::move(obj);
    slots_[slot].pid = process_id();
    return encode(slot, slots_[slot].gen);
  }

  // The object of a live handle of this type, or nullptr; `foreign` (if
  // given) says whether a live handle was made by another process (this
  // one's parent, before a fork), whose object is then not handed out.
  std::shared_ptr<T> get(uint64_t h, bool *foreign = nullptr) const {
    if (foreign) *foreign = false;
    uint32_t slot, gen;
    if (!decode(h, &slot, &gen)) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    if (slot >= slots_.size() || slots_[slot].gen != gen) return nullptr;
    if (slots_[slot].obj && slots_[slot].pid != process_id()) {
      if (foreign) *foreign = true;
      return nullptr;
    }
    return slots_[slot].obj;
  }

  // Ends a live handle and hands back its object (released by the caller,
  // outside the lock); nullptr for a handle that is not live. An object of
  // another process (before a fork) goes to forsake(), never destroyed
  // here, and nullptr is handed back.
  std::shared_ptr<T> remove(uint64_t h) {
    uint32_t slot, gen;
    if (!decode(h, &slot, &gen)) return nullptr;
    std::shared_ptr<T> obj;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (slot >= slots_.size() || slots_[slot].gen != gen || !slots_[slot].obj) return nullptr;
      obj = std::move(slots_[slot].obj);
      slots_[slot].obj.reset();
      if (++slots_[slot].gen != 0) free_.push_back(slot);  // reserved at insert: no throw
      if (slots_[slot].pid == process_id()) return obj;
    }
    forsake(std::move(obj));
    return nullptr;
  }

  // The fork handlers' (process_id()): the table's lock is held across a
  // fork, so that the child never finds it taken by a thread it lacks.
  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }

 private:
  struct Slot {
    uint32_t gen = 1;
    pid_t pid = 0;  // the process that made obj
    std::shared_ptr<T> obj;
  };
  static uint64_t encode(uint32_t slot, uint32_t gen) {
    return (static_cast<uint64_t>(Type) << 56) | (static_cast<uint64_t>(gen) << 24) | slot;
  }
  static bool decode(uint64_t h, uint32_t *slot, uint32_t *gen) {
    if ((h >> 56) != Type) return false;
    *slot = static_cast<uint32_t>(h & (kMaxSlots - 1));
    *gen = static_cast<uint32_t>(h >> 24);
    return *gen != 0;
  }

  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
};

}  // namespace wkv::capi
