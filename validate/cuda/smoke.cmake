# Runs validate/cuda/measure.py on the CPU for a small 2-layer nanoGPT and compares the result with trainmem
# (validate/compare.py --file): the harness's training loop runs, and its trainmem_args are flags the CLI
# accepts, with the same parameter count.
#   cmake -DPY=python3 -DSRC=<repo> -DEXE=<trainmem> -DOUT=<json> -P smoke.cmake
execute_process(COMMAND ${PY} ${SRC}/validate/cuda/measure.py --device cpu --model nanogpt-gpt2 --set n_layer=2 --set n_embd=128 --set n_head=4 --set vocab_size=1024
                        --attention eager --batch 2 --seq 64 --precision fp32 --optimizer-impl for-loop
                        --steps 2 --out ${OUT}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "measure.py --device cpu failed (${rc})")
endif()
execute_process(COMMAND ${PY} ${SRC}/validate/compare.py --trainmem ${EXE} --file ${OUT} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "compare.py on the CPU run failed (${rc})")
endif()
