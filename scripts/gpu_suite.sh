#!/bin/bash
# The GPU test suite on a machine with an NVIDIA GPU, once DALI, fastai and torch are installed into /tmp/site
# (`pip install --target /tmp/site ...`; the package itself is imported from this source tree).
# Usage: OUT=DIR bash scripts/gpu_suite.sh RUN [extra] [PROCS]   RUN names the output files; extra: resize | commands | loaders | training | losses | gpus | none;
# SKIP_SUITE=1 runs the extra alone;
# PROCS > 1 runs the suite in that many processes, one test file each at a time (pytest-xdist, `-n PROCS --dist loadfile`, the default here;
# or DIST=worksteal: tests handed out one at a time;
# pytest-xdist's wheels are installed from .whl/ if it is missing). Runs the whole GPU suite in one go
# (FASTAI_DALI_TEST_DEVICE=cuda pytest -q tests; the bad-input tests log their measured |DALI - fastai| to
# $OUT/diffs_cuda.jsonl), then the extra measurements; every result goes to $OUT as it is produced.
SITE=${SITE:-/tmp/site}   # where DALI, fastai and the rest are installed (`pip install --target`): PYTHONPATH
set -u
test -d $SITE || exit 3
procs=${3:-1}; xd=""
if [[ $procs -gt 1 ]]; then
  python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl
  xd="-n $procs --dist ${DIST:-loadfile}"
fi
export PYTHONPATH=$SITE:$PWD MPLBACKEND=Agg FASTAI_DALI_TEST_DEVICE=cuda PYTHONUNBUFFERED=1 FASTAI_DALI_DIFF_LOG=$OUT/diffs_cuda.jsonl FASTAI_DALI_BUILD_LOG=$OUT/builds_cuda.jsonl
run=${1:-1}; extra=${2:-none}
# Every process of the suite (4 xdist workers, the console-command tests' subprocesses, DALI's spawned workers) imports
# torch, fastai and DALI: byte-compile what was installed into /tmp/site once (pip installed it with --no-compile), and
# say what an import costs before and after
imp() { python3 -c "import time; t = time.perf_counter(); import fastai_dali.all; print('import fastai_dali.all ($1): %.1f s' % (time.perf_counter() - t))" 2>&1 | tail -1; }
if [[ ! -f $SITE/.compiled ]]; then
  { echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"; imp 'as installed'; imp 'again'
    python3 -m compileall -q -j 0 $SITE > /dev/null 2>&1; touch $SITE/.compiled; imp 'byte-compiled'; } > $OUT/import_times.txt 2>&1
  cat $OUT/import_times.txt
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c "import nvidia.dali, fastai, torch; print('dali', nvidia.dali.__version__, 'fastai', fastai.__version__, 'torch', torch.__version__)"; } > $OUT/env.txt 2>&1
if [[ -z ${SKIP_SUITE:-} ]]; then
# the GPU's memory and load, and each process's memory, every 2 s while the suite runs
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,utilization.decoder --format=csv,noheader -l 2 > $OUT/gpu_usage_run$run.csv 2>&1 &
smi=$!
nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv,noheader -l 2 > $OUT/gpu_apps_run$run.csv 2>&1 &
apps=$!
trap 'kill $smi $apps 2>/dev/null' EXIT  # the samplers end with the script, however it ends
t0=$(date +%s)
# -v: one line per test as it ends (names survive a cut run); SIGINT at the limit: pytest still prints its failures and summary;
# -p no:randomly: the longest files first (conftest.py's LONGEST_FIRST), not pytest-randomly's shuffle (CI's)
timeout -s INT -k 20 ${SUITE_TIMEOUT:-480} python3 -m pytest -v -p no:cacheprovider -p no:randomly -rfEX --durations=0 --durations-min=2 $xd ${PYTEST_EXTRA:-} tests > $OUT/pytest_cuda_run$run.txt 2>&1
rc=$?; echo "rc $rc wall $(( $(date +%s) - t0 )) s, processes $procs" >> $OUT/pytest_cuda_run$run.txt
grep -E '^(FAILED|ERROR)|passed|failed' $OUT/pytest_cuda_run$run.txt | tail -8
# a run the limit stopped is not a passing run, whatever its summary line counts
[[ $rc == 124 ]] && echo "CUT by the ${SUITE_TIMEOUT:-480} s limit: not a complete run ($(grep -oE '[0-9]+ workers \[[0-9]+ items\]' $OUT/pytest_cuda_run$run.txt | head -1))" | tee -a $OUT/pytest_cuda_run$run.txt
ls /dev/shm | grep -c psm_ | sed 's/^/shared memory objects left: /' >> $OUT/pytest_cuda_run$run.txt
kill $smi $apps 2>/dev/null
# nvImageCodec falls back from the hardware JPEG decoder to the CUDA one when it cannot create its state
grep -c 'Could not create nvjpeg decoder' $OUT/pytest_cuda_run$run.txt | sed 's/^/hardware JPEG decoder not created (times, in the output of failed tests): /' | tee -a $OUT/pytest_cuda_run$run.txt
sort -t, -k2 -n -r $OUT/gpu_usage_run$run.csv 2>/dev/null | head -1 | sed 's/^/GPU memory used at most: /' | tee -a $OUT/pytest_cuda_run$run.txt
fi
case $extra in
resize)  # resize windows and pixel parity (the bench's sections), on 4,000 generated JPEGs
  timeout 240 python3 -c "import sys; from fastai_dali.bench import cli; sys.exit(cli())" bench --n 4000 --device cuda \
    --sections resize,parity --archs '' --repeats 2 --out $OUT/resize > $OUT/resize.txt 2>&1; echo "rc $?" >> $OUT/resize.txt
  tail -30 $OUT/resize.txt ;;
loaders)  # the loader rows (throughput, augmentations, RandomResizedCrop's window decode, hw_decoder_load), 5 rounds
  timeout ${BENCH_TIMEOUT:-540} python3 -c "import sys; from fastai_dali.bench import cli; sys.exit(cli())" bench --n 10000 --device cuda \
    --sections throughput,augment --workers 16 --archs '' --repeats 5 --max-batches 50 \
    --out $OUT/loaders > $OUT/loaders.txt 2>&1; echo "rc $?" >> $OUT/loaders.txt
  rm -rf $OUT/loaders/data_*; tail -30 $OUT/loaders.txt ;;
training)  # (ARCHS=resnet18 for one arch) learn.fit: the plain loop's ceilings, fastai's Adam and ForeachAdam, DeviceLossCallback, the bar, augmentation,
  # the fast path with the loader's settings (threads, prefetch), torch.compile and CUDA graphs (CudaGraphCallback), each row one epoch per
  # round (a warm-up epoch, then 2 interleaved rounds), then its timeline (trace)
  timeout ${BENCH_TIMEOUT:-540} python3 -c "import sys; from fastai_dali.bench import cli; sys.exit(cli())" bench --n 10000 --device cuda \
    --sections ${SECTIONS:-training,training-loader,training-compile,trace} --workers 16 --archs ${ARCHS:-resnet18,resnet50} --epochs 3 \
    --repeats 1 --max-batches 50 --out $OUT/training > $OUT/training.txt 2>&1; echo "rc $?" >> $OUT/training.txt
  rm -rf $OUT/training/data_*; tail -40 $OUT/training.txt ;;
losses)  # bf16 first-epoch losses: fastai's Adam three times (its run-to-run noise) against ForeachAdam twice, with CudaGraphCallback twice, and fastai in fp32 once
  timeout ${BENCH_TIMEOUT:-540} python3 scripts/optimizer_losses.py $OUT/losses --device cuda --n 4000 --arch resnet18 --bs 64 \
    --size 128 --epochs 1 --runs 3 --graphs > $OUT/losses.txt 2>&1; echo "rc $?" >> $OUT/losses.txt
  rm -rf $OUT/losses/data_*; tail -12 $OUT/losses.txt ;;
gpus)  # several GPUs (the 2-GPU kind): `fastai-dali bench-gpus`, 1 GPU and every GPU, resnet50, DaliDataLoaders and ImageDataLoaders
  timeout ${BENCH_TIMEOUT:-540} python3 -c "import sys; from fastai_dali.bench import cli; sys.exit(cli())" bench-gpus --n 10000 \
    --arch resnet50 --epochs 2 --out $OUT/gpus > $OUT/gpus.txt 2>&1; echo "rc $?" >> $OUT/gpus.txt
  rm -rf $OUT/gpus/data_* $OUT/gpus/ids; tail -30 $OUT/gpus.txt ;;
commands)  # the console commands as a user runs them (entry points called as setuptools' scripts call them)
  { timeout 240 python3 -c "import sys; from fastai_dali.demo import main; sys.exit(main())" && echo "fastai-dali-demo: ok"; } > $OUT/demo.txt 2>&1
  tail -6 $OUT/demo.txt ;;
esac
