# Finding wavekv's third-party libraries.
#
# Two kinds of machines build wavekv: ones where the Debian/Ubuntu -dev packages
# are installed system-wide, and ones where those .deb files are only unpacked
# under a prefix that CMAKE_PREFIX_PATH and PKG_CONFIG_PATH point to. The .pc
# files shipped in those packages hard-code prefix=/usr, so pkg-config alone
# would hand out wrong paths on the second kind. Hence wkv_find_library() uses
# pkg-config for hints only and locates the header and the library itself with
# find_path()/find_library(), which search CMAKE_PREFIX_PATH before the hints
# and before the system directories.

include_guard(GLOBAL)

find_package(PkgConfig QUIET)

# wkv_find_library(<name> PKG <pkg-config module> HEADER <header> LIBS <names>...)
#
# On success creates the imported target wkv::<name> (include directory and
# the library by full path, so that the build tree's RPATH finds it) and sets
# WKV_<name>_FOUND to TRUE in the caller's scope; otherwise sets it to FALSE.
function(wkv_find_library name)
  cmake_parse_arguments(A "" "PKG;HEADER" "LIBS" ${ARGN})
  if(TARGET wkv::${name})
    set(WKV_${name}_FOUND TRUE PARENT_SCOPE)
    return()
  endif()

  set(_inc_hints "")
  set(_lib_hints "")
  if(PKG_CONFIG_FOUND AND A_PKG)
    pkg_check_modules(WKV_PC_${name} QUIET ${A_PKG})
    if(WKV_PC_${name}_FOUND)
      set(_inc_hints ${WKV_PC_${name}_INCLUDE_DIRS} ${WKV_PC_${name}_INCLUDEDIR})
      set(_lib_hints ${WKV_PC_${name}_LIBRARY_DIRS} ${WKV_PC_${name}_LIBDIR})
    endif()
  endif()

  find_path(WKV_${name}_INCLUDE_DIR NAMES ${A_HEADER} HINTS ${_inc_hints}
            DOC "Directory holding ${A_HEADER}")
  find_library(WKV_${name}_LIBRARY NAMES ${A_LIBS} HINTS ${_lib_hints}
               DOC "The ${name} library")
  mark_as_advanced(WKV_${name}_INCLUDE_DIR WKV_${name}_LIBRARY)

  if(WKV_${name}_INCLUDE_DIR AND WKV_${name}_LIBRARY)
    add_library(wkv::${name} INTERFACE IMPORTED GLOBAL)
    set_target_properties(wkv::${name} PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${WKV_${name}_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${WKV_${name}_LIBRARY}")
    message(STATUS "wavekv: ${name}: ${WKV_${name}_LIBRARY}")
    set(WKV_${name}_FOUND TRUE PARENT_SCOPE)
  else()
    set(WKV_${name}_FOUND FALSE PARENT_SCOPE)
  endif()
endfunction()

# wkv_find_mimalloc(): mimalloc's header and the path of its shared library,
# for lib/common/meta_alloc.cpp, which loads that library at run time with
# dlopen(RTLD_LOCAL) rather than linking it (Debian's build exports malloc and
# operator new: linked, it would replace the allocator of every process that
# loads libwavekv). Creates wkv::mimalloc, an interface target carrying the
# include directory and WKV_MIMALLOC_PATH / WKV_MIMALLOC_SONAME, and sets
# WKV_mimalloc_FOUND. The CMake package first (Debian's libmimalloc-dev ships
# one), then a plain search.
function(wkv_find_mimalloc)
  if(TARGET wkv::mimalloc)
    set(WKV_mimalloc_FOUND TRUE PARENT_SCOPE)
    return()
  endif()
  set(_inc "")
  set(_lib "")
  set(_soname "")
  find_package(mimalloc CONFIG QUIET)
  if(TARGET mimalloc)
    get_target_property(_inc mimalloc INTERFACE_INCLUDE_DIRECTORIES)
    get_target_property(_configs mimalloc IMPORTED_CONFIGURATIONS)
    foreach(_c IN LISTS _configs ITEMS "")
      set(_sfx "")
      if(_c)
        set(_sfx "_${_c}")
      endif()
      get_target_property(_l mimalloc IMPORTED_LOCATION${_sfx})
      get_target_property(_s mimalloc IMPORTED_SONAME${_sfx})
      if(_l AND NOT _lib)
        set(_lib "${_l}")
      endif()
      if(_s AND NOT _soname)
        set(_soname "${_s}")
      endif()
    endforeach()
  endif()
  if(NOT _inc OR NOT _lib)
    find_path(WKV_mimalloc_INCLUDE_DIR NAMES mimalloc.h DOC "Directory holding mimalloc.h")
    find_library(WKV_mimalloc_LIBRARY NAMES mimalloc DOC "The mimalloc library")
    mark_as_advanced(WKV_mimalloc_INCLUDE_DIR WKV_mimalloc_LIBRARY)
    set(_inc "${WKV_mimalloc_INCLUDE_DIR}")
    set(_lib "${WKV_mimalloc_LIBRARY}")
  endif()
  if(NOT _inc OR NOT _lib)
    set(WKV_mimalloc_FOUND FALSE PARENT_SCOPE)
    return()
  endif()
  get_filename_component(_lib "${_lib}" REALPATH)
  if(NOT _soname)
    set(_soname "libmimalloc.so.2")
  endif()
  add_library(wkv::mimalloc INTERFACE IMPORTED GLOBAL)
  set_target_properties(wkv::mimalloc PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_inc}"
    INTERFACE_COMPILE_DEFINITIONS "WKV_MIMALLOC_PATH=\"${_lib}\";WKV_MIMALLOC_SONAME=\"${_soname}\"")
  message(STATUS "wavekv: mimalloc: ${_lib} (loaded at run time, soname ${_soname})")
  set(WKV_mimalloc_FOUND TRUE PARENT_SCOPE)
endfunction()

# wkv_dependency_missing(<what> <option or "">): stop with advice.
function(wkv_dependency_missing what option)
  set(_msg "wavekv: ${what} was not found.\n"
           "Run tools/install-deps.sh (or `make deps`) to install the build dependencies")
  if(option)
    string(APPEND _msg ", or configure with -D${option}=OFF to build without it")
  endif()
  string(APPEND _msg ".\nWhere the packages are unpacked under a prefix, point "
                     "CMAKE_PREFIX_PATH and PKG_CONFIG_PATH there.")
  message(FATAL_ERROR ${_msg})
endfunction()
