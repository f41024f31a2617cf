// The functions of wavekv.h that also have older versions (capi/compat.cpp),
// in their current form: what programs that link the C ABI's objects rather
// than the shared library (the wavekv command, the tests) call.
#include <cstring>

#include "lib/common/config.hpp"
#include "wavekv/wavekv.h"

extern "C" void wkv_config_init(wkv_config *cfg) {
  if (cfg) *cfg = wkv::default_config();
}

extern "C" void wkv_stats_init(wkv_stats *stats) {
  if (!stats) return;
  std::memset(stats, 0, sizeof *stats);
  stats->size = sizeof *stats;
}

extern "C" void wkv_seq_info_init(wkv_seq_info *info) {
  if (!info) return;
  std::memset(info, 0, sizeof *info);
  info->size = sizeof *info;
}
