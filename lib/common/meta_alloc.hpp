// Allocation of engine metadata (meta index, mapping tables, page lists):
// through mimalloc where it is installed, which keeps many small, growing
// per-head arrays fast and unfragmented; the C allocator otherwise.
//
// mimalloc is reached through its mi_ API only, from a copy of the library
// that libwavekv loads itself with dlopen(RTLD_LOCAL): Debian's
// libmimalloc.so.2 exports malloc, free and operator new, so linking it
// would replace the allocator of every process that loads libwavekv, and a
// Python process that already runs C++ code (NumPy, PyTorch) then frees its
// own memory with mimalloc and crashes. Loaded locally, its symbols are
// visible to no one but us: the process keeps its allocator, and memory
// from meta_malloc goes back through meta_free only.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace wkv {

// Bytes from the metadata allocator (16-byte aligned), or nullptr.
void *meta_malloc(size_t bytes) noexcept;
// Returns memory from meta_malloc. nullptr is a no-op.
void meta_free(void *p) noexcept;
// "mimalloc" or "libc": which allocator meta_malloc uses in this process.
const char *meta_allocator_name() noexcept;

// An STL allocator over meta_malloc; throws std::bad_alloc when it fails.
template <typename T> struct MetaAllocator {
  using value_type = T;
  MetaAllocator() noexcept = default;
  template <typename U> MetaAllocator(const MetaAllocator<U> &) noexcept {}
  T *allocate(size_t n) {
    if (n > static_cast<size_t>(-1) / sizeof(T)) throw std::bad_alloc();
    void *p = meta_malloc(n * sizeof(T));
    if (!p) throw std::bad_alloc();
    return static_cast<T *>(p);
  }
  void deallocate(T *p, size_t) noexcept { meta_free(p); }
  template <typename U> bool operator==(const MetaAllocator<U> &) const noexcept { return true; }
  template <typename U> bool operator!=(const MetaAllocator<U> &) const noexcept { return false; }
};

// A vector of metadata.
template <typename T> using MetaVector = std::vector<T, MetaAllocator<T>>;

}  // namespace wkv
