# cmake/FindNCCL.cmake against fake installs laid out as NCCL's usual homes: NCCL_ROOT (CMake and
# environment variable), NCCL_HOME, CMAKE_PREFIX_PATH, a CUDA toolkit next to an nvcc, the
# nvidia-nccl wheel of a Python (libnccl.so.2 only), and which one wins when several exist. Each
# fake nccl.h carries its own version, so the test knows which install was picked. The machine's
# own NCCL (system paths, its Python's wheel) is kept out of every case.
# Usage: cmake -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch> -P find_nccl.cmake
set(cmake_bin ${CMAKE_COMMAND})
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND uname -m OUTPUT_VARIABLE arch OUTPUT_STRIP_TRAILING_WHITESPACE)
string(TOLOWER "${arch}" arch)
set(target_dir targets/${arch}-linux)
if(arch MATCHES "^(aarch64|arm64)$")
  set(target_dir targets/sbsa-linux)
endif()

# fake_install(dir version incdir libdir libname): <dir>/<incdir>/nccl.h and <dir>/<libdir>/<libname>
function(fake_install dir version incdir libdir libname)
  string(REPLACE "." ";" v ${version})
  list(GET v 0 major)
  list(GET v 1 minor)
  list(GET v 2 patch)
  file(WRITE ${dir}/${incdir}/nccl.h
       "#define NCCL_MAJOR ${major}\n#define NCCL_MINOR ${minor}\n#define NCCL_PATCH ${patch}\n#define NCCL_SUFFIX \"\"\n")
  file(WRITE ${dir}/${libdir}/${libname} "not a real library\n")
endfunction()

set(root ${WORK_DIR}/root)            # NCCL_ROOT
set(home ${WORK_DIR}/home)            # NCCL_HOME, lib64 and only the versioned name
set(prefix ${WORK_DIR}/prefix)        # CMAKE_PREFIX_PATH
set(toolkit ${WORK_DIR}/cuda)         # a CUDA toolkit: bin/nvcc, targets/<arch>-linux/{include,lib}
set(site ${WORK_DIR}/site-packages)   # a Python's site-packages with the nvidia-nccl wheel
fake_install(${root} 2.19.3 include lib libnccl.so)
fake_install(${home} 2.20.5 include lib64 libnccl.so.2)
fake_install(${prefix} 2.21.5 include lib libnccl.so)
fake_install(${toolkit} 2.28.9 ${target_dir}/include ${target_dir}/lib libnccl.so)
file(WRITE ${toolkit}/bin/nvcc "")
fake_install(${site}/nvidia/nccl 2.27.7 include lib libnccl.so.2)
find_program(python NAMES python3 python REQUIRED)
find_program(make_program NAMES gmake make REQUIRED)  # the probes search no system path, not even for make

# probe(name want_version want_from want_lib [ENV k=v ...] [DEFS -D...]) -> fails on a mismatch
function(probe name want_version want_from want_lib)
  cmake_parse_arguments(P "" "" "ENV;DEFS" ${ARGN})
  set(b ${WORK_DIR}/probe-${name})
  execute_process(
    COMMAND ${cmake_bin} -E env --unset=NCCL_ROOT --unset=NCCL_HOME --unset=CMAKE_PREFIX_PATH --unset=PYTHONPATH
            ${P_ENV} ${cmake_bin} -S ${SOURCE_DIR}/tests/packaging/find_nccl -B ${b}
            -DELASTICEP_CMAKE_DIR=${SOURCE_DIR}/cmake -DCMAKE_FIND_USE_CMAKE_SYSTEM_PATH=OFF
            -DCMAKE_FIND_USE_SYSTEM_ENVIRONMENT_PATH=OFF -DCMAKE_MAKE_PROGRAM=${make_program} ${P_DEFS}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name}: the probe configure failed:\n${out}\n${err}")
  endif()
  file(READ ${b}/result.txt r)
  string(REPLACE "|" ";" r "${r}")
  list(GET r 0 found)
  list(GET r 1 version)
  list(GET r 2 from)
  list(GET r 4 lib)
  if(want_version STREQUAL "none")
    if(found)
      message(FATAL_ERROR "${name}: found NCCL ${version} (${lib}) where none exists")
    endif()
  elseif(NOT found OR NOT version STREQUAL want_version OR NOT from STREQUAL want_from OR NOT lib STREQUAL want_lib)
    message(FATAL_ERROR "${name}: found=${found} version=${version} from='${from}' library=${lib}\n"
                        "want version ${want_version} from '${want_from}', library ${want_lib}\n${out}")
  endif()
  message(STATUS "${name}: ${found} ${version} from '${from}' (${lib})")
endfunction()

set(no_py -DPython_EXECUTABLE=/bin/false)
probe(nothing none "" "" DEFS ${no_py})
probe(root_variable 2.19.3 NCCL_ROOT ${root}/lib/libnccl.so DEFS ${no_py} -DNCCL_ROOT=${root})
probe(root_environment 2.19.3 NCCL_ROOT ${root}/lib/libnccl.so ENV NCCL_ROOT=${root} DEFS ${no_py})
probe(home_environment 2.20.5 NCCL_HOME ${home}/lib64/libnccl.so.2 ENV NCCL_HOME=${home} DEFS ${no_py})
probe(prefix_path 2.21.5 CMAKE_PREFIX_PATH ${prefix}/lib/libnccl.so DEFS ${no_py} -DCMAKE_PREFIX_PATH=${prefix})
probe(prefix_environment 2.21.5 CMAKE_PREFIX_PATH ${prefix}/lib/libnccl.so ENV CMAKE_PREFIX_PATH=${prefix}
      DEFS ${no_py})
probe(toolkit_of_nvcc 2.28.9 "CUDA toolkit" ${toolkit}/${target_dir}/lib/libnccl.so
      DEFS ${no_py} -DCMAKE_CUDA_COMPILER=${toolkit}/bin/nvcc)
probe(toolkit_target_dir 2.28.9 "CUDA toolkit" ${toolkit}/${target_dir}/lib/libnccl.so
      DEFS ${no_py} -DCUDAToolkit_TARGET_DIR=${toolkit})
probe(python_wheel 2.27.7 "Python wheel" ${site}/nvidia/nccl/lib/libnccl.so.2
      ENV PYTHONPATH=${site} DEFS -DPython_EXECUTABLE=${python})
# the wheel in a virtual environment whose site-packages is hidden from sys.path, as pip's isolated
# build environment hides it (its sitecustomize drops the environment's own site-packages)
execute_process(COMMAND ${python} -m venv --without-pip ${WORK_DIR}/venv RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "python -m venv failed")
endif()
execute_process(COMMAND ${WORK_DIR}/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
                OUTPUT_VARIABLE venv_site OUTPUT_STRIP_TRAILING_WHITESPACE)
fake_install(${venv_site}/nvidia/nccl 2.26.2 include lib libnccl.so.2)
file(WRITE ${WORK_DIR}/isolate/sitecustomize.py
     "import sys\nsys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n")
probe(python_wheel_isolated 2.26.2 "Python wheel" ${venv_site}/nvidia/nccl/lib/libnccl.so.2
      ENV PYTHONPATH=${WORK_DIR}/isolate DEFS -DPython_EXECUTABLE=${WORK_DIR}/venv/bin/python)
# several at once: NCCL_ROOT before the toolkit, the toolkit before the wheel
probe(root_beats_toolkit 2.19.3 NCCL_ROOT ${root}/lib/libnccl.so ENV PYTHONPATH=${site}
      DEFS -DPython_EXECUTABLE=${python} -DNCCL_ROOT=${root} -DCMAKE_CUDA_COMPILER=${toolkit}/bin/nvcc)
probe(toolkit_beats_wheel 2.28.9 "CUDA toolkit" ${toolkit}/${target_dir}/lib/libnccl.so ENV PYTHONPATH=${site}
      DEFS -DPython_EXECUTABLE=${python} -DCMAKE_CUDA_COMPILER=${toolkit}/bin/nvcc)
# given paths are taken as they are
probe(given 2.21.5 given ${prefix}/lib/libnccl.so
      DEFS ${no_py} -DNCCL_INCLUDE_DIR=${prefix}/include -DNCCL_LIBRARY=${prefix}/lib/libnccl.so)
# a given (or cached) path whose files are gone is not taken
probe(given_missing none "" "" DEFS ${no_py} -DNCCL_INCLUDE_DIR=${WORK_DIR}/gone/include
      -DNCCL_LIBRARY=${WORK_DIR}/gone/lib/libnccl.so)
message(STATUS "FindNCCL: every case found the install it should")
