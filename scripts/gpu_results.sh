#!/bin/bash
# The GPU runs behind docs/results' training, scale and before/after figures, each sized for one call of the GPU machine
# (10 minutes), once DALI, fastai and webdataset are installed into /tmp/site (../shared/gpu/README.md stages them; the
# package itself is imported from this source tree). Every result goes to $OUT as it is produced.
#
#   OUT=DIR bash scripts/gpu_results.sh user-fit ARCH      `fastai-dali bench --sections user-fit` (the user's script, its
#                                                          augmented and defaults rows, the limit) on scripts/user_fit.py's
#                                                          folder: 20,000 JPEGs of 300-500 x 240-400 px, 500 for validation
#   OUT=DIR bash scripts/gpu_results.sh user-fit-rows      scripts/user_fit.py's rows user, user_warm (torch's compile caches
#                                                          warm, a new process), one_graph_opt, one_graph_opt_warm,
#                                                          no_compile_opt: a process each
#   OUT=DIR bash scripts/gpu_results.sh user-fit-bar       its rows defaults, defaults_no_bar, a process each, in ABBA order
#                                                          four times a side (their epochs vary by up to 11% within a row,
#                                                          H100 2026-12-07: one row a side cannot resolve a 2% cost); prints
#                                                          each side's median of its epochs after the first
#   OUT=DIR bash scripts/gpu_results.sh warm-compile       scripts/warm_compile.py (the compiles' parts, cold and warm; with
#                                                          the 8 rows above it outlasted a 300-s call, 2026-12-07)
#   OUT=DIR bash scripts/gpu_results.sh before-after DIR PART
#                                                          the package in DIR (an earlier tree: `git archive COMMIT
#                                                          fastai_dali | tar -x -C DIR`) against this tree, each run a new
#                                                          process on the same generated JPEGs, in ABBA order (a drift of
#                                                          the machine falls on both); PART `throughput`:
#                                                          scripts/loader_epochs.py (whole epochs of the train and valid
#                                                          loaders and of a hand-written pipeline, the control), 30,000
#                                                          JPEGs, 8 runs (the bench's 0.3-s passes varied by +-20% from
#                                                          run to run on the H100, 2026-12-07); `training`: the bench's
#                                                          training section without its user-fit rows (either tree),
#                                                          resnet18, 3 epochs, 4 runs
#   OUT=DIR bash scripts/gpu_results.sh shards-epochs      from_shards at 1,280,000 + 49,000 JPEGs (64 x 48, 266 tars):
#                                                          two whole epochs with each batch's wait, DALI's Python workers
#                                                          8 (the default) and 16
#   OUT=DIR bash scripts/gpu_results.sh shards-trace       the same (DALI's default workers) in one process under py-spy:
#                                                          where the main thread spends its time
#   OUT=DIR bash scripts/gpu_results.sh suite              the GPU test suite (scripts/gpu_suite.sh, 6 processes)
#   OUT=DIR bash scripts/gpu_results.sh extras             installs the wheels carried in .gpu/extra into /tmp/site: py-spy
#                                                          (shards-trace) and moto's S3 server with its own (the suite's
#                                                          object-storage tests), fetched here for the GPU machine's Python:
#     pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 "moto[server]" py-spy -d .gpu/extra
#     (35 MB once the packages the GPU image already has, or that moto's server does not need, are left out: keep moto, boto3,
#     botocore, s3transfer, jmespath, werkzeug, flask, flask_cors, xmltodict, responses, requests, urllib3, itsdangerous,
#     blinker, click, python_dateutil, six, cryptography, cffi, pycparser, pyyaml, charset_normalizer, idna, certifi,
#     py_partiql_parser, py_spy)
SITE=${SITE:-/tmp/site}   # where DALI, fastai and the rest are installed (`pip install --target`): PYTHONPATH
set -u
test -d $SITE || { echo "$SITE is missing: stage the wheels first (../shared/gpu/README.md)"; exit 3; }
: "${OUT:?OUT=DIR: where the results go}"
mkdir -p "$OUT"
export PYTHONPATH=$SITE:$PWD MPLBACKEND=Agg PYTHONUNBUFFERED=1
TMP=${TMPDIR:-/tmp} DEVICE=${DEVICE:-cuda} N=${N:-10000}   # (DEVICE=cpu N=300 BA_N=300 BA_EPOCHS=2 BA_ARGS='--max-batches 2 --archs ""' SCALE_N=3000: a dry run on a CPU machine)
uf_data() { python3 -c "import sys; sys.path.insert(0, 'scripts'); from user_fit import make_data; make_data('$TMP/uf')"; }   # (written once)
bench() { python3 -c 'import sys; from fastai_dali.bench import cli; cli(sys.argv[1:])' bench "$@"; }
bench_no_user_fit() { python3 -c 'import sys, fastai_dali.bench; c = sys.modules["fastai_dali.bench.cli"]; c.user_fit_section = lambda *a, **k: None; c.cli(sys.argv[1:])' bench "$@"; }
env_txt() { { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c "import nvidia.dali, fastai, torch, sys; print('dali', nvidia.dali.__version__, 'fastai', fastai.__version__, 'torch', torch.__version__, 'python', sys.version.split()[0])"
  git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1; }
env_txt
case ${1:-} in
  user-fit)
    arch=${2:?user-fit ARCH}
    uf_data
    bench "$TMP/uf" --device $DEVICE --sections user-fit --workers 16 --archs "$arch" --epochs 4 --repeats 1 --out "$OUT/user_fit_$arch" \
      2>&1 | tee "$OUT/user_fit_$arch.txt" | grep -v '^\s*$' | tail -40 ;;
  user-fit-rows)
    uf_data
    python3 scripts/user_fit.py "$OUT" "$TMP/uf" resnet18 4 user,user_warm,one_graph_opt,one_graph_opt_warm,no_compile_opt 2>&1 | tee "$OUT/user_fit_rows.txt" | cut -c1-600 ;;
  user-fit-bar)
    uf_data
    abba=defaults,defaults_no_bar,defaults_no_bar,defaults
    python3 scripts/user_fit.py "$OUT" "$TMP/uf" resnet18 4 $abba,$abba 2>&1 | tee "$OUT/user_fit_rows.txt" | cut -c1-600
    python3 -c "import json, statistics, sys; rows = json.load(open(sys.argv[1]))
for side in ('defaults', 'defaults_no_bar'):
    e = [x for r in rows if r['row'] == side for x in r['epochs_ips'][1:]]
    print(side, 'median of', len(e), 'epochs:', round(statistics.median(e)), 'each process:', [round(r['median_ips']) for r in rows if r['row'] == side])" \
      "$OUT/user_fit_resnet18.json" | tee "$OUT/user_fit_bar_summary.txt" ;;
  warm-compile)
    python3 scripts/warm_compile.py "$OUT" "$DEVICE" resnet18 2>&1 | tee "$OUT/warm_compile.txt" | cut -c1-400 ;;
  before-after)
    before=$(cd "${2:?before-after DIR PART}" && pwd); part=${3:?before-after DIR PART: throughput or training}
    n=$N; [[ $part == throughput ]] && n=${BA_N:-30000}
    python3 -c "from pathlib import Path; from fastai_dali.bench.core import make_bench_dataset; make_bench_dataset(Path('$TMP/bench_data_$n'), $n)"
    sides="before after after before"; [[ $part == throughput ]] && sides="$sides $sides"
    k=0
    for side in $sides; do
      k=$((k+1)); dir=$PWD; [[ $side == before ]] && dir=$before
      if [[ $part == throughput ]]; then   # (the script from this tree, the package from $dir)
        PYTHONPATH=$SITE:$dir python3 scripts/loader_epochs.py "$TMP/bench_data_$n" ${BA_EPOCHS:-6} $DEVICE > "$TMP/ba_run.txt" 2>&1
        echo "$k $side: rc $?"
        grep '^{' "$TMP/ba_run.txt" | python3 -c "import json, sys; o = json.loads(sys.stdin.read()); o.update(run=$k, side='$side'); print(json.dumps(o))" \
          | tee -a "$OUT/throughput.jsonl" | cut -c1-300
        tail -c 3000 "$TMP/ba_run.txt" > "$OUT/throughput_last_run.txt"
      else
        # (at most 8 files come back from the GPU machine: the bench's json of each run as a line of one file)
        # (like for like: the user-fit rows, which this tree's training section adds, left out on both sides)
        (cd "$dir" && PYTHONPATH=$SITE:$dir bench_no_user_fit "$TMP/bench_data_$n" --device $DEVICE --workers 16 --sections training \
          --archs resnet18 --epochs 3 --repeats 1 ${BA_ARGS:-} --out "$TMP/before_after/training_${k}_$side") > "$OUT/training_${k}_$side.txt" 2>&1
        echo "$k $side: rc $?"
        python3 -c "import json, sys; print(json.dumps(dict(run=$k, side='$side', bench=json.load(open(sys.argv[1])))))" \
          "$TMP/before_after/training_${k}_$side/bench.json" >> "$OUT/training.jsonl"
        grep -E '^\| (raw|DaliDataLoaders|learn.fit)' "$OUT/training_${k}_$side.txt" | head -12
      fi
    done ;;
  shards-epochs|shards-trace)
    n=${SCALE_N:-1280000}
    # (a script file, its work under `if __name__ == '__main__':`: `write_shards`' worker processes start by importing it)
    cat > "$TMP/shards_epochs_run.py" <<'EOF'
import json, sys, time
from fastai_dali.bench.scale import make_scale_folder, scale_rows, scale_one
if __name__ == '__main__':
    mode, root, out, device, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    t = time.perf_counter(); make_scale_folder(root, n, min(1000, n//50)); print(f'folder: {time.perf_counter()-t:.1f} s', flush=True)
    kw = dict(device=device, workers=16, bs=256, epochs=2, series=True)
    log = lambda s: print(s[:400], flush=True)
    if mode == 'rows':   # a process per row, DALI's Python workers 8 (the default) and 16
        for w in (8, 16):
            rows = scale_rows(root, ('from_shards (indexed)',), shards=min(5000, n//10), dali_kw=dict(py_workers=w), log=log, **kw)
            with open(f'{out}/shards_epochs_py_workers_{w}.json', 'w') as f: json.dump(rows, f)
    else:                # the row in this process (the shards and their indexes written by a `rows` run or here), for py-spy
        scale_rows(root, ('from_shards (indexed)',), shards=min(5000, n//10), log=log, **{**kw, 'epochs': 0})
        o = scale_one('from_shards (indexed)', root, **kw); log(json.dumps(o))
        with open(f'{out}/shards_trace_row.json', 'w') as f: json.dump(o, f)
EOF
    args=("$TMP/fastai_dali_scale_$n" "$OUT" "$DEVICE" "$n")
    if [[ $1 == shards-epochs ]]; then python3 "$TMP/shards_epochs_run.py" rows "${args[@]}"
    else
      # py-spy (on the PATH, or installed by `extras`): every thread, idle samples kept (the main thread waiting on DALI shows
      # as such), DALI's worker processes too
      export PATH=$PATH:$SITE/bin
      command -v py-spy >/dev/null || { echo "py-spy is missing: run \`gpu_results.sh extras\` first"; exit 3; }
      py-spy record --idle --threads --subprocesses --nonblocking --rate 200 --format raw -o "$TMP/shards_trace_spy.txt" -- \
        python3 "$TMP/shards_epochs_run.py" trace "${args[@]}" 2>&1 | grep -v '^py-spy> You can'
      python3 -c "import sys; sys.path.insert(0, 'scripts'); from py_spy_summary import main_thread_steps; main_thread_steps(sys.argv[1], '_rest_of_epochs')" \
        "$TMP/shards_trace_spy.txt" | cut -c1-400 | tee "$OUT/shards_trace_summary.txt"
      gzip -c "$TMP/shards_trace_spy.txt" > "$OUT/shards_trace_spy.txt.gz"   # (the raw record, where it is small enough to come back)
      [[ $(stat -c %s "$OUT/shards_trace_spy.txt.gz") -gt 40000000 ]] && rm "$OUT/shards_trace_spy.txt.gz"
    fi ;;
  extras)
    python3 -m pip install -q --no-index --no-deps --target $SITE .gpu/extra/*.whl && ls $SITE/bin ;;
  suite)
    # (tests handed out one at a time: with a file per process, tests/test_resume.py's 8 kill-and-resume tests alone
    # outlasted a 320-s call on one process, 2026-12-07)
    SUITE_TIMEOUT=${SUITE_TIMEOUT:-540} DIST=${DIST:-worksteal} OUT=$OUT bash scripts/gpu_suite.sh "${2:-35}" none 6 ;;
  *) sed -n '2,35p' "$0"; exit 2 ;;
esac
