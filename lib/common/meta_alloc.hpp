// Allocation of engine metadata (meta index, mapping tables, page lists):
// through mimalloc when the build has it, which keeps many small, growing
// per-head arrays fast and unfragmented; the standard allocator otherwise.
#pragma once

#include <vector>

#if defined(WKV_WITH_MIMALLOC)
#include <mimalloc.h>
#endif

namespace wkv {

#if defined(WKV_WITH_MIMALLOC)
template <typename T> using MetaAllocator = mi_stl_allocator<T>;
#else
template <typename T> using MetaAllocator = std::allocator<T>;
#endif

// A vector of metadata.
template <typename T> using MetaVector = std::vector<T, MetaAllocator<T>>;

}  // namespace wkv
