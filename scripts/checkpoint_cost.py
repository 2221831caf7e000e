"""What `dl.checkpoint()` costs a call and where it goes, on DALI's CPU backend, in one process: the loader's fingerprint
computed at every call (as before 2026-12-07) against once per built pipeline (now), DALI's own `checkpoints()`, the
transforms' reprs.
    python scripts/checkpoint_cost.py OUT_DIR [N]     (N training JPEGs of 64 x 48 px in 100 classes, `make_scale_folder`; 20,000)"""
import os, sys, time, statistics, platform
import fastai, nvidia.dali, torch
from fastai.vision.all import Resize, Normalize, imagenet_stats
from fastai_dali.all import DaliDataLoaders
from fastai_dali.resume import loader_fingerprint, LoaderCheckpoint
from fastai_dali.bench.scale import make_scale_folder

n = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
root = make_scale_folder(os.path.join(sys.argv[1], f'scale_{n}'), n=n, classes=100)

dls = DaliDataLoaders.from_folder(root, train='train', valid='valid', item_tfms=Resize(32), batch_tfms=Normalize.from_stats(*imagenet_stats),
                                  bs=256, device='cpu', checkpointing=True)
dl = dls.train; it = iter(dl)
for _ in range(10): next(it)
def med(f, k=41):
    ts = []
    for _ in range(k): t = time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return f'first {ts[0]*1e3:.3f} ms, median of the {k-1} after {statistics.median(ts[1:])*1e3:.3f} ms'
print(f'python {platform.python_version()}, fastai {fastai.__version__}, dali {nvidia.dali.__version__}, torch {torch.__version__}, {os.cpu_count()} cores; '
      f'{len(dl.dataset)} files, bs 256, Resize(32) + Normalize, after 10 batches')
print('before (the fingerprint at every call):', med(lambda: LoaderCheckpoint(loader_fingerprint(dl), dl.seed, dl.feed.checkpoint())))
print('now (dl.checkpoint(): the fingerprint once per pipeline):', med(dl.checkpoint))
print('  DALI checkpoints():', med(dl.feed.built.it.checkpoints))
print('  loader_fingerprint:', med(lambda: loader_fingerprint(dl)))
print('    reprs of the batch transforms:', med(lambda: [repr(t) for t in dl.after_batch.fs]))
print('    of which Normalize:', med(lambda: repr(dl.after_batch.fs[-1])))
