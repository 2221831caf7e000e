"""Whole training epochs of one loader of the bench's `targets` section, augmented (`RandomResizedCrop` +
`aug_transforms()`): labels only, points or boxes; prints READY after two epochs of warm-up, then each timed epoch's
img/s. Made to be sampled by py-spy, each row in a process of its own, and summed by `scripts/py_spy_summary.py`:

    py-spy record --threads --nonblocking --rate 200 --format raw -o spy_points.txt -- \\
        python scripts/targets_epochs.py FOLDER points 20      # FOLDER: train/ and valid/ class folders (the bench's data_N)
    python scripts/py_spy_summary.py spy_labels.txt spy_points.txt spy_boxes.txt
"""
import sys, time, warnings
import torch
from fastai.vision.all import RandomResizedCrop, aug_transforms, Normalize, imagenet_stats
from fastai_dali.bench import target_blocks, ROW_LABELS, ROW_POINTS, ROW_BOXES

def main(root, row, epochs):
    warnings.simplefilter('ignore')
    gpu = torch.cuda.is_available()
    blocks = target_blocks(RandomResizedCrop(224 if gpu else 64, min_scale=0.35), [*aug_transforms(), Normalize.from_stats(*imagenet_stats)])
    db = blocks[{'labels': ROW_LABELS, 'points': ROW_POINTS, 'boxes': ROW_BOXES}[row]]
    dl = db.dali_dataloaders(root, bs=128 if gpu else 32, device='cuda' if gpu else 'cpu').train
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for _ in range(2):
        for _ in dl: pass
    sync(); print('READY', flush=True)
    res = []
    for _ in range(epochs):
        t,n = time.perf_counter(),0
        for x in dl: n += len(x[0])   # (the timed loop: the summary counts the main thread's samples under this line)
        sync(); res.append(n/(time.perf_counter()-t))
    print(row, 'img/s per epoch', [round(r) for r in res], 'median', round(sorted(res)[len(res)//2]), flush=True)

if __name__ == '__main__': main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
