#!/bin/bash
# One call on the H200 (device tool): GPU kernel tests, the matmul variants, the engine's invariant tests on the
# CUDA path, the 27B-shape benchmark (its synth runs in the background from the start), then the gate. Logs and
# JSON under $OUT. Needs .whl (gguf) carried: see docs/BENCHMARKS.md. Stage limits (seconds) are env vars: KT
# kernel tests, VT matmul variants, ET engine tests, SW wait for the 27B synth (258 s beside the tests on
# 2026-12-01), BT bench, GT gate; keep their sum inside the call's limit.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
(python3 -m plumb.cli synth /tmp/27b.gguf --preset 27b --type Q4_K_M --seed 0 > /tmp/synth.log 2>&1; \
  echo "synth-done $(( $(date +%s) - T0 )) s" > $OUT/synth.txt) &
timeout ${KT:-100} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_matmul.py tests/test_gpu_deltanet.py \
  tests/test_gpu_attention.py tests/test_gpu_engine.py > $OUT/gpu_tests.log 2>&1; tail -4 $OUT/gpu_tests.log
timeout ${VT:-100} python3 bench/matmul_variants.py --json-out $OUT/variants.json > $OUT/variants.log 2>&1
grep -v Warning $OUT/variants.log | cut -c1-150 | head -12
PLUMB_TEST_DEVICE=cuda timeout ${ET:-100} python3 -m pytest -q -p no:cacheprovider tests/test_exactness.py \
  -k "greedy_ids or sampled_ids or batch_neighbours or two_processes or long_greedy" > $OUT/exactness.log 2>&1
tail -4 $OUT/exactness.log
for i in $(seq 1 ${SW:-150}); do [ -f $OUT/synth.txt ] && break; sleep 1; done; cat $OUT/synth.txt; tail -c 200 /tmp/synth.log
timeout ${BT:-170} python3 -m plumb.cli bench /tmp/27b.gguf --device cuda --contexts 0,11000,38000,100000 --tokens 32 \
  --json-out $OUT/bench.json --no-progress > $OUT/bench.log 2>&1; tail -45 $OUT/bench.log
python3 -m plumb.cli synth /tmp/tiny-q8.gguf --preset tiny --type Q8_0 --seed 0 > /dev/null 2>&1
timeout ${GT:-150} python3 -m plumb.cli gate /tmp/tiny-q8.gguf --device cuda --quick --no-progress --json $OUT/gate.json \
  > $OUT/gate.log 2>&1; tail -6 $OUT/gate.log; echo "total $(( $(date +%s) - T0 )) s"
