# `elasticep bench --json` on tiny scenarios whose traffic is known in advance. The expected
# numbers are computed here from the scenario alone (wire format of layout.hpp, routing facts),
# not read from the tool.
file(MAKE_DIRECTORY ${WORK_DIR})

function(round16 out v)
  math(EXPR r "(${v} + 15) / 16 * 16")
  set(${out} ${r} PARENT_SCOPE)
endfunction()

function(expect_eq what got want)
  if(NOT "${got}" STREQUAL "${want}")
    message(FATAL_ERROR "${CURRENT_CASE}: ${what} = '${got}', want '${want}'")
  endif()
endfunction()

# run_case(name rc ARGS ...): `bench ARGS --json` (JSON on stdout) -> JSON (the whole report) and
# R (its first result row)
macro(run_case name want_rc)
  set(CURRENT_CASE ${name})
  execute_process(COMMAND ${CLI} bench ${ARGN} --json --no-progress --backend cpu
                  RESULT_VARIABLE rc OUTPUT_VARIABLE JSON ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${want_rc}")
    message(FATAL_ERROR "${name}: exit code ${rc}, want ${want_rc}\n${JSON}\n${err}")
  endif()
  string(JSON R GET "${JSON}" results 0)
  message(STATUS "${name}: ok (exit ${rc})")
endmacro()

# message bytes: payload H*elem, scales cols*4, idx K*4, weights K*4, each rounded to 16, + 16 (src)
function(message_bytes out h elem cols k)
  math(EXPR p "${h} * ${elem}")
  round16(p ${p})
  math(EXPR s "${cols} * 4")
  round16(s ${s})
  math(EXPR i "${k} * 4")
  round16(i ${i})
  math(EXPR r "${p} + ${s} + 2 * ${i} + 16")
  set(${out} ${r} PARENT_SCOPE)
endfunction()

macro(check_traffic h msg peer local routes rounds)
  string(JSON v GET "${R}" message_bytes)
  expect_eq(message_bytes ${v} ${msg})
  string(JSON v GET "${R}" routes_per_round)
  expect_eq(routes_per_round ${v} ${routes})
  math(EXPR dpeer "${peer} * ${msg}")
  math(EXPR dlocal "${local} * ${msg}")
  math(EXPR cpeer "${peer} * ${h} * 2")
  math(EXPR clocal "${local} * ${h} * 2")
  foreach(phase dispatch combine)
    string(JSON v GET "${R}" phases ${phase} peer_messages)
    expect_eq("${phase} peer_messages" ${v} ${peer})
    string(JSON v GET "${R}" phases ${phase} local_messages)
    expect_eq("${phase} local_messages" ${v} ${local})
    string(JSON n LENGTH "${R}" phases ${phase} latency_us rounds)
    expect_eq("${phase} timed rounds" ${n} ${rounds})
    string(JSON med GET "${R}" phases ${phase} latency_us median)
    if(NOT med GREATER 0)
      message(FATAL_ERROR "${CURRENT_CASE}: ${phase} median latency ${med} is not positive")
    endif()
  endforeach()
  string(JSON v GET "${R}" phases dispatch peer_bytes)
  expect_eq("dispatch peer_bytes" ${v} ${dpeer})
  string(JSON v GET "${R}" phases dispatch local_bytes)
  expect_eq("dispatch local_bytes" ${v} ${dlocal})
  string(JSON v GET "${R}" phases combine peer_bytes)
  expect_eq("combine peer_bytes" ${v} ${cpeer})
  string(JSON v GET "${R}" phases combine local_bytes)
  expect_eq("combine local_bytes" ${v} ${clocal})
endmacro()

# The ranks' start spread (the CPU backend's marks share the host's clock): every timed round has one,
# it is not negative, and the time from the last rank's start to the last end lies between 0 and the
# round's latency (the slowest rank's own time).
macro(check_start_spread rounds)
  foreach(phase dispatch combine)
    string(JSON n LENGTH "${R}" phases ${phase} latency_us start_spread_rounds)
    expect_eq("${phase} start spread rounds" ${n} ${rounds})
    math(EXPR last "${rounds} - 1")
    foreach(i RANGE ${last})
      string(JSON sp GET "${R}" phases ${phase} latency_us start_spread_rounds ${i})
      string(JSON fl GET "${R}" phases ${phase} latency_us from_last_start_rounds ${i})
      string(JSON lat GET "${R}" phases ${phase} latency_us rounds ${i})
      if(sp LESS 0 OR fl LESS 0 OR fl GREATER lat)
        message(FATAL_ERROR "${CURRENT_CASE}: ${phase} round ${i}: start spread ${sp}, from the last start ${fl}, "
                            "latency ${lat}")
      endif()
    endforeach()
  endforeach()
endmacro()

# Every timed isolated round has the slowest rank's host time of its call, a positive number.
macro(check_host_call rounds)
  foreach(phase dispatch combine)
    string(JSON n LENGTH "${R}" phases ${phase} latency_us host_call_rounds)
    expect_eq("${phase} host call rounds" ${n} ${rounds})
    string(JSON v GET "${R}" phases ${phase} latency_us host_call)
    if(NOT v GREATER 0)
      message(FATAL_ERROR "${CURRENT_CASE}: ${phase}: host time of a call ${v} is not positive")
    endif()
  endforeach()
endmacro()

# One rank: no spread, and from its start to its end is its latency.
macro(check_one_rank_spread)
  foreach(phase dispatch combine)
    string(JSON sp GET "${R}" phases ${phase} latency_us start_spread)
    string(JSON fl GET "${R}" phases ${phase} latency_us from_last_start)
    string(JSON med GET "${R}" phases ${phase} latency_us median)
    if(NOT sp EQUAL 0 OR NOT fl EQUAL med)
      message(FATAL_ERROR "${CURRENT_CASE}: ${phase}: one rank's start spread ${sp} (want 0), from its start "
                          "${fl} (want its median ${med})")
    endif()
  endforeach()
endmacro()

# Every isolated round (warm-up included) checks both phases; the back-to-back run checks its last
# dispatch and every one of its `rounds` combines.
macro(check_verified want warmup rounds)
  string(JSON v GET "${JSON}" verified)
  expect_eq(verified "${v}" ${want})
  string(JSON v GET "${R}" verified)
  expect_eq("row verified" "${v}" ${want})
  if(want STREQUAL "ON")
    math(EXPR d "${warmup} + ${rounds} + 1")
    math(EXPR c "${warmup} + 2 * ${rounds}")
    string(JSON v GET "${R}" phases dispatch rounds_verified)
    expect_eq("dispatch rounds_verified" ${v} ${d})
    string(JSON v GET "${R}" phases combine rounds_verified)
    expect_eq("combine rounds_verified" ${v} ${c})
  endif()
endmacro()

# 1. K = E: every token goes to every rank. R=3, T=5, bf16, H=64: peers R*T*(R-1), local R*T.
run_case(all_ranks 0 --ranks 3 --tokens 5 --hidden 64 --experts 6 --topk 6 --payload bf16 --rounds 3 --warmup 1)
message_bytes(msg 64 2 0 6)
check_traffic(64 ${msg} 30 15 90 3)
check_start_spread(3)
check_host_call(3)
check_verified(ON 1 3)
# back to back: 3 timed rounds too
string(JSON n LENGTH "${R}" phases dispatch back_to_back_us rounds)
expect_eq("back-to-back rounds" ${n} 3)
# the library's traffic block says the same as the phases
string(JSON v GET "${R}" traffic dispatch_peer_bytes)
math(EXPR want "30 * ${msg}")
expect_eq("traffic dispatch_peer_bytes" ${v} ${want})
# --json FILE: the table on stdout, the JSON (same counts) in the file
execute_process(COMMAND ${CLI} bench --ranks 3 --tokens 5 --hidden 64 --experts 6 --topk 6 --payload bf16 --rounds 1
                        --warmup 0 --json ${WORK_DIR}/file.json --no-progress --backend cpu
                RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_VARIABLE err)
expect_eq("--json FILE exit code" "${rc}" 0)
if(NOT text MATCHES "summary: PASS")
  message(FATAL_ERROR "--json FILE: stdout is not the table:\n${text}${err}")
endif()
file(READ ${WORK_DIR}/file.json file_json)
string(JSON v GET "${file_json}" results 0 phases dispatch peer_messages)
expect_eq("--json FILE peer_messages" ${v} 30)

# 2. one rank: everything is local. fp8 ue8m0_g32, H=256: 2 scale words, masked layout, int32 ids.
run_case(one_rank 0 --ranks 1 --tokens 7 --hidden 256 --experts 4 --topk 3 --payload fp8 --scale-format ue8m0_g32
         --layout masked --idx-dtype int32 --rounds 2 --warmup 0)
message_bytes(msg 256 1 2 3)
check_traffic(256 ${msg} 0 7 21 2)
check_start_spread(2)
check_one_rank_spread()
check_verified(ON 0 2)

# 3. every route dropped: nothing moves, and the (empty) outputs still verify.
run_case(all_dropped 0 --ranks 2 --tokens 4 --hidden 128 --experts 4 --topk 2 --payload fp8 --drop 1 --rounds 1)
message_bytes(msg 128 1 1 2)
check_traffic(128 ${msg} 0 0 0 1)
check_verified(ON 1 1)

# 4. --no-verify: verified is null, the exit code 0, timings still there.
run_case(no_verify 0 --ranks 2 --tokens 4 --hidden 128 --experts 4 --topk 4 --payload bf16 --no-verify --rounds 2 --warmup 0)
message_bytes(msg 128 2 0 4)
check_traffic(128 ${msg} 8 8 32 2)
string(JSON v TYPE "${JSON}" verified)
expect_eq("verified type" ${v} NULL)
string(JSON v GET "${R}" phases dispatch rounds_verified)
expect_eq("unverified rounds_verified" ${v} 0)

# 5. an altered dispatch byte: exit code 1, verified false, the failure named.
run_case(injected 1 --ranks 2 --tokens 4 --hidden 128 --experts 4 --topk 4 --payload fp8 --rounds 1 --inject-mismatch dispatch)
check_verified(OFF 0 1)
string(JSON v GET "${R}" failures 0)
if(NOT v MATCHES "dispatch: recv_x row")
  message(FATAL_ERROR "injected: first failure '${v}' does not name the recv_x row")
endif()
