// The C ABI test (tests/c_api_test.c) compiled as C++: the public header
// must serve C++ callers as it is.
#include "c_api_test.c"
