// The functions of wavekv.h that also have older versions (capi/compat.cpp),
// in their current form: what programs that link the C ABI's objects rather
// than the shared library (the wavekv command, the tests) call.
#include "lib/common/config.hpp"
#include "wavekv/wavekv.h"

extern "C" void wkv_config_init(wkv_config *cfg) {
  if (cfg) *cfg = wkv::default_config();
}
