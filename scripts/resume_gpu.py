"""On the GPU: tests/resume_script.py with DEVICE=cuda, uninterrupted (twice) against killed at (1,3) and run again:
the batches after the checkpoint and the final weights (within the two uninterrupted runs' spread).
    python3 scripts/resume_gpu.py OUT folder[,mixed,shards] [WORK]
WORK (default: the temporary folder's `fastai_dali_resume_gpu`) holds the data and the runs; OUT gets resume_cuda.json."""
import json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path
import torch
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from fastai_dali.samples import make_image_folder
from fastai_dali.shards import write_shards
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
work = Path(sys.argv[3] if len(sys.argv) > 3 else Path(tempfile.gettempdir())/'fastai_dali_resume_gpu')
root = make_image_folder(work/'data', n_train=10, n_valid=3, min_size=40, max_size=70, seed=2)
if not (root/'shards').exists(): write_shards(root, root/'shards', per_shard=12, progress=False)
def run(o, source, kill=None, **env):
    t = time.perf_counter()
    r = subprocess.run([sys.executable, str(REPO/'tests'/'resume_script.py'), str(root), str(o), source] + ([kill] if kill else []), capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'DEVICE': os.environ.get('DEVICE', 'cuda'), 'PYTHONPATH': os.pathsep.join(filter(None, [str(REPO), os.environ.get('PYTHONPATH')])), **env})
    return r.returncode, time.perf_counter()-t, r.stderr[-1500:]
recs = lambda o: [json.loads(l) for l in (o/'batches.jsonl').read_text().splitlines()]
res = {}
for source in sys.argv[2].split(','):
    base = work/'runs'/source; shutil.rmtree(base, ignore_errors=True)
    ref = run(base/'ref', source); ref2 = run(base/'ref2', source)
    killed = run(base/'run', source, kill='1,3'); n_before = len(recs(base/'run'))
    again = run(base/'run', source)
    for name,v in (('ref', ref), ('ref2', ref2), ('killed', killed), ('again', again)):   # (a run that failed: its error first)
        if v[0] not in (0, -9): print(source, name, 'returncode', v[0], 'stderr:', v[2], flush=True)
    if not all((base/d/'final.pth').exists() for d in ('ref', 'ref2', 'run')):
        print(source, 'no final weights', [d for d in ('ref', 'ref2', 'run') if not (base/d/'final.pth').exists()], [v[0] for v in (ref, ref2, killed, again)]); continue
    a,a2,b = recs(base/'ref'),recs(base/'ref2'),recs(base/'run')[n_before:]
    wa,wa2,wb = (torch.load(base/d/'final.pth') for d in ('ref', 'ref2', 'run'))
    md = lambda x, y: max(float((x[k].float()-y[k].float()).abs().max()) for k in x)
    res[source] = dict(returncodes=[ref[0], ref2[0], killed[0], again[0]], seconds=[round(v[1], 1) for v in (ref, ref2, killed, again)],
        resumed_at=b[0][:2] if b else None, n_resumed=len(b), batches_equal=b == a[len(a)-len(b):], ref_runs_batches_equal=a == a2,
        weights_max_abs_diff_resumed_vs_ref=md(wb, wa), weights_max_abs_diff_ref_vs_ref2=md(wa2, wa),
        weights_bit_equal=all(torch.equal(wa[k], wb[k]) for k in wa))
    print(source, json.dumps(res[source]), flush=True)
(out/'resume_cuda.json').write_text(json.dumps(res, indent=1))
