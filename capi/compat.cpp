// Programs built against an older wavekv.h, whose structs were shorter,
// keep working with this library: a function that writes a whole struct
// keeps its old behaviour under its old symbol version, and programs built
// now bind to the current version (glibc's way; ld's manual, "VERSION").
// Only the shared library is built with this file (CMakeLists.txt);
// programs that link the C ABI's objects get capi/current.cpp instead.
// capi/wavekv.map lists each such name in every node that has a version.
#include <cstddef>
#include <cstring>

#include "lib/common/config.hpp"
#include "wavekv/wavekv.h"

// Writes the first `bytes` bytes of `full` (an older release's struct) over
// *dst, with `size` set to `bytes`.
template <typename T> void write_prefix(T *dst, T full, size_t bytes) {
  full.size = static_cast<uint32_t>(bytes);
  std::memcpy(dst, &full, bytes);
}

// wavekv 0.1's wkv_config ended after `seed`: its wkv_config_init writes no
// further than that.
extern "C" WKV_API void wkv_config_init_0_1(wkv_config *cfg) {
  if (cfg) write_prefix(cfg, wkv::default_config(), offsetof(wkv_config, stats_path));
}
__asm__(".symver wkv_config_init_0_1,wkv_config_init@WAVEKV_0.1");

// 0.2's ended after reserved1.
extern "C" WKV_API void wkv_config_init_0_2(wkv_config *cfg) {
  if (cfg) write_prefix(cfg, wkv::default_config(), offsetof(wkv_config, spill_dir));
}
__asm__(".symver wkv_config_init_0_2,wkv_config_init@WAVEKV_0.2");

extern "C" WKV_API void wkv_config_init_0_3(wkv_config *cfg) {
  if (cfg) *cfg = wkv::default_config();
}
__asm__(".symver wkv_config_init_0_3,wkv_config_init@@WAVEKV_0.3");

// wkv_stats of 0.1 and 0.2 ended after pin_fallbacks.
extern "C" WKV_API void wkv_stats_init_0_1(wkv_stats *stats) {
  if (stats) write_prefix(stats, wkv_stats{}, offsetof(wkv_stats, spill_io));
}
__asm__(".symver wkv_stats_init_0_1,wkv_stats_init@WAVEKV_0.1");

// 0.3's ended after evicted_sequences.
extern "C" WKV_API void wkv_stats_init_0_3(wkv_stats *stats) {
  if (stats) write_prefix(stats, wkv_stats{}, offsetof(wkv_stats, spill_cold_pages));
}
__asm__(".symver wkv_stats_init_0_3,wkv_stats_init@WAVEKV_0.3");

// 0.4's and 0.5's ended after spill_write_errors.
extern "C" WKV_API void wkv_stats_init_0_4(wkv_stats *stats) {
  if (stats) write_prefix(stats, wkv_stats{}, offsetof(wkv_stats, cache_frames_given));
}
__asm__(".symver wkv_stats_init_0_4,wkv_stats_init@WAVEKV_0.4");

// 0.6's ended after cache_records_dropped.
extern "C" WKV_API void wkv_stats_init_0_6(wkv_stats *stats) {
  if (stats) write_prefix(stats, wkv_stats{}, offsetof(wkv_stats, growths_deferred));
}
__asm__(".symver wkv_stats_init_0_6,wkv_stats_init@WAVEKV_0.6");

// 0.7's ended after growth_waits.
extern "C" WKV_API void wkv_stats_init_0_7(wkv_stats *stats) {
  if (stats) write_prefix(stats, wkv_stats{}, offsetof(wkv_stats, decode_graphs));
}
__asm__(".symver wkv_stats_init_0_7,wkv_stats_init@WAVEKV_0.7");

// 0.8's to 0.12's ended after decode_graphs.
extern "C" WKV_API void wkv_stats_init_0_8(wkv_stats *stats) {
  if (stats) write_prefix(stats, wkv_stats{}, offsetof(wkv_stats, device_bytes_reserved));
}
__asm__(".symver wkv_stats_init_0_8,wkv_stats_init@WAVEKV_0.8");

extern "C" WKV_API void wkv_stats_init_0_13(wkv_stats *stats) {
  if (stats) write_prefix(stats, wkv_stats{}, sizeof *stats);
}
__asm__(".symver wkv_stats_init_0_13,wkv_stats_init@@WAVEKV_0.13");

// wkv_seq_info of 0.1 to 0.5 ended after pages.
extern "C" WKV_API void wkv_seq_info_init_0_1(wkv_seq_info *info) {
  if (info) write_prefix(info, wkv_seq_info{}, offsetof(wkv_seq_info, evicted));
}
__asm__(".symver wkv_seq_info_init_0_1,wkv_seq_info_init@WAVEKV_0.1");

extern "C" WKV_API void wkv_seq_info_init_0_6(wkv_seq_info *info) {
  if (info) write_prefix(info, wkv_seq_info{}, sizeof *info);
}
__asm__(".symver wkv_seq_info_init_0_6,wkv_seq_info_init@@WAVEKV_0.6");
