"""Where points cost a loader its time with `RandomResizedCrop` + `aug_transforms()` on a GPU: variants of the points
pipeline against labels only and a control (labels only, a second loader), in paired rounds (every row one whole epoch a
round, each round starting one row further on; a row's ratio is the median of its rounds' ratios to labels only).

DALI's side alone (`Feed.epoch`: the pipeline's batches, no fastai batch) for:
  labels only; the control; points; points with every output on the GPU (the item indices and the maps' values copied
  there in DALI); points with the maps' values not among the outputs (item indices on the CPU); the same with the item
  indices on the GPU (the labels' outputs, the points' graph);
then the whole loaders for: labels only; the control; points; points whose targets' host work is skipped (the loader
hands a cached device tensor instead of moving the points: `TargetPlan.batch` replaced).

    python scripts/targets_variants.py FOLDER [ROUNDS]   # FOLDER: train/ and valid/ class folders (the bench's data_N)
"""
import sys, time, warnings, statistics
import torch
from pathlib import Path
from fastai.vision.all import Normalize, imagenet_stats, RandomResizedCrop, aug_transforms
from fastai_dali.bench import target_blocks
from fastai_dali.targets import TargetPlan
import fastai_dali.data  # (DataBlock.dali_dataloaders)
import fastai_dali.pipeline as pl

dev = 'cuda' if torch.cuda.is_available() else 'cpu'  # (the CPU: only to try the script; the GPU variants are skipped)
def sync():
    if dev == 'cuda': torch.cuda.synchronize()

def img_s(it):
    "Items a second over one pass of `it` (fastai's batches, or DALI's (outputs, k))"
    sync(); t,n = time.perf_counter(),0
    for o in it: n += o[1] if isinstance(o[1], int) else len(o[0])
    sync()
    return n/(time.perf_counter() - t)

def dali_side(dl): return img_s(dl.feed.epoch(dl.feed.ready(dl.spec(), dl.get_idxs)))

_outputs = pl.pipeline_outputs
def all_gpu(img, y, masks, g): return {k: (v.gpu() if v.device == 'cpu' else v) for k,v in _outputs(img, y, masks, g).items()}
def no_maps(img, y, masks, g): return dict(x=img, y=y)
def no_maps_y_gpu(img, y, masks, g): return dict(x=img, y=y.gpu())

def build(db, root, outputs=None):
    "The train loader of `db` on `root`, its pipeline's outputs by `outputs` (`pipeline_outputs`' signature), built now"
    if outputs is not None: pl.pipeline_outputs = outputs
    try:
        dl = db.dali_dataloaders(root, bs=128, device=dev).train
        for _ in dl.feed.epoch(dl.feed.ready(dl.spec(), dl.get_idxs)): pass
    finally: pl.pipeline_outputs = _outputs
    return dl

class NoHostWork:
    "Loader `dl` iterated with the targets' host work skipped: a cached device tensor for the points"
    def __init__(self, dl): self.dl,self.z = dl,None
    def __iter__(self):
        orig = TargetPlan.batch
        def fake(tp, targets, idx, d, mask=None, maps=None, device=None):
            if self.z is None: self.z = torch.zeros(len(idx), 5, 2, device=device)
            return (self.z[:len(idx)],)
        TargetPlan.batch = fake
        try: yield from self.dl
        finally: TargetPlan.batch = orig

def rounds(rows, f, R):
    "`f(row)` of every row, in `R` rounds, each starting one row further on: {name: [values]}"
    ks = list(rows); res = {k: [] for k in ks}
    for r in range(R):
        for i in range(len(ks)):
            k = ks[(r+i) % len(ks)]; res[k].append(f(rows[k]))
    return res

def show(title, res):
    print(title)
    for k,v in res.items():
        rat = [a/b for a,b in zip(v, res['labels only'])]
        print(f"  {k:58s} median {statistics.median(v):8,.0f} img/s  ratio {statistics.median(rat):.3f}  rounds {[round(x, 2) for x in rat]}", flush=True)

def main(root, R=10):
    warnings.simplefilter('ignore')
    blocks = target_blocks(RandomResizedCrop(224, min_scale=0.35), [*aug_transforms(), Normalize.from_stats(*imagenet_stats)])
    L,P,_ = list(blocks)
    gpu = dev == 'cuda'
    rows = {'labels only': build(blocks[L], root), 'the control (labels only, a second loader)': build(blocks[L], root),
            'points': build(blocks[P], root)}
    if gpu: rows['points, every output on the GPU'] = build(blocks[P], root, all_gpu)
    rows['points, maps not output (item indices on the CPU)'] = build(blocks[P], root, no_maps)
    if gpu: rows['points, maps not output, item indices on the GPU'] = build(blocks[P], root, no_maps_y_gpu)
    show(f"DALI's side alone (Feed.epoch), RandomResizedCrop + aug_transforms(), bs 128, whole epochs, {R} rounds", rounds(rows, dali_side, R))
    lo = {k: rows[k] for k in ('labels only', 'the control (labels only, a second loader)', 'points')}
    lo["points, the targets' host work skipped"] = NoHostWork(rows['points'])
    show(f"the loaders (fastai's batches), {R} rounds", rounds(lo, img_s, R))

if __name__ == '__main__': main(Path(sys.argv[1]), *map(int, sys.argv[2:]))
