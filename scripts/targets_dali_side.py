"""Where points and boxes cost a loader its time: DALI's side alone (the pipeline's batches, `Feed.epoch`) against the
whole loader (fastai's batches, the targets moved on the device), one epoch each after a warm-up one, for the `targets`
bench's `DataBlock`s (`fastai_dali.bench.target_blocks`) on a GPU.

    python scripts/targets_dali_side.py FOLDER     # FOLDER: train/ and valid/ class folders of JPEGs (the bench's data_N)
"""
import sys, time, warnings
import torch
from pathlib import Path
from fastai.vision.all import Resize, Normalize, imagenet_stats, RandomResizedCrop, aug_transforms
from fastai_dali.bench import target_blocks
import fastai_dali.data  # (DataBlock.dali_dataloaders)

def img_s(it):
    "Items a second over one pass of `it` (batches whose first element is a batch of items, or DALI's (outputs, k))"
    torch.cuda.synchronize(); t,n = time.perf_counter(),0
    for o in it: n += o[1] if isinstance(o[1], int) else len(o[0])
    torch.cuda.synchronize()
    return round(n/(time.perf_counter() - t))

def main(root):
    warnings.simplefilter('ignore')
    norm = Normalize.from_stats(*imagenet_stats)
    pipelines = {'Resize': (Resize(224), [norm]), 'RandomResizedCrop': (RandomResizedCrop(224, min_scale=0.35), [norm]),
                 'RandomResizedCrop + aug_transforms()': (RandomResizedCrop(224, min_scale=0.35), [*aug_transforms(), norm])}
    for p,(it,bt) in pipelines.items():
        for name,db in target_blocks(it, bt).items():
            dl = db.dali_dataloaders(root, bs=128, device='cuda').train
            for _ in dl: pass
            dali = img_s(dl.feed.epoch(dl.feed.ready(dl.spec(), dl.get_idxs)))
            print(f"{p}, {name}: DALI's side {dali}, the loader {img_s(dl)} img/s", flush=True)

if __name__ == '__main__': main(Path(sys.argv[1]))
