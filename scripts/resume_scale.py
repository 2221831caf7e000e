"""On the GPU, at 1.28M files: a loader's checkpoint (cost per call, size) after 100 batches, and in a new process the
resumed loader's first batch against a fresh one's (both include the pipeline's build), and the batch it gives.
    python3 scripts/resume_scale.py fresh ROOT OUT; python3 scripts/resume_scale.py resume ROOT OUT
ROOT: e.g. `fastai_dali.bench.scale.make_scale_folder('/tmp/scale', n=1_280_000, classes=1000, procs=16)`; DEV=cpu for DALI's CPU backend."""
import json, os, statistics, sys, time
mode, root, out = sys.argv[1:4]
import torch
from fastai.vision.all import Resize, Normalize, imagenet_stats
from fastai_dali.all import DaliDataLoaders
from fastai_dali.resume import save_checkpoint, load_checkpoint
t0 = time.perf_counter()
dls = DaliDataLoaders.from_folder(root, train='train', valid='valid', item_tfms=Resize(32), batch_tfms=Normalize.from_stats(*imagenet_stats),
                                  bs=256, device=os.environ.get('DEV', 'cuda'), checkpointing=True)
dl = dls.train
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
res = dict(mode=mode, n_items=len(dl.dataset), from_folder_s=time.perf_counter()-t0)
fn = os.path.join(out, 'scale_cp.pth')
if mode == 'fresh':
    it = iter(dl)
    t = time.perf_counter(); xb,yb = next(it); sync(); res['first_batch_s'] = time.perf_counter()-t
    for _ in range(99): xb,yb = next(it)
    sync()
    ts = []
    for _ in range(21):
        t = time.perf_counter(); cp = dl.checkpoint(); ts.append(time.perf_counter()-t)
    res.update(checkpoint_first_ms=ts[0]*1e3, checkpoint_ms_median_of_20_after=statistics.median(ts[1:])*1e3)
    t = time.perf_counter(); save_checkpoint(dict(loader=cp), fn); res['save_s'] = time.perf_counter()-t
    res['file_bytes'] = os.path.getsize(fn)
    t = time.perf_counter(); xb,yb = next(it); sync(); res['batch_101_s'] = time.perf_counter()-t
    res['batch_101_labels'] = yb[:12].tolist()
else:
    t = time.perf_counter(); cp = load_checkpoint(fn)['loader']; res['load_s'] = time.perf_counter()-t
    t = time.perf_counter(); dl.resume(cp); it = iter(dl); xb,yb = next(it); sync(); res['first_batch_s'] = time.perf_counter()-t
    res['batch_101_labels'] = yb[:12].tolist()
    res['batches_left_in_epoch'] = 1 + sum(1 for _ in it)
    res['len_train'] = len(dl)
print(json.dumps(res), flush=True)
with open(os.path.join(out, 'resume_scale.jsonl'), 'a') as f: f.write(json.dumps(res) + '\n')
