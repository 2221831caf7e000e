"""Whole epochs of `DaliDataLoaders`' train and valid loaders and of a hand-written DALI pipeline doing the same work
(read, decode on the GPU, resize the shorter side to 224, centre crop, normalize), taken in turn an epoch each, in this
process: what a before/after comparison of two trees of the package times, each tree imported through `PYTHONPATH`
(`scripts/gpu_results.sh before-after DIR throughput`). The hand-written pipeline is this file's own, the same code
whichever tree is imported: the run's control.

    python scripts/loader_epochs.py ROOT [EPOCHS] [DEVICE]     ROOT: an ImageNet-style folder (train/, valid/)

Prints one JSON line: each loader's img/s in each timed epoch (after one untimed) and their median.
"""
import json, os, statistics, sys, time

def hand_written(root, bs, device_id, size=224):
    "The control: a `DALIGenericIterator` over ROOT/train, `(x, y)` batches, its epochs in turn (auto reset)"
    from nvidia.dali import pipeline_def, fn, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    @pipeline_def
    def pipe():
        jpegs,y = fn.readers.file(file_root=os.path.join(root, 'train'), random_shuffle=True, name='Reader')
        img = fn.decoders.image(jpegs, device='mixed' if device_id is not None else 'cpu', output_type=types.RGB)
        img = fn.resize(img, resize_shorter=size, antialias=True)
        img = fn.crop_mirror_normalize(img, crop=(size, size), dtype=types.FLOAT, output_layout='CHW',
                                       mean=[0.485*255, 0.456*255, 0.406*255], std=[0.229*255, 0.224*255, 0.225*255])
        return img,(y.gpu() if device_id is not None else y)
    p = pipe(batch_size=bs, num_threads=os.cpu_count(), device_id=device_id, seed=0)
    p.build()
    return DALIGenericIterator(p, ['x', 'y'], reader_name='Reader', last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

def main(root, epochs=6, device=None, bs=128):
    import torch
    from fastai.vision.all import Resize, Normalize, imagenet_stats
    import fastai_dali
    from fastai_dali.data import DaliDataLoaders
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
    dls = DaliDataLoaders.from_folder(root, train='train', valid='valid', item_tfms=Resize(224),
                                      batch_tfms=Normalize.from_stats(*imagenet_stats), bs=bs, device=device)
    loaders = {'hand-written DALI (train folder)': hand_written(root, bs, 0 if device == 'cuda' else None),
               'DaliDataLoaders train': dls.train, 'DaliDataLoaders valid': dls.valid}
    ips = {k: [] for k in loaders}
    for e in range(epochs + 1):   # (an epoch of each in turn: a drift of the machine falls on all of them)
        for k,dl in loaders.items():
            n = 0; sync(); t = time.perf_counter()
            for b in dl: n += len(b[0]['x'] if isinstance(b, list) else b[0])
            sync(); dt = time.perf_counter() - t
            if e: ips[k].append(round(n/dt, 1))
    res = dict(package=os.path.dirname(fastai_dali.__file__), device=torch.cuda.get_device_name() if device == 'cuda' else 'cpu',
               bs=bs, epochs_ips=ips, median_ips={k: statistics.median(v) for k,v in ips.items()})
    print(json.dumps(res), flush=True)
    return res

if __name__ == '__main__':
    a = sys.argv[1:]
    if not a: sys.exit(__doc__)
    main(a[0], int(a[1]) if len(a) > 1 else 6, a[2] if len(a) > 2 else None)
