// A seeded stress test: 8 threads create sequences, append to them, decode
// them (one or two at a time), save and load them back (the loaded sequence
// takes the saved one's place), and destroy them, against one engine with a
// small host budget, for a bounded time. Every decode runs at full retrieval
// and is checked against exact attention; an append refused for the budget
// must leave its sequence as it was; at the end the engine's memory is back
// where it started. Runs under ThreadSanitizer in CI.
//
//   WKV_STRESS_SEED     the seed (default 1; printed)
//   WKV_STRESS_SECONDS  how long the threads run (default 3)
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "files_support.hpp"
#include "support.hpp"
#include "wavekv/wavekv.hpp"

using namespace wkvtest;

namespace {

constexpr uint32_t kQ = 4, kKV = 2, kD = 64, kLayers = 2, kThreads = 8;

// A crash prints its backtrace to stderr before the default action: CI saw
// this test end in a SIGSEGV at its start, once, with nothing to go on, and
// it did not reproduce here. Not under a sanitizer, whose own report is
// better.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
void print_backtrace_and_die(int sig) {
  static const char msg[] = "test_stress: fatal signal; backtrace:\n";
  (void)!write(2, msg, sizeof msg - 1);
  void *frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
const bool kBacktraceOnCrash = [] {
  void *warm[1];
  (void)backtrace(warm, 1);  // loads the unwinder now, not in the handler
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE}) std::signal(sig, print_backtrace_and_die);
  return true;
}();
#endif

uint64_t env_or(const char *name, uint64_t fallback) {
  const char *s = std::getenv(name);
  return s && *s ? std::strtoull(s, nullptr, 10) : fallback;
}

// A sequence and its rows, kept for exact attention.
struct Tracked {
  std::unique_ptr<wavekv::Sequence> seq;
  std::vector<HeadRows> rows;  // [layer * kKV + head]
  KeyGen gen;
  Tracked(const wavekv::Engine &e, uint64_t seed)
      : seq(std::make_unique<wavekv::Sequence>(e)), rows(kLayers * kKV), gen(kKV, kD, seed, 8, 50) {}

  // Appends n tokens to every layer; the status of the first refusal.
  int append(uint32_t n) {
    std::vector<float> k, v;
    gen.next(n, &k, &v);
    for (uint32_t l = 0; l < kLayers; ++l) {
      const int rc = wkv_seq_append(seq->get(), l, k.data(), v.data(), n, 0, 0, nullptr);
      if (rc != WKV_OK) return rc;  // the layers before keep the rows: mirror them
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t h = 0; h < kKV; ++h) {
          const size_t off = (static_cast<size_t>(t) * kKV + h) * kD;
          HeadRows &r = rows[l * kKV + h];
          r.k.insert(r.k.end(), k.begin() + off, k.begin() + off + kD);
          r.v.insert(r.v.end(), v.begin() + off, v.begin() + off + kD);
        }
    }
    return WKV_OK;
  }
  uint64_t tokens(uint32_t layer) const { return rows[layer * kKV].tokens(kD); }
};

}  // namespace

TEST(Stress, EightThreadsCreateAppendDecodeAndDestroyAgainstOneEngine) {
  const uint64_t seed = env_or("WKV_STRESS_SEED", 1);
  const double seconds = static_cast<double>(env_or("WKV_STRESS_SECONDS", 3));
  std::printf("stress: seed %llu, %.0f s, %u threads\n", static_cast<unsigned long long>(seed), seconds, kThreads);
  wkv_config c;
  wkv_config_init(&c);
  c.n_layers = kLayers;
  c.n_q_heads = kQ;
  c.n_kv_heads = kKV;
  c.head_dim = kD;
  c.dtype = WKV_DTYPE_F32;
  c.segment_tokens = 256;
  c.update_segment_tokens = 64;
  c.retrieval_frac = 1.0f;  // full retrieval: every decode is exact
  c.estimation_frac = 0.0f;
  c.threads = 2;
  c.host_budget_bytes = 6u << 20;  // a few thousand tokens in all: appends hit it
  wavekv::Engine engine(c);
  const wkv_stats before = engine.stats();
  const ScratchDir scratch;  // removed with whatever a failing thread left in it
  ASSERT_FALSE(scratch.path().empty());

  std::atomic<uint64_t> decodes{0}, refusals{0}, failures{0}, reloads{0};
  std::vector<std::string> errors(kThreads);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed * 1000003 + t);
      wavekv::Plan plan(engine);
      std::vector<std::unique_ptr<Tracked>> mine;
      auto fail = [&](const std::string &what) {
        if (errors[t].empty()) errors[t] = what;
        ++failures;
      };
      try {
        while (std::chrono::steady_clock::now() < until && failures.load() == 0) {
          const uint32_t op = rng() % 11;
          if (mine.empty() || (op == 0 && mine.size() < 3)) {
            mine.push_back(std::make_unique<Tracked>(engine, rng()));
          } else if (op <= 4) {
            Tracked &s = *mine[rng() % mine.size()];
            const uint64_t had = s.tokens(0);
            const int rc = s.append(1 + static_cast<uint32_t>(rng() % 200));
            if (rc == WKV_ERR_BUDGET) {
              ++refusals;
              wkv_seq_info info;
              wkv_seq_info_init(&info);
              if (wkv_seq_info_get(s.seq->get(), 0, &info) != WKV_OK || info.tokens != s.tokens(0))
                fail("a refused append changed its sequence");
              (void)had;
              mine.erase(mine.begin());  // make room
            } else if (rc != WKV_OK) {
              fail(std::string("append: ") + wkv_status_name(rc) + ": " + wkv_last_error());
            }
          } else if (op <= 8) {
            // One or two of this thread's sequences, at a random layer.
            std::vector<Tracked *> batch{mine[rng() % mine.size()].get()};
            if (mine.size() > 1 && rng() % 2) {
              Tracked *other = mine[rng() % mine.size()].get();
              if (other != batch[0]) batch.push_back(other);
            }
            const uint32_t layer = static_cast<uint32_t>(rng() % kLayers);
            bool empty = false;
            for (Tracked *s : batch) empty |= s->tokens(layer) == 0;
            if (empty) continue;
            std::vector<float> q;
            for (Tracked *s : batch)
              for (uint32_t h = 0; h < kKV; ++h) s->gen.query(h, kQ / kKV, &q);
            std::vector<wkv_seq *> seqs;
            for (Tracked *s : batch) seqs.push_back(s->seq->get());
            std::vector<float> out(q.size());
            const int rc = wkv_decode(plan.get(), seqs.data(), static_cast<uint32_t>(seqs.size()), layer, q.data(), 0,
                                      0, out.data(), 0, 0, nullptr);
            if (rc == WKV_ERR_BUDGET) {  // ending a prompt clusters it: pages
              ++refusals;
              continue;
            }
            if (rc != WKV_OK) {
              fail(std::string("decode: ") + wkv_status_name(rc) + ": " + wkv_last_error());
              continue;
            }
            for (size_t b = 0; b < batch.size(); ++b)
              for (uint32_t h = 0; h < kQ; ++h) {
                std::vector<double> ref;
                const size_t at = (b * kQ + h) * kD;
                exact_attention(&q[at], batch[b]->rows[layer * kKV + h / (kQ / kKV)], kD, &ref);
                if (rel_l2(&out[at], ref) > 1e-4) fail("a decode at full retrieval is not exact");
              }
            ++decodes;
          } else if (op == 9) {
            // Saved while the other threads decode, loaded back in its place.
            Tracked &s = *mine[rng() % mine.size()];
            const std::string path = scratch.file("t" + std::to_string(t) + ".wkv");
            int rc = wkv_seq_save(s.seq->get(), path.c_str(), WKV_SAVE_NO_FSYNC);
            if (rc != WKV_OK) {
              fail(std::string("save: ") + wkv_status_name(rc) + ": " + wkv_last_error());
              continue;
            }
            wkv_seq *loaded = nullptr;
            rc = wkv_seq_load(engine.get(), path.c_str(), &loaded);
            unlink(path.c_str());
            if (rc == WKV_ERR_BUDGET) {
              ++refusals;
              continue;
            }
            if (rc != WKV_OK) {
              fail(std::string("load: ") + wkv_status_name(rc) + ": " + wkv_last_error());
              continue;
            }
            s.seq = std::make_unique<wavekv::Sequence>(wavekv::Sequence::adopt(loaded));
            ++reloads;
          } else {
            mine.erase(mine.begin() + static_cast<long>(rng() % mine.size()));
          }
        }
      } catch (const std::exception &ex) {
        fail(ex.what());
      }
    });
  for (auto &th : threads) th.join();
  for (uint32_t t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  std::printf("stress: %llu exact decodes, %llu sequences saved and loaded back, %llu refusals for the budget\n",
              static_cast<unsigned long long>(decodes.load()), static_cast<unsigned long long>(reloads.load()),
              static_cast<unsigned long long>(refusals.load()));
  EXPECT_GT(decodes.load(), 0u);
  EXPECT_GT(reloads.load(), 0u);
  // Memory back where it started once the releases have run.
  wkv_stats after = engine.stats();
  for (int i = 0; i < 500 && after.pages_used != before.pages_used; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    after = engine.stats();
  }
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.pages_used, before.pages_used);
  EXPECT_EQ(after.steady_bytes, before.steady_bytes);
  EXPECT_EQ(after.clusters, before.clusters);
}
