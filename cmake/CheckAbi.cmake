# Compare the dynamic symbols libwavekv exports with capi/abi_symbols.txt.
#
#   cmake -DLIB=<libwavekv.so> -DNM=<nm> -DEXPECTED=<abi_symbols.txt> \
#         [-DUPDATE=ON] -P CheckAbi.cmake
#
# The exported list is `nm -D --defined-only` restricted to symbols of type
# T, D, B or R, without the version nodes (type A) and without the @VERSION
# suffixes newer binutils print, sorted. abi_symbols.txt holds one symbol per
# line, sorted; blank lines and lines starting with '#' are ignored.
# With UPDATE=ON the current list is written to EXPECTED instead.

cmake_minimum_required(VERSION 3.22)

foreach(_v LIB EXPECTED)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "CheckAbi.cmake: -D${_v}=... is required")
  endif()
endforeach()
if(NOT NM)
  find_program(NM NAMES nm)
  if(NOT NM)
    message(FATAL_ERROR "CheckAbi.cmake: nm not found")
  endif()
endif()
if(NOT EXISTS "${LIB}")
  message(FATAL_ERROR "CheckAbi.cmake: ${LIB} does not exist; build the wavekv target first")
endif()

execute_process(
  COMMAND "${NM}" -D --defined-only "${LIB}"
  OUTPUT_VARIABLE _nm_out
  ERROR_VARIABLE _nm_err
  RESULT_VARIABLE _nm_rc)
if(NOT _nm_rc EQUAL 0)
  message(FATAL_ERROR "CheckAbi.cmake: ${NM} -D --defined-only ${LIB} failed (${_nm_rc}):\n${_nm_err}")
endif()

string(REPLACE "\n" ";" _lines "${_nm_out}")
set(_actual "")
foreach(_line IN LISTS _lines)
  # "<address> <type> <name>[@[@]VERSION]"
  if(_line MATCHES "^[0-9a-fA-F]* *([TDBR]) ([^ @]+)")
    list(APPEND _actual "${CMAKE_MATCH_2}")
  endif()
endforeach()
list(REMOVE_DUPLICATES _actual)
list(SORT _actual)

if(UPDATE)
  list(JOIN _actual "\n" _text)
  if(_text)
    string(APPEND _text "\n")
  endif()
  file(WRITE "${EXPECTED}" "${_text}")
  list(LENGTH _actual _n)
  message(STATUS "Wrote ${_n} symbols to ${EXPECTED}")
  return()
endif()

if(NOT EXISTS "${EXPECTED}")
  message(FATAL_ERROR
    "${EXPECTED} does not exist.\n"
    "It lists, one per line and sorted, the symbols libwavekv exports. Generate it "
    "from the current build with:\n"
    "  cmake --build <build dir> --target abi-update\n"
    "review it, and commit it.")
endif()

file(STRINGS "${EXPECTED}" _exp_lines)
set(_expected "")
foreach(_line IN LISTS _exp_lines)
  string(STRIP "${_line}" _line)
  if(_line STREQUAL "" OR _line MATCHES "^#")
    continue()
  endif()
  list(APPEND _expected "${_line}")
endforeach()
list(REMOVE_DUPLICATES _expected)
list(SORT _expected)

if(_actual STREQUAL _expected)
  list(LENGTH _actual _n)
  message(STATUS "ABI ok: ${_n} exported symbols match ${EXPECTED}")
  return()
endif()

set(_missing ${_expected})
if(_actual)
  list(REMOVE_ITEM _missing ${_actual})
endif()
set(_extra ${_actual})
if(_expected)
  list(REMOVE_ITEM _extra ${_expected})
endif()
set(_report "The symbols exported by ${LIB} differ from ${EXPECTED}.\n")
foreach(_s IN LISTS _missing)
  string(APPEND _report "  - ${_s}   (listed, not exported)\n")
endforeach()
foreach(_s IN LISTS _extra)
  string(APPEND _report "  + ${_s}   (exported, not listed)\n")
endforeach()
string(APPEND _report
  "If the change is intended, run `cmake --build <build dir> --target abi-update` "
  "and commit capi/abi_symbols.txt.")
message(FATAL_ERROR "${_report}")
