// The engine's thread pool: a oneTBB task arena of a fixed number of worker
// threads, so that one engine's work never oversubscribes the cores given to
// it and parallel loops nest safely.
#pragma once

#include <cstddef>
#include <utility>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#if defined(__SANITIZE_THREAD__)
#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>
#endif

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
#if defined(__SANITIZE_THREAD__)
    parallel_for_threads(n, fn);
#else
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1), [&](const tbb::blocked_range<size_t> &r) {
        for (size_t i = r.begin(); i != r.end(); ++i) fn(i);
      });
    });
#endif
  }

 private:
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer builds run the loops on plain threads, as many as the
  // arena has: a libtbb not built with the sanitizer hides its
  // synchronization from it, which then reports oneTBB's own hand-offs of
  // its tasks as races. The contract is the same; the bodies still run
  // concurrently, which is what the sanitizer is there to check.
  template <typename Fn> void parallel_for_threads(size_t n, Fn &fn) {
    const size_t workers = std::min<size_t>(n, static_cast<size_t>(std::max(1, arena_.max_concurrency())));
    std::atomic<size_t> next{0};
    std::mutex mu;
    std::exception_ptr first;
    auto work = [&] {
      try {
        for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
        next.store(n);
      }
    };
    std::vector<std::thread> threads;
    try {
      threads.reserve(workers - 1);
      for (size_t w = 1; w < workers; ++w) threads.emplace_back(work);
    } catch (...) {
      // Fewer threads: the caller's own share below covers every index.
    }
    work();
    for (std::thread &t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }
#endif

  tbb::task_arena arena_;
};

}  // namespace wkv
