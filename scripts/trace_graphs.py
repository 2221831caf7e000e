"""Timelines (torch.profiler, `fit_trace`) of 20 training batches of resnet18 on the fast path (`ForeachAdam`,
`DeviceLossCallback`), with and without `CudaGraphCallback`, on `DaliDataLoaders` and on synthetic GPU batches: each
run's summary (img/s under the profiler, GPU busy, DALI's and the model's kernel ms a batch, the main thread's ms per
phase of fastai's loop) to OUT/trace_graphs.json, the graphed runs' chrome traces to OUT (read them with
`scripts/trace_kernel_split.py 20 OUT/*.json.gz`).

    python scripts/trace_graphs.py OUT [ROOT]     (a GPU; ROOT: `make_bench_dataset`'s 10,000 JPEGs)
"""
import json, sys, os, tempfile
from fastai.vision.all import Resize, Normalize, imagenet_stats, models, DataLoaders
from fastai_dali.data import DaliDataLoaders
from fastai_dali.samples import make_bench_dataset
from fastai_dali.bench.training import fit_trace, SyntheticDL
from fastai_dali.training import DeviceLossCallback
from fastai_dali.graphs import CudaGraphCallback
from fastai_dali.optimizer import ForeachAdam

def main(out, root=os.path.join(tempfile.gettempdir(), 'bt/data_10000')):
    make_bench_dataset(root, 10000)
    kw = dict(item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=128, device='cuda')
    dls = DaliDataLoaders.from_folder(root, **kw)
    sdl = SyntheticDL(bs=128, size=224, n_batches=len(dls.train), c=dls.c, device='cuda')
    res = {}
    for name,d in {'DaliDataLoaders': dls, 'model only': DataLoaders(sdl, sdl)}.items():
        for graphs in (True, False):
            k = f"{name}, ForeachAdam, DeviceLossCallback{', CudaGraphCallback' if graphs else ''}"
            fname = f"{out}/trace_resnet18_{k.replace(', ', '_').replace(' ', '_')}.json.gz" if graphs else None
            res[k] = fit_trace(d, models.resnet18, dls.c, start=30, n=20, opt_func=ForeachAdam, fname=fname,
                               cbs=[DeviceLossCallback()] + ([CudaGraphCallback()] if graphs else []))
            print(k, json.dumps(res[k]), flush=True)
    json.dump(res, open(f'{out}/trace_graphs.json', 'w'), indent=1)

if __name__ == '__main__': main(*sys.argv[1:])
