# `elasticep info --json` with a buffer config: sizes recomputed here from SEMANTICS.md shapes.
execute_process(COMMAND ${CLI} info --json --ranks 4 --experts 16 --topk 4 --hidden 256 --tokens 32 --payload fp8
                        --scale-format f32_g128 --alignment 8
                RESULT_VARIABLE rc OUTPUT_VARIABLE json ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "info exited ${rc}: ${err}")
endif()
function(expect_eq what got want)
  if(NOT "${got}" STREQUAL "${want}")
    message(FATAL_ERROR "${what} = '${got}', want '${want}'")
  endif()
endfunction()
string(JSON v GET "${json}" version)
if(NOT v MATCHES "^[0-9]+\\.[0-9]+\\.[0-9]+")
  message(FATAL_ERROR "version '${v}'")
endif()
# message: payload 256 + scales 2*4 -> 16 + idx 16 + weights 16 + src 16
string(JSON v GET "${json}" config message_bytes)
expect_eq(message_bytes ${v} 320)
# contiguous worst case: M_cap = R*C*min(K, E_local) + E_local*(A-1) = 4*32*4 + 4*7 = 540
string(JSON v GET "${json}" config layouts contiguous recv_x shape 0)
expect_eq("contiguous rows" ${v} 540)
string(JSON v GET "${json}" config layouts contiguous recv_x bytes)
expect_eq("contiguous recv_x bytes" ${v} 138240)
string(JSON v GET "${json}" config layouts contiguous recv_scales bytes)
expect_eq("contiguous recv_scales bytes" ${v} 4320)
string(JSON v GET "${json}" config layouts contiguous m_indices bytes)
expect_eq("contiguous m_indices bytes" ${v} 2160)
# masked: [E_local, R*C, H] = [4, 128, 256]
string(JSON v GET "${json}" config layouts masked recv_x bytes)
expect_eq("masked recv_x bytes" ${v} 131072)
string(JSON v GET "${json}" config layouts masked recv_weights bytes)
expect_eq("masked recv_weights bytes" ${v} 2048)
# the cpu backend reserves at least the receive slots: R*C messages
string(JSON v GET "${json}" config reservation_bytes cpu)
if(v LESS 40960)
  message(FATAL_ERROR "cpu reservation ${v} is below R*C*message = 40960")
endif()
message(STATUS "info config sizes ok")
# contiguous outputs: recv_x 138240 + scales 4320 + weights, src, m_indices 3 * 540 * 4 + counts 4 * 4 + offsets 5 * 4
string(JSON v GET "${json}" config layouts contiguous total_bytes)
expect_eq("contiguous total_bytes" ${v} 149076)
# per rank: the reservation plus the outputs of the layout
string(JSON res GET "${json}" config reservation_bytes cpu)
math(EXPR want "${res} + 149076")
string(JSON v GET "${json}" config layouts contiguous per_rank_total_bytes cpu)
expect_eq("contiguous per_rank_total_bytes cpu" ${v} ${want})
message(STATUS "info per-rank totals ok")
