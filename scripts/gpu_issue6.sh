#!/bin/bash
# Issue 6 on the H200 (after .gpu/pN/take.sh installed DALI + fastai into /tmp/site). Usage: gpu_issue6.sh tests|rest|mixed
# Every result goes to $OUT as it is produced; each step has its own timeout so a slow one still returns the rest.
set -u
test -d /tmp/site || exit 3
export PYTHONPATH=/tmp/site:$PWD MPLBACKEND=Agg FASTAI_DALI_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt 2>&1
python3 -c "import nvidia.dali, fastai, torch; print('dali', nvidia.dali.__version__, 'fastai', fastai.__version__, 'torch', torch.__version__)" >> $OUT/gpu.txt 2>&1
case $1 in
tests)  # the issue 6 tests, with the measured |DALI - fastai| logged per case
  t=${2:-500}; shift; shift
  FASTAI_DALI_DIFF_LOG=$OUT/diffs_cuda.jsonl timeout $t python3 -m pytest -q -p no:cacheprovider -rfEX --durations=20 -s \
    ${@:-tests/test_bad_input.py tests/test_lifecycle.py} > $OUT/pytest_issue6_cuda.txt 2>&1
  echo "rc $?" >> $OUT/pytest_issue6_cuda.txt; tail -25 $OUT/pytest_issue6_cuda.txt ;;
rest)   # the rest of the suite
  timeout ${2:-540} python3 -m pytest -q -p no:cacheprovider -rfEX --durations=10 tests \
    --ignore tests/test_bad_input.py --ignore tests/test_lifecycle.py > $OUT/pytest_rest_cuda.txt 2>&1
  echo "rc $?" >> $OUT/pytest_rest_cuda.txt; tail -25 $OUT/pytest_rest_cuda.txt ;;
mixed)  # import cost of one worker, GPU memory over 20 epochs, mixed path start-up and whole epochs per worker count
  { for i in 1 2; do /usr/bin/time -f "one process imports fastai_dali.all: %e s" python3 -c "import fastai_dali.all"; done; } > $OUT/import.txt 2>&1
  python3 -c "from fastai_dali.bench import make_bench_dataset; make_bench_dataset('/tmp/bench/data_10000', 10000)" > /dev/null 2>&1
  timeout 120 python3 scripts/profile_issue5.py --data /tmp/bench/data_10000 --out $OUT/memory --sections memory > $OUT/memory.txt 2>&1
  { /usr/bin/time -f "8 processes importing fastai_dali.all at once: %e s" bash -c 'for i in 1 2 3 4 5 6 7 8; do python3 -c "import fastai_dali.all" & done; wait'; } >> $OUT/import.txt 2>&1
  cat $OUT/import.txt
  OUT=$OUT timeout ${2:-400} python3 scripts/mixed_startup.py /tmp/bench/data_10000 ${3:-2,4,8} cuda > $OUT/mixed.txt 2>&1
  echo "rc $?" >> $OUT/mixed.txt; cat $OUT/mixed.txt | grep -v Warning | tail -20 ;;
startup)  # mixed path only (after the worker start-up fix): start-up and whole epochs per worker count
  python3 -c "from fastai_dali.bench import make_bench_dataset; make_bench_dataset('/tmp/bench/data_10000', 10000)" > /dev/null 2>&1
  OUT=$OUT timeout ${2:-300} python3 scripts/mixed_startup.py /tmp/bench/data_10000 ${3:-4,8,16} cuda > $OUT/mixed.txt 2>&1
  echo "rc $?" >> $OUT/mixed.txt; grep -v -i "nvjpeg\|nvtiff\|Note:" $OUT/mixed.txt | tail -20 ;;
esac
