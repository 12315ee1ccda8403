# FindNCCL: NVIDIA's collective communication library (nccl.h and libnccl).
#
# Where it looks, first hit wins (the library is searched next to the header first, so both come
# from one install):
#   1. NCCL_ROOT (CMake or environment variable; find_package's <Package>_ROOT rule), then the
#      NCCL_HOME environment or CMake variable;
#   2. CMAKE_PREFIX_PATH (CMake and environment variable), CMAKE_INCLUDE_PATH / CMAKE_LIBRARY_PATH;
#   3. the CUDA toolkit: the folder above the nvcc that builds (CMAKE_CUDA_COMPILER or
#      CUDAToolkit_NVCC_EXECUTABLE), CUDAToolkit_TARGET_DIR and CUDAToolkit_LIBRARY_ROOT, each with
#      targets/<arch>-linux/{include,lib,lib64}, include, lib64 and lib. (CUDAToolkit_LIBRARY_DIR is
#      not enough: CMake 4.4 sets it to wherever libcudart was found first, e.g. /usr/local/lib.);
#   4. the nvidia-nccl-cu* wheel (site-packages/nvidia/nccl/{include,lib}) of the Python that builds
#      (Python_EXECUTABLE, Python3_EXECUTABLE, else python3 on PATH); its lib/ holds libnccl.so.2
#      only, so the versioned file name is accepted too;
#   5. the system paths (/usr/include, /usr/lib/<multiarch>, ...).
# NCCL_INCLUDE_DIR and NCCL_LIBRARY given on the command line override the search.
#
# Results:
#   NCCL_FOUND, NCCL_VERSION ("2.28.9", from nccl.h), NCCL_INCLUDE_DIR, NCCL_LIBRARY,
#   NCCL_NOT_FOUND_REASON (a given path without the file it names, else ""),
#   NCCL_FOUND_IN (one of "NCCL_ROOT", "NCCL_HOME", "CMAKE_PREFIX_PATH", "CUDA toolkit",
#                  "Python wheel", "system", "given")
#   NCCL::nccl     imported library: libnccl and its headers (for code that calls NCCL)
#   NCCL::headers  imported interface: the headers only (NCCL_VERSION_CODE, types)
# Imported targets carry the paths of this machine; link them PRIVATE (or through
# $<BUILD_INTERFACE:...>) so that no exported target records them.

set(_nccl_given FALSE)
if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
  set(_nccl_given TRUE)
endif()

# ---- candidate prefixes, in the order of the list above (1. NCCL_ROOT is find_*'s own) --------
set(_nccl_home "")
if(DEFINED NCCL_HOME)
  list(APPEND _nccl_home "${NCCL_HOME}")
endif()
if(DEFINED ENV{NCCL_HOME})
  list(APPEND _nccl_home "$ENV{NCCL_HOME}")
endif()

set(_nccl_toolkit "")
foreach(_nvcc IN ITEMS "${CMAKE_CUDA_COMPILER}" "${CUDAToolkit_NVCC_EXECUTABLE}")
  if(_nvcc AND EXISTS "${_nvcc}")
    get_filename_component(_dir "${_nvcc}" DIRECTORY)
    get_filename_component(_dir "${_dir}" DIRECTORY)
    list(APPEND _nccl_toolkit "${_dir}")
    file(REAL_PATH "${_dir}" _real)
    list(APPEND _nccl_toolkit "${_real}")
  endif()
endforeach()
foreach(_dir IN ITEMS "${CUDAToolkit_TARGET_DIR}" "${CUDAToolkit_LIBRARY_ROOT}")
  if(_dir)
    list(APPEND _nccl_toolkit "${_dir}")
  endif()
endforeach()
list(REMOVE_DUPLICATES _nccl_toolkit)
string(TOLOWER "${CMAKE_SYSTEM_PROCESSOR}" _nccl_arch)
if(_nccl_arch MATCHES "^(aarch64|arm64)$")
  set(_nccl_target_dirs targets/sbsa-linux targets/aarch64-linux)
else()
  set(_nccl_target_dirs targets/${_nccl_arch}-linux)
endif()
set(_nccl_toolkit_dirs "")
foreach(_root IN LISTS _nccl_toolkit)
  foreach(_t IN LISTS _nccl_target_dirs)
    list(APPEND _nccl_toolkit_dirs "${_root}/${_t}")
  endforeach()
  list(APPEND _nccl_toolkit_dirs "${_root}")
endforeach()

# The wheel: ask the building Python where its site-packages are. Twice: once as it is run here
# (PYTHONPATH included: pip --target, a hand-made environment) and once with -E (ignore PYTHON*
# variables), which sees the environment's own site-packages even inside pip's isolated build.
set(_nccl_wheel "")
set(_nccl_python "")
foreach(_v IN ITEMS Python_EXECUTABLE Python3_EXECUTABLE)
  if(NOT _nccl_python AND ${_v})
    set(_nccl_python "${${_v}}")
  endif()
endforeach()
if(NOT _nccl_python)
  find_program(NCCL_PYTHON_EXECUTABLE NAMES python3 python DOC "Python whose nvidia-nccl wheel FindNCCL looks for")
  mark_as_advanced(NCCL_PYTHON_EXECUTABLE)
  set(_nccl_python "${NCCL_PYTHON_EXECUTABLE}")
endif()
if(_nccl_python)
  set(_nccl_site_code
      "import site, sys, sysconfig; p = sysconfig.get_paths(); d = [p.get('purelib'), p.get('platlib')]; d += getattr(site, 'getsitepackages', lambda: [])(); d += [site.getusersitepackages()] + sys.path; print(';'.join(x for x in d if x))")
  foreach(_flags IN ITEMS "-c" "-E;-c")
    execute_process(COMMAND "${_nccl_python}" ${_flags} "${_nccl_site_code}" OUTPUT_VARIABLE _sites
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0)
      foreach(_site IN LISTS _sites)
        if(EXISTS "${_site}/nvidia/nccl/include/nccl.h")
          list(APPEND _nccl_wheel "${_site}/nvidia/nccl")
        endif()
      endforeach()
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _nccl_wheel)
endif()

# ---- search -----------------------------------------------------------------------------------
set(_nccl_hints ${_nccl_home} ${_nccl_toolkit_dirs} ${_nccl_wheel})
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include
          DOC "Folder of nccl.h (NCCL)")
set(_nccl_next_to_header "")
if(NCCL_INCLUDE_DIR)
  get_filename_component(_up "${NCCL_INCLUDE_DIR}" DIRECTORY)
  set(_nccl_next_to_header "${_up}/lib64" "${_up}/lib")
endif()
# NAMES_PER_DIR: every name in one folder before the next folder, so libnccl.so.2 next to the
# header beats a libnccl.so elsewhere.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
             HINTS ${_nccl_next_to_header} ${_nccl_hints} PATH_SUFFIXES lib64 lib
             DOC "libnccl (NCCL)")

# Paths given on the command line (or left in a cache) must still hold the files.
set(NCCL_NOT_FOUND_REASON "")
if(NCCL_INCLUDE_DIR AND NOT EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  set(NCCL_NOT_FOUND_REASON "NCCL_INCLUDE_DIR=${NCCL_INCLUDE_DIR} holds no nccl.h")
elseif(NCCL_LIBRARY AND NOT EXISTS "${NCCL_LIBRARY}")
  set(NCCL_NOT_FOUND_REASON "NCCL_LIBRARY=${NCCL_LIBRARY} does not exist")
endif()
set(_nccl_files_exist TRUE)
if(NCCL_NOT_FOUND_REASON)
  set(_nccl_files_exist FALSE)
endif()

set(NCCL_VERSION "")
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _m "${_nccl_defs}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

# Which of the places above the header came from (for the configure line).
set(NCCL_FOUND_IN "")
if(NCCL_INCLUDE_DIR AND _nccl_files_exist)
  file(REAL_PATH "${NCCL_INCLUDE_DIR}" _inc)
  set(_nccl_origins "")
  foreach(_r IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}")
    if(_r)
      list(APPEND _nccl_origins "NCCL_ROOT=${_r}")
    endif()
  endforeach()
  foreach(_r IN LISTS _nccl_home)
    list(APPEND _nccl_origins "NCCL_HOME=${_r}")
  endforeach()
  foreach(_r IN LISTS CMAKE_PREFIX_PATH)
    list(APPEND _nccl_origins "CMAKE_PREFIX_PATH=${_r}")
  endforeach()
  if(DEFINED ENV{CMAKE_PREFIX_PATH})
    string(REPLACE ":" ";" _env_prefixes "$ENV{CMAKE_PREFIX_PATH}")
    foreach(_r IN LISTS _env_prefixes)
      list(APPEND _nccl_origins "CMAKE_PREFIX_PATH=${_r}")
    endforeach()
  endif()
  foreach(_r IN LISTS _nccl_toolkit_dirs)
    list(APPEND _nccl_origins "CUDA toolkit=${_r}")
  endforeach()
  foreach(_r IN LISTS _nccl_wheel)
    list(APPEND _nccl_origins "Python wheel=${_r}")
  endforeach()
  foreach(_o IN LISTS _nccl_origins)
    string(REGEX MATCH "^([^=]+)=(.*)$" _m "${_o}")
    set(_name "${CMAKE_MATCH_1}")
    if(NOT EXISTS "${CMAKE_MATCH_2}")
      continue()
    endif()
    file(REAL_PATH "${CMAKE_MATCH_2}" _root)
    string(FIND "${_inc}/" "${_root}/" _at)
    if(_at EQUAL 0)
      set(NCCL_FOUND_IN "${_name}")
      break()
    endif()
  endforeach()
  if(NCCL_FOUND_IN STREQUAL "")
    set(NCCL_FOUND_IN "system")
  endif()
  if(_nccl_given)
    set(NCCL_FOUND_IN "given")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR _nccl_files_exist
                                  VERSION_VAR NCCL_VERSION REASON_FAILURE_MESSAGE "${NCCL_NOT_FOUND_REASON}")
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

if(NCCL_FOUND)
  if(NOT TARGET NCCL::headers)
    add_library(NCCL::headers INTERFACE IMPORTED)
    set_target_properties(NCCL::headers PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
  if(NOT TARGET NCCL::nccl)
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                                INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()
