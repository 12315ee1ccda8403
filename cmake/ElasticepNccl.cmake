# Whether and how ElasticEP uses NCCL, after the CUDA detection of the root CMakeLists.txt.
#
# ELASTICEP_NCCL (cache): AUTO (default: use NCCL when FindNCCL finds it), ON (required: configure
# fails without it), OFF (not searched). The library compiles against NCCL's headers only: nccl.h
# (NCCL_VERSION_CODE for `elasticep info`, the host API's types) and the device API of nccl_device/
# (the hybrid topology's GIN rail, compiled into its kernels). The hybrid topology's NCCL host calls
# (scaleout=nccl and gin) go through libnccl loaded at run time (src/transport/scaleout/nccl_api.hpp:
# libnccl.so.2, else the NCCL_LIBRARY found here), so neither the static library nor its consumers
# link libnccl, and the exported targets name no NCCL. AUTO without NCCL builds everything; hybrid
# then offers scaleout=emulated only.
#
# Sets ELASTICEP_WITH_NCCL (ON when found and used) and prints one "ElasticEP NCCL:" line.
set(ELASTICEP_NCCL "AUTO" CACHE STRING "Use NCCL: AUTO (when found), ON (required), OFF")
set_property(CACHE ELASTICEP_NCCL PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${ELASTICEP_NCCL}" _elasticep_nccl)
if(NOT _elasticep_nccl MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "ELASTICEP_NCCL=${ELASTICEP_NCCL}: choose AUTO, ON or OFF")
endif()

set(ELASTICEP_WITH_NCCL OFF)
if(_elasticep_nccl STREQUAL "OFF")
  message(STATUS "ElasticEP NCCL: off (ELASTICEP_NCCL=OFF); `elasticep info` reports no NCCL version")
elseif(NOT ELASTICEP_WITH_CUDA AND _elasticep_nccl STREQUAL "AUTO")
  message(STATUS "ElasticEP NCCL: not searched (the CUDA backend is off)")
else()
  list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
  find_package(NCCL QUIET)
  if(NCCL_FOUND)
    set(ELASTICEP_WITH_NCCL ON)
    message(STATUS "ElasticEP NCCL: ${NCCL_VERSION} from ${NCCL_FOUND_IN} (${NCCL_INCLUDE_DIR}/nccl.h, "
                   "${NCCL_LIBRARY}); headers at build time, the library loaded at run time by the hybrid scale-out")
  else()
    set(_searched "searched NCCL_ROOT, NCCL_HOME, CMAKE_PREFIX_PATH, the CUDA toolkit")
    if(CMAKE_CUDA_COMPILER)
      string(APPEND _searched " of ${CMAKE_CUDA_COMPILER}")
    endif()
    string(APPEND _searched ", the nvidia-nccl wheel of the building Python, the system paths")
    set(_what "nccl.h and libnccl")
    if(NCCL_NOT_FOUND_REASON)  # a path was given: nothing was searched
      set(_what "the given NCCL")
      set(_searched "${NCCL_NOT_FOUND_REASON}")
    elseif(NCCL_INCLUDE_DIR)
      set(_what "libnccl (nccl.h is in ${NCCL_INCLUDE_DIR})")
    elseif(NCCL_LIBRARY)
      set(_what "nccl.h (libnccl is ${NCCL_LIBRARY})")
    endif()
    if(_elasticep_nccl STREQUAL "ON")
      message(FATAL_ERROR "ELASTICEP_NCCL=ON but ${_what} not found (${_searched}). "
                          "Set NCCL_ROOT to the NCCL install, or configure with -DELASTICEP_NCCL=AUTO.")
    endif()
    message(STATUS "ElasticEP NCCL: ${_what} not found (${_searched}); the CUDA backend is built "
                   "without it and `elasticep info` reports no NCCL version. Set NCCL_ROOT to use one.")
  endif()
endif()
