// The owner of the suites' precompiled header (CMakeLists.txt,
// wkv_test_pch): a unit with nothing of its own, compiled with the suites'
// definitions and flags so that each suite can reuse the header built here.
