# Compare the public structs' layout and constants, as printed by the
# abi_layout program (tests/abi/abi_layout.c), with capi/abi_layout.txt.
#
#   cmake -DPROGRAM=<abi_layout> -DEXPECTED=<abi_layout.txt> [-DUPDATE=ON] -P CheckLayout.cmake
#
# With UPDATE=ON the current layout is written to EXPECTED instead.

cmake_minimum_required(VERSION 3.22)

foreach(_v PROGRAM EXPECTED)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "CheckLayout.cmake: -D${_v}=... is required")
  endif()
endforeach()
execute_process(COMMAND "${PROGRAM}" OUTPUT_VARIABLE _actual RESULT_VARIABLE _rc ERROR_VARIABLE _err)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "CheckLayout.cmake: ${PROGRAM} failed (${_rc}):\n${_err}")
endif()
if(UPDATE)
  file(WRITE "${EXPECTED}" "${_actual}")
  message(STATUS "Wrote the public layout to ${EXPECTED}")
  return()
endif()
if(NOT EXISTS "${EXPECTED}")
  message(FATAL_ERROR "${EXPECTED} does not exist: generate it with "
                      "`cmake --build <build dir> --target abi-update`, review it, and commit it.")
endif()
file(READ "${EXPECTED}" _expected)
if(_actual STREQUAL _expected)
  message(STATUS "ABI ok: the public structs and constants match ${EXPECTED}")
  return()
endif()
string(REPLACE "\n" ";" _a "${_actual}")
string(REPLACE "\n" ";" _e "${_expected}")
set(_report "The public structs or constants differ from ${EXPECTED}:\n")
foreach(_line IN LISTS _e)
  if(_line AND NOT _line IN_LIST _a)
    string(APPEND _report "  - ${_line}\n")
  endif()
endforeach()
foreach(_line IN LISTS _a)
  if(_line AND NOT _line IN_LIST _e)
    string(APPEND _report "  + ${_line}\n")
  endif()
endforeach()
string(APPEND _report "A struct may only grow at its end and a value never changes. If the change "
                      "is intended, run `cmake --build <build dir> --target abi-update` and commit "
                      "capi/abi_layout.txt with it.")
message(FATAL_ERROR "${_report}")
