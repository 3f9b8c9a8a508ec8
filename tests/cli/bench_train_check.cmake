# Runs `strata bench train` on two tiny configurations of one shape (host placement, and "auto",
# which resolves to the device on the host device) beside plain PyTorch on the CPU, and checks
# the final JSON line: both runs and the baseline timed, each ratio = run / baseline, the same
# losses in both runs (placement changes no number), the resolved placements. Numbers, not speed.
execute_process(COMMAND ${STRATA} bench train --configs ${SRC}/train_tiny_host.json,${SRC}/train_tiny_auto.json
                        --baselines plain --python ${PYTHON} --dir ${WORK} --steps 4 --warmup 1
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "strata bench train failed (${rc}):\n${err}\n${out}")
endif()
string(STRIP "${out}" out)
string(REGEX REPLACE ".*\n" "" last "${out}")
string(JSON metric GET "${last}" metric)
if(NOT metric STREQUAL "train_step_seconds")
  message(FATAL_ERROR "final line: ${last}")
endif()
string(JSON b GET "${last}" baseline_value plain)
foreach(run train_tiny_host train_tiny_auto)
  string(JSON v GET "${last}" value ${run})
  string(JSON r GET "${last}" ratio "${run} / plain")
  if(NOT v GREATER 0 OR NOT b GREATER 0)
    message(FATAL_ERROR "${run}: value ${v} baseline ${b}: ${last}")
  endif()
  execute_process(COMMAND awk "BEGIN { exit !((${r} * ${b} - ${v}) ^ 2 < 1e-9 * ${v} * ${v}) }" RESULT_VARIABLE bad)
  if(NOT bad EQUAL 0)
    message(FATAL_ERROR "${run}: ratio ${r} != ${v} / ${b}")
  endif()
endforeach()
string(JSON lh GET "${last}" losses train_tiny_host)
string(JSON la GET "${last}" losses train_tiny_auto)
string(JSON n LENGTH "${last}" losses train_tiny_host)
if(NOT n EQUAL 4 OR NOT lh STREQUAL la)
  message(FATAL_ERROR "losses differ or are not 4 steps: ${lh} vs ${la}")
endif()
string(JSON ph GET "${last}" placement train_tiny_host activations)
string(JSON pa GET "${last}" placement train_tiny_auto activations)
string(JSON pm GET "${last}" placement train_tiny_auto master)
if(NOT ph STREQUAL "host" OR NOT pa STREQUAL "device" OR NOT pm STREQUAL "device")
  message(FATAL_ERROR "placements: host run activations ${ph}, auto run activations ${pa} master ${pm}")
endif()

# Configurations of different shapes cannot share a baseline.
execute_process(COMMAND ${STRATA} bench train --configs ${SRC}/train_tiny_host.json,${SRC}/train_tiny_3_layers.json
                        --baselines none --dir ${WORK}
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(rc EQUAL 0 OR NOT err MATCHES "differs in shape")
  message(FATAL_ERROR "mixed shapes not rejected (${rc}): ${err}")
endif()
message(STATUS "${last}")
