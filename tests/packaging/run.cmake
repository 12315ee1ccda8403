# `cmake --install` of a built tree into a scratch prefix, checked as a packager would:
#   1. the default install holds exactly the library, headers (version.hpp included, with the
#      project's version), CMake package, licence and CLI: no stray files (no elasticep/_C*.so);
#   2. the exported targets name no absolute path (no NCCL, CUDA or build-tree path);
#   3. a consumer project outside the tree finds it with find_package(elasticep), builds, runs;
#   4. the installed CLI prints the project's version;
#   5. the `python` component (only when asked for) installs an importable package.
# Usage: cmake -DSOURCE_DIR= -DBINARY_DIR= -DWORK_DIR= -DVERSION= -DCLI=0|1 [-DPYTHON=<python>] -P run.cmake
set(prefix ${WORK_DIR}/prefix)
set(consumer_build ${WORK_DIR}/consumer-build)
file(REMOVE_RECURSE ${WORK_DIR})

execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc}):\n${out}\n${err}")
endif()

# 1. the file list
file(GLOB_RECURSE files RELATIVE ${prefix} ${prefix}/*)
set(allowed "^include/elasticep/[a-z_]+\\.hpp$" "^lib(64)?/libelasticep\\.a$" "^lib(64)?/cmake/elasticep/[A-Za-z_-]+\\.cmake$"
            "^share/doc/elasticep/LICENSE$")
if(CLI)
  list(APPEND allowed "^bin/elasticep$")
endif()
set(stray "")
foreach(f IN LISTS files)
  set(ok FALSE)
  foreach(pattern IN LISTS allowed)
    if(f MATCHES "${pattern}")
      set(ok TRUE)
    endif()
  endforeach()
  if(NOT ok)
    list(APPEND stray ${f})
  endif()
endforeach()
if(stray)
  message(FATAL_ERROR "the default install holds files it should not: ${stray}")
endif()
foreach(required include/elasticep/elasticep.hpp include/elasticep/version.hpp include/elasticep/traffic.hpp
                 share/doc/elasticep/LICENSE)
  if(NOT EXISTS ${prefix}/${required})
    message(FATAL_ERROR "the install lacks ${required}")
  endif()
endforeach()
file(STRINGS ${prefix}/include/elasticep/version.hpp v REGEX "#define ELASTICEP_VERSION_STRING")
if(NOT v MATCHES "\"${VERSION}\"")
  message(FATAL_ERROR "installed version.hpp says '${v}', the project is ${VERSION}")
endif()
list(LENGTH files n)
message(STATUS "install: ${n} files, none stray")

# 2. no absolute path in any exported target property
file(GLOB target_files ${prefix}/lib*/cmake/elasticep/elasticepTargets*.cmake)
foreach(tf IN LISTS target_files)
  file(STRINGS ${tf} props REGEX "INTERFACE_[A-Z_]+ \"")
  foreach(p IN LISTS props)
    string(REPLACE "\${_IMPORT_PREFIX}/" "" p_rel "${p}")  # paths inside the install are fine
    if(p_rel MATCHES "/|[Nn][Cc][Cc][Ll]")
      message(FATAL_ERROR "${tf} exports a machine path: ${p}")
    endif()
  endforeach()
endforeach()
message(STATUS "exported targets: no absolute path")

# 3. a consumer with find_package
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/packaging/consumer -B ${consumer_build}
                        -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer configure failed:\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${consumer_build} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer build failed:\n${out}\n${err}")
endif()
execute_process(COMMAND ${consumer_build}/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "${out}${err}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "consumer ok: elasticep ${VERSION} ")
  message(FATAL_ERROR "consumer run failed: ${rc}")
endif()

# 4. the installed CLI
if(CLI)
  execute_process(COMMAND ${prefix}/bin/elasticep --version RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  string(STRIP "${out}" out)
  if(NOT rc EQUAL 0 OR NOT out STREQUAL VERSION)
    message(FATAL_ERROR "installed `elasticep --version` printed '${out}' (exit ${rc}), want ${VERSION}")
  endif()
  message(STATUS "installed CLI: elasticep --version = ${out}")
endif()

# 5. the python component, into its own prefix
if(PYTHON)
  set(pyprefix ${WORK_DIR}/python-prefix)
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${pyprefix} --component python
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install --component python failed (${rc}):\n${out}\n${err}")
  endif()
  file(GLOB_RECURSE ext RELATIVE ${pyprefix} ${pyprefix}/*_C*.so)
  if(NOT ext MATCHES "^lib(64)?/python[0-9.]+/site-packages/elasticep/_C")
    message(FATAL_ERROR "the python component put the extension at '${ext}'")
  endif()
  get_filename_component(site ${pyprefix}/${ext} DIRECTORY)
  get_filename_component(site ${site} DIRECTORY)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PYTHONPATH=${site} ${PYTHON} -c
                          "import elasticep; print(elasticep.__version__, elasticep.__file__)"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "^${VERSION} ${site}/elasticep/__init__.py")
    message(FATAL_ERROR "the installed python package does not import from ${site}: ${out}${err}")
  endif()
  message(STATUS "python component: ${out}")
endif()
