"""DALI's GPU decoder's pinned host buffers (`host_memory_padding`, a `DaliDL` setting; DALI's default 8 MiB, two a
thread): (1) peak host memory and time to the first batch of `DaliDataLoaders.from_folder` on the million-image folder
(`make_scale_folder`, a new process each: fastai's `ImageDataLoaders`, then DALI's default, 0 and 1 MiB), (2) training
img/s of `DaliDataLoaders` with each (10,000 JPEGs, `Resize(224)`, bs 128, 5 rounds of 50 batches).

    python scripts/host_memory_padding.py OUT [SCALE_ROOT] [ROOT]     (a GPU)
"""
import json, sys, os, tempfile
from fastai_dali.bench.scale import make_scale_folder, scale_rows, scale_markdown
from fastai_dali.bench.core import bench_loaders, results_markdown
from fastai_dali.samples import make_bench_dataset

def main(out, scale_root=os.path.join(tempfile.gettempdir(), 'scale_1280000'), root=os.path.join(tempfile.gettempdir(), 'bt/data_10000')):
    from fastai.vision.all import Resize, Normalize, imagenet_stats
    from fastai_dali.data import DaliDataLoaders
    make_scale_folder(scale_root, 1_280_000, 1000); make_bench_dataset(root, 10000)
    rows = scale_rows(scale_root, ['ImageDataLoaders', 'DaliDataLoaders'], device='cuda', workers=16, bs=256)
    for p in (0, 1 << 20):
        r = scale_rows(scale_root, ['DaliDataLoaders'], device='cuda', workers=16, bs=256, dali_kw=dict(host_memory_padding=p))
        r[0]['kind'] = f'DaliDataLoaders, host_memory_padding={p}'; rows += r
    print(scale_markdown(rows)); json.dump(rows, open(f'{out}/scale_padding.json', 'w'), indent=1)
    kw = dict(item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=128, device='cuda')
    D = {p: DaliDataLoaders.from_folder(root, **kw, **({} if p is None else dict(host_memory_padding=p))) for p in (None, 0, 1 << 20)}
    res = bench_loaders({f'host_memory_padding={p}': (lambda d: lambda: d.train)(d) for p,d in D.items()}, max_batches=50, repeats=5, show_progress=False)
    print(results_markdown(res, 'DaliDataLoaders train, Resize(224), bs 128: host_memory_padding'))
    json.dump(res, open(f'{out}/throughput_padding.json', 'w'), indent=1)

if __name__ == '__main__': main(*sys.argv[1:])
