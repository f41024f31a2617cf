#include "lib/common/meta_alloc.hpp"

#include <cstdlib>

#if defined(WKV_WITH_MIMALLOC)
#include <dlfcn.h>
#endif

namespace wkv {
namespace {

struct MetaAllocatorFns {
  void *(*alloc)(size_t) = nullptr;
  void (*release)(void *) = nullptr;
  const char *name = "libc";
};

// Resolved once, on first use. Without mimalloc (or under the sanitizers,
// which must see every allocation) the C allocator serves.
const MetaAllocatorFns &fns() {
  static const MetaAllocatorFns f = [] {
    MetaAllocatorFns r;
    r.alloc = [](size_t n) { return std::malloc(n == 0 ? 1 : n); };
    r.release = [](void *p) { std::free(p); };
#if defined(WKV_WITH_MIMALLOC)
    // The library found at build time first, then its soname on the
    // loader's path. RTLD_LOCAL keeps its malloc out of everyone's scope.
    void *h = nullptr;
    for (const char *lib : {WKV_MIMALLOC_PATH, WKV_MIMALLOC_SONAME})
      if (lib[0] && (h = dlopen(lib, RTLD_NOW | RTLD_LOCAL))) break;
    if (h) {
      auto a = reinterpret_cast<void *(*)(size_t)>(dlsym(h, "mi_malloc"));
      auto d = reinterpret_cast<void (*)(void *)>(dlsym(h, "mi_free"));
      if (a && d) {
        r.alloc = a;
        r.release = d;
        r.name = "mimalloc";
      }
      // The handle is kept for the life of the process: memory it handed
      // out may be freed as late as static destructors.
    }
#endif
    return r;
  }();
  return f;
}

}  // namespace

void *meta_malloc(size_t bytes) noexcept { return fns().alloc(bytes); }
void meta_free(void *p) noexcept {
  if (p) fns().release(p);
}
const char *meta_allocator_name() noexcept { return fns().name; }

}  // namespace wkv
