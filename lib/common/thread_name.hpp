// Names a thread, as `top -H`, `ps -L`, perf and debuggers show
// it: each of the engine's own long-lived threads says what it is
// (wkv-buffers, wkv-pin-ahead, wkv-stats, wkv-cold), so that a runtime can
// tell them from its own, bind them or profile them.
#pragma once

#include <pthread.h>

#include <thread>

namespace wkv {

// Names t, from the thread that started it (so that the name is there when
// the starter goes on). At most 15 characters (Linux's limit); a longer name
// leaves the thread's name as it was.
inline void name_thread(std::thread &t, const char *name) noexcept {
  (void)pthread_setname_np(t.native_handle(), name);
}

}  // namespace wkv
