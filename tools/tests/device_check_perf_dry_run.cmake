# tools/device-check STEPS=perf on the CPU backend with a tiny shape (PERF_BACKEND=cpu), BASE_ENV
# (the base = this build under another setting) and PERF_REPEATS=2: the step's logic without a GPU. Checks what it wrote: every bench JSON, the verified runs
# verified, stage-time sections, the table's rows (figure = the JSON's median, the base column), and
# the rows-written-once byte count recomputed from the row's counts.
# -DCLI=<elasticep> -DROOT=<source dir> -DBUILD_DIR=<build dir> -DWORK_DIR=<output dir>
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env STEPS=perf PERF_BACKEND=cpu "PERF_SHAPE=--hidden 256 --experts 16 --topk 4"
          PERF_DECODE_TOKENS=1,8 PERF_PREFILL_TOKENS=16,64 PERF_DECODE_T=8 PERF_PREFILL_T=64 PERF_ROUNDS=2 PERF_REPEATS=2
          ELASTICEP_BUILD_DIR=${BUILD_DIR} BASE_ENV=ELASTICEP_BULK_COPIES=0 STEP_TIMEOUT=120
          bash ${ROOT}/tools/device-check ${WORK_DIR}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "device-check STEPS=perf exited ${rc}:\n${out}\n${err}")
endif()
foreach(f perf_decode perf_prefill base_perf_decode base_perf_prefill perf_decode_verified perf_prefill_verified
          perf_sweep_decode perf_sweep_prefill base_perf_sweep_decode base_perf_sweep_prefill perf_decode_rep1
          perf_decode_rep2 base_perf_decode_rep1 base_perf_decode_rep2)
  if(NOT EXISTS "${WORK_DIR}/${f}.json")
    message(FATAL_ERROR "no ${f}.json:\n${out}")
  endif()
endforeach()
foreach(f perf_decode_verified perf_prefill_verified)
  file(READ "${WORK_DIR}/${f}.json" j)
  string(JSON v GET "${j}" verified)
  if(NOT v STREQUAL "ON")
    message(FATAL_ERROR "${f}.json: verified = ${v}")
  endif()
endforeach()
file(READ "${WORK_DIR}/perf.log" log)
string(FIND "${log}" "### base decode sweep: env ELASTICEP_BULK_COPIES=0 ${CLI} bench" at)
if(at LESS 0)
  message(FATAL_ERROR "perf.log: the base sweep did not run under BASE_ENV:\n${log}")
endif()
file(READ "${WORK_DIR}/stages.log" stages)
foreach(h "### new: decode T=8" "### base: prefill T=64")
  string(FIND "${stages}" "${h}" at)
  if(at LESS 0)
    message(FATAL_ERROR "stages.log lacks '${h}'")
  endif()
endforeach()
# the table: 4 rows (decode dispatch/combine, prefill dispatch/combine; no graph on the CPU backend)
file(READ "${WORK_DIR}/perf_table.json" t)
string(JSON n LENGTH "${t}" rows)
if(NOT n EQUAL 4)
  message(FATAL_ERROR "perf_table.json has ${n} rows, want 4")
endif()
file(READ "${WORK_DIR}/perf_decode.json" dec)
# the headline run (T = 8, C = 8): the table's figure is its dispatch median, beside the base's; the
# CPU backend reports no HBM floor, so no ratio
string(JSON cap GET "${dec}" results 0 max_tokens_per_rank)
if(NOT cap EQUAL 8)
  message(FATAL_ERROR "the headline decode run has C = ${cap}, want 8 (C = T)")
endif()
string(JSON med GET "${dec}" results 0 phases dispatch latency_us median)
string(JSON got GET "${t}" rows 0 us)
string(JSON base GET "${t}" rows 0 base_us)
string(JSON fig GET "${t}" rows 0 figure)
string(JSON x TYPE "${t}" rows 0 x_floor)
if(NOT fig STREQUAL "dispatch" OR NOT got STREQUAL med OR base STREQUAL "" OR NOT x STREQUAL "NULL")
  message(FATAL_ERROR "row 0: figure ${fig}, us ${got} (JSON median ${med}), base ${base}, x_floor ${x}")
endif()
# rows written once, recomputed from the row's counts (H = 256 fp8 with fp32 1x128 scales: a received
# row is 256 + 2 * 4 bytes; x is read as bf16): dispatch = tokens * 512 + routes * 264, combine =
# routes * 512 + tokens * 512
string(JSON tokens GET "${dec}" results 0 traffic tokens)
string(JSON routes GET "${dec}" results 0 traffic routes)
string(JSON dmin GET "${dec}" results 0 phases dispatch hbm_min_bytes)
string(JSON cmin GET "${dec}" results 0 phases combine hbm_min_bytes)
math(EXPR want_d "${tokens} * 512 + ${routes} * 264")
math(EXPR want_c "${routes} * 512 + ${tokens} * 512")
if(NOT dmin EQUAL want_d OR NOT cmin EQUAL want_c)
  message(FATAL_ERROR "min bytes: dispatch ${dmin} (want ${want_d}), combine ${cmin} (want ${want_c})")
endif()
# the memory rows: the EP128 host-sync reservation from `elasticep info --json`, judged against 4 GiB
string(JSON mem_n LENGTH "${t}" memory)
string(JSON mem_met GET "${t}" memory 0 met)
if(NOT mem_n EQUAL 2 OR NOT mem_met STREQUAL "ON")
  message(FATAL_ERROR "perf_table.json memory rows: ${mem_n}, met = ${mem_met}")
endif()
file(READ "${WORK_DIR}/perf_table.md" md)
if(NOT md MATCHES "\\| decode T=8 \\| dispatch \\|" OR NOT md MATCHES "\\| prefill T=64 \\| combine \\|")
  message(FATAL_ERROR "perf_table.md:\n${md}")
endif()
# the repeats' table: 2 repeats, each figure's medians the runs' own (dispatch of repeat 2, new and
# base), the paired change their difference's median
file(READ "${WORK_DIR}/ab_repeats.json" ab)
string(JSON reps GET "${ab}" repeats)
string(JSON fig0 GET "${ab}" rows 0 figure)
string(JSON n2 GET "${ab}" rows 0 new_us 1)
string(JSON b2 GET "${ab}" rows 0 base_us 1)
file(READ "${WORK_DIR}/perf_decode_rep2.json" r2)
file(READ "${WORK_DIR}/base_perf_decode_rep2.json" br2)
string(JSON want_n2 GET "${r2}" results 0 phases dispatch latency_us median)
string(JSON want_b2 GET "${br2}" results 0 phases dispatch latency_us median)
if(NOT reps EQUAL 2 OR NOT fig0 STREQUAL "dispatch" OR NOT n2 STREQUAL want_n2 OR NOT b2 STREQUAL want_b2)
  message(FATAL_ERROR "ab_repeats.json: ${reps} repeats, row 0 ${fig0}, repeat 2 ${n2} / ${b2} (want ${want_n2} / ${want_b2})")
endif()
