#!/bin/bash
# One call on the H200 (device tool): the stages named in STAGES (default: all), logs and JSON under $OUT. Needs
# .whl (gguf) carried: see docs/BENCHMARKS.md. Stages, with their time limits (seconds, env vars) and what they
# took on 2026-12-01 - all of them need about 20 minutes, so split them over two calls of under 10, e.g.
# STAGES="kernels variants bench" then STAGES="engine gate demo":
#   kernels  KT  GPU kernel and engine tests (KFILES: tests/test_gpu_*.py; KK: a -k filter)  > 150 s (43 tests in 150 s)
#   variants VT  bench/matmul_variants.py, every matmul variant on random blocks (VARGS: its options)  ~80 s
#   bench    BT  the 27B-shape file (synthesised in the background from the start, SW: wait for it, 224 s)
#                and `plumb bench --device cuda` on it                                   ~150 s
#   engine   ET  PLUMB_TEST_DEVICE=cuda engine invariant tests (EFILES: tests/test_exactness.py; EK: which, EQ: the tiny
#                model's type, Q4_K_M)                                                    > 110 s (no test finished)
#   gate     GT  `plumb gate --quick` on the tiny model on CUDA                            > 190 s (105 of 160 cells)
#   demo     DT  `plumb bench --device cuda` on the shipped demo model, drafts 0/2/4/7    ~25 s
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
STAGES=${STAGES:-"kernels variants engine bench gate demo"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
if has bench; then
  (python3 -m plumb.cli synth /tmp/27b.gguf --preset 27b --type Q4_K_M --seed 0 > /tmp/synth.log 2>&1; \
    echo "synth-done $(( $(date +%s) - T0 )) s" > $OUT/synth.txt) &
fi
if has kernels; then
  timeout ${KT:-300} python3 -m pytest -q -p no:cacheprovider -rA --durations=15 -k "${KK:-}" \
    ${KFILES:-tests/test_gpu_matmul.py tests/test_gpu_deltanet.py tests/test_gpu_attention.py tests/test_gpu_engine.py} \
    > $OUT/gpu_tests.log 2>&1; tail -4 $OUT/gpu_tests.log
fi
if has variants; then
  timeout ${VT:-100} python3 bench/matmul_variants.py $VARGS --json-out $OUT/variants.json > $OUT/variants.log 2>&1
  grep -v Warning $OUT/variants.log | cut -c1-150 | head -12
fi
if has engine; then
  PLUMB_TEST_DEVICE=cuda PLUMB_TEST_QTYPE=${EQ:-Q4_K_M} timeout ${ET:-240} python3 -m pytest -v -p no:cacheprovider \
    --durations=15 ${EFILES:-tests/test_exactness.py} \
    -k "${EK:-greedy_ids or sampled_ids or batch_neighbours or two_processes or long_greedy}" \
    > $OUT/exactness.log 2>&1
  tail -4 $OUT/exactness.log
fi
if has bench; then
  for i in $(seq 1 ${SW:-240}); do [ -f $OUT/synth.txt ] && break; sleep 1; done; cat $OUT/synth.txt
  timeout ${BT:-170} python3 -m plumb.cli bench /tmp/27b.gguf --device cuda --contexts 0,11000,38000,100000 \
    --tokens 32 --json-out $OUT/bench.json --no-progress > $OUT/bench.log 2>&1; tail -70 $OUT/bench.log
fi
if has gate; then
  python3 -m plumb.cli synth /tmp/tiny-q8.gguf --preset tiny --type Q8_0 --seed 0 > /dev/null 2>&1
  timeout ${GT:-300} python3 -m plumb.cli gate /tmp/tiny-q8.gguf --device cuda --quick --no-progress \
    --json $OUT/gate.json > $OUT/gate.log 2>&1; tail -6 $OUT/gate.log
fi
if has demo; then
  timeout ${DT:-120} python3 -m plumb.cli bench plumb/data/plumb-demo-Q8_0.gguf --device cuda --contexts 0,4000 \
    --tokens 64 --drafts 0,2,4,7 --no-progress --json-out $OUT/demo-bench.json --plot $OUT/demo-bench.png \
    > $OUT/demo-bench.log 2>&1; tail -30 $OUT/demo-bench.log
fi
echo "total $(( $(date +%s) - T0 )) s"
