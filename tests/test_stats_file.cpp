// The statistics file: an engine opened with wkv_config.stats_path writes
// its statistics there at open and then at every interval, replacing the
// file whole, and stops when it closes; a path it cannot write fails the
// open; a config of wavekv 0.1's size (without the fields) still opens.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "files_support.hpp"

using namespace wkvtest;

namespace {

// The file's statistics object, or a discarded value if unreadable.
nlohmann::json read_stats(const std::string &path) {
  const std::vector<uint8_t> b = read_bytes(path);
  return nlohmann::json::parse(b.begin(), b.end(), nullptr, false);
}

// Polls the file until `pred` holds of its contents (or 10 s pass).
template <typename Pred> bool eventually(const std::string &path, Pred pred) {
  for (int i = 0; i < 1000; ++i) {
    const nlohmann::json j = read_stats(path);
    if (!j.is_discarded() && pred(j)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

TEST(StatsFile, IsPublishedAtOpenAndFollowsTheEngine) {
  ScratchDir dir;
  const Shape s;
  const std::string path = dir.file("stats.json");
  wkv_config c = file_config(s);
  c.stats_path = path.c_str();
  c.stats_interval_ms = 20;
  {
    wavekv::Engine e(c);
    const nlohmann::json first = read_stats(path);
    ASSERT_FALSE(first.is_discarded()) << "published at open";
    EXPECT_EQ(first["stats"]["tokens"], 0u);
    EXPECT_EQ(first["config"]["n_layers"], s.layers);
    EXPECT_GT(first["unix_ms"].get<uint64_t>(), 0u);
    struct stat st;
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    // The engine's copy of the path, not the caller's string.
    const wkv_config got = e.config();
    ASSERT_NE(got.stats_path, nullptr);
    EXPECT_NE(got.stats_path, c.stats_path);
    EXPECT_EQ(std::string(got.stats_path), path);
    EXPECT_EQ(got.stats_interval_ms, 20u);

    wavekv::Sequence seq(e);
    Context ctx(s);
    std::vector<uint8_t> k, v;
    ctx.tokens(100, &k, &v);
    seq.append(0, k.data(), v.data(), 100);
    EXPECT_TRUE(eventually(path, [](const nlohmann::json &j) { return j["stats"]["tokens"] == 100; }));
    EXPECT_TRUE(eventually(path, [](const nlohmann::json &j) { return j["stats"]["sequences"] == 1; }));
  }
  // Closed: the file stays, no temporary file beside it, and it no longer
  // changes.
  EXPECT_EQ(dir.names(), std::vector<std::string>{"stats.json"});
  const std::vector<uint8_t> last = read_bytes(path);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(read_bytes(path), last);
}

TEST(StatsFile, BadSettingsFailTheOpen) {
  ScratchDir dir;
  wkv_config c = file_config(Shape{});
  wkv_engine *e = nullptr;
  const std::string missing = dir.file("no/such/dir/stats.json");
  c.stats_path = missing.c_str();
  EXPECT_EQ(wkv_engine_open(&c, &e), WKV_ERR_IO);
  EXPECT_NE(std::string(wkv_last_error()).find("stats_path"), std::string::npos) << wkv_last_error();
  EXPECT_EQ(e, nullptr);
  c.stats_path = "";
  EXPECT_EQ(wkv_engine_open(&c, &e), WKV_ERR_INVALID_ARGUMENT);
  const std::string path = dir.file("stats.json");
  c.stats_path = path.c_str();
  c.stats_interval_ms = 5;
  EXPECT_EQ(wkv_engine_open(&c, &e), WKV_ERR_INVALID_ARGUMENT);
  c.stats_interval_ms = 1000;
  c.reserved1 = 1;
  EXPECT_EQ(wkv_engine_open(&c, &e), WKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(dir.names().empty());
}

// A caller built against wavekv 0.1's header passes a shorter struct; the
// bytes after it are not the caller's and are never read.
TEST(StatsFile, AConfigOfTheOldSizeOpensWithoutAStatisticsFile) {
  union {
    wkv_config c;
    unsigned char raw[sizeof(wkv_config)];
  } u;
  u.c = file_config(Shape{});
  std::memset(u.raw + offsetof(wkv_config, stats_path), 0xff, sizeof u.raw - offsetof(wkv_config, stats_path));
  u.c.size = offsetof(wkv_config, stats_path);
  wkv_engine *e = nullptr;
  ASSERT_EQ(wkv_engine_open(&u.c, &e), WKV_OK) << wkv_last_error();
  wkv_config got;
  wkv_config_init(&got);
  ASSERT_EQ(wkv_engine_config(e, &got), WKV_OK);
  EXPECT_EQ(got.stats_path, nullptr);
  EXPECT_EQ(got.stats_interval_ms, 1000u);
  wkv_engine_close(e);
}
