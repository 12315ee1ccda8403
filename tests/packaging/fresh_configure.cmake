# The set-up test: configures the project as a newcomer's first `make` would, in a scratch build
# folder with an empty cache and a scrubbed environment (env -i: PATH=/usr/bin:/bin:/usr/local/cuda/bin
# and HOME only; no CMAKE_PREFIX_PATH, CUDA_HOME, LIBRARY_PATH, NCCL_ROOT or cached -D hints of an
# earlier build), then compares what the configure reports (elasticep-configuration.json) with what
# this script finds on disk by itself:
#   - an nvcc on that PATH (or at /usr/local/cuda/bin/nvcc) => the CUDA backend must be ON;
#   - nccl.h and libnccl in that toolkit                     => NCCL must be found, in the toolkit.
# A machine prepared by hand (a symlink, an exported variable, a warm cache) cannot make it pass.
# Usage: cmake -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch> [-DCONFIGURE_CMAKE=<cmake >= 3.28>]
#              -P tests/packaging/fresh_configure.cmake
if(NOT CONFIGURE_CMAKE)
  set(CONFIGURE_CMAKE ${CMAKE_COMMAND})
endif()
set(scrubbed_path /usr/bin:/bin:/usr/local/cuda/bin)
file(REMOVE_RECURSE ${WORK_DIR})
find_program(env_program env PATHS /usr/bin /bin NO_DEFAULT_PATH REQUIRED)

execute_process(
  COMMAND ${env_program} -i PATH=${scrubbed_path} HOME=$ENV{HOME} ${CONFIGURE_CMAKE} -S ${SOURCE_DIR} -B ${WORK_DIR}
          -DCMAKE_BUILD_TYPE=Release -DELASTICEP_BUILD_PYTHON=ON
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(REPLACE ";" "<semicolon>" lines "${out}")  # keep the lines' own ';' out of CMake's list syntax
string(REGEX MATCHALL "-- ElasticEP[^\n]*" lines "${lines}")
string(REPLACE ";" "\n" lines "${lines}")
string(REPLACE "<semicolon>" ";" lines "${lines}")
message(STATUS "fresh configure (env -i PATH=${scrubbed_path} HOME=$ENV{HOME}, empty cache in ${WORK_DIR}):\n${lines}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the fresh configure failed (exit ${rc}):\n${out}\n${err}")
endif()
file(READ ${WORK_DIR}/elasticep-configuration.json conf)
string(JSON cuda GET "${conf}" cuda)
string(JSON nccl_found GET "${conf}" nccl found)

# What is on disk, found here without the project's CMake code.
set(nvcc "")
string(REPLACE ":" ";" dirs "${scrubbed_path}")
foreach(d IN LISTS dirs)
  if(NOT nvcc AND EXISTS ${d}/nvcc)
    set(nvcc ${d}/nvcc)
  endif()
endforeach()
if(NOT nvcc AND EXISTS /usr/local/cuda/bin/nvcc)
  set(nvcc /usr/local/cuda/bin/nvcc)
endif()
if(NOT nvcc)
  if(cuda)
    message(FATAL_ERROR "no nvcc on ${scrubbed_path}, yet the CUDA backend came out ON")
  endif()
  message(STATUS "no nvcc on ${scrubbed_path}: the CUDA backend is OFF, as it must be")
  return()
endif()
if(NOT cuda)
  message(FATAL_ERROR "nvcc is at ${nvcc}, but the CUDA backend came out OFF in a fresh configure:\n${out}\n${err}")
endif()

file(REAL_PATH ${nvcc} nvcc_real)
get_filename_component(toolkit ${nvcc_real} DIRECTORY)
get_filename_component(toolkit ${toolkit} DIRECTORY)
file(GLOB headers ${toolkit}/include/nccl.h ${toolkit}/targets/*/include/nccl.h)
file(GLOB libs ${toolkit}/lib64/libnccl.so* ${toolkit}/lib/libnccl.so* ${toolkit}/targets/*/lib/libnccl.so*
     ${toolkit}/targets/*/lib64/libnccl.so*)
if(headers AND libs)
  if(NOT nccl_found)
    message(FATAL_ERROR "the toolkit of ${nvcc} holds NCCL (${headers}; ${libs}), but the fresh configure did not "
                        "find it:\n${out}")
  endif()
  string(JSON from GET "${conf}" nccl from)
  string(JSON lib GET "${conf}" nccl library)
  file(REAL_PATH ${lib} lib_real)
  set(in_toolkit FALSE)
  foreach(l IN LISTS libs)
    file(REAL_PATH ${l} l_real)
    if(l_real STREQUAL lib_real)
      set(in_toolkit TRUE)
    endif()
  endforeach()
  if(NOT from STREQUAL "CUDA toolkit" OR NOT in_toolkit)
    message(FATAL_ERROR "NCCL was taken from ${from} (${lib}), not from the toolkit of ${nvcc} (${libs})")
  endif()
  message(STATUS "ok: CUDA backend ON with ${nvcc}; NCCL found in its toolkit (${lib})")
else()
  message(STATUS "ok: CUDA backend ON with ${nvcc}; its toolkit has no NCCL (NCCL found elsewhere: ${nccl_found})")
endif()
