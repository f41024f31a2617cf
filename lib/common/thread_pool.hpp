// The engine's thread pool: a oneTBB task arena of a fixed number of worker
// threads, so that one engine's work never oversubscribes the cores given to
// it and parallel loops nest safely.
#pragma once

#include <cstddef>
#include <utility>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

namespace wkv {

class ThreadPool {
 public:
  // threads == 0: one per core.
  explicit ThreadPool(unsigned threads)
      : arena_(threads == 0 ? tbb::task_arena::automatic : static_cast<int>(threads)) {}

  int threads() { return arena_.max_concurrency(); }

  // Runs fn(i) for i in [0, n) on the pool; returns when all are done.
  // Exceptions thrown by fn propagate to the caller (the first one).
  template <typename Fn> void parallel_for(size_t n, Fn &&fn) {
    if (n == 0) return;
    if (n == 1) {
      fn(size_t{0});
      return;
    }
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1), [&](const tbb::blocked_range<size_t> &r) {
        for (size_t i = r.begin(); i != r.end(); ++i) fn(i);
      });
    });
  }

 private:
  tbb::task_arena arena_;
};

}  // namespace wkv
