"""Issue 5's misses, profiled on one machine in one run (data: a folder made by `fastai-dali bench`).

    python scripts/profile_issue5.py --data /tmp/bench/data_10000 --out $OUT

1. mixed path: ours (get_x -> bytes through DALI's parallel external_source) with 4/8/16 worker processes, vs a
   hand-written DALI pipeline with the same parallel per-sample external_source, vs the reader;
2. training loop: fastai `Learner.fit` vs a plain torch loop (same model, bf16 autocast, channels_last, SGD),
   on synthetic batches already on the GPU and on DaliDataLoaders;
3. `hw_decoder_load` for DaliDataLoaders train: DALI's default vs 0.9 vs 1.0, 5 repeats each;
4. device memory over 20 epochs of DaliDataLoaders train.
"""
import argparse, gc, json, os, time
from pathlib import Path
import numpy as np, torch
from fastai.vision.all import (Resize, Normalize, imagenet_stats, parent_label, DataBlock, ImageBlock, CategoryBlock,
                               GrandparentSplitter, get_image_files, resnet18, DataLoaders)
from fastai.vision.learner import create_vision_model
from nvidia.dali import pipeline_def, fn, types
from nvidia.dali.pipeline import Pipeline
from nvidia.dali.plugin.pytorch import DALIGenericIterator
from fastai_dali.all import DaliDataLoaders, default_num_threads, dali_device_id
from fastai_dali.bench import (bench_loaders, results_markdown, SyntheticDL, fit_throughput, memory_over_epochs, Epochs,
                               raw_dali_loader, _sync)

def read_bytes(f): return Path(f).read_bytes()

class FileSource:
    "Per-sample parallel external_source callback: (encoded bytes, label) of sample `si.idx_in_epoch` of a permutation"
    def __init__(self, files, labels, bs): self.files,self.labels,self.bs = files,labels,bs
    def __call__(self, si):
        n = len(self.files)//self.bs*self.bs
        if si.idx_in_epoch >= n: raise StopIteration
        i = (si.idx_in_epoch*7919) % len(self.files)  # 7919 is prime: a fixed permutation of the files
        return np.frombuffer(Path(self.files[i]).read_bytes(), dtype=np.uint8), np.array(self.labels[i], dtype=np.int64)

@pipeline_def
def es_pipeline(src, size=224):
    jpegs,y = fn.external_source(src, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT64])
    gpu = Pipeline.current().device_id is not None
    img = fn.decoders.image(jpegs, device='mixed' if gpu else 'cpu', output_type=types.RGB)
    img = fn.resize(img, resize_shorter=size, antialias=True)
    img = fn.crop_mirror_normalize(img, crop=(size,size), dtype=types.FLOAT, output_layout='CHW',
                                   mean=[0.485*255,0.456*255,0.406*255], std=[0.229*255,0.224*255,0.225*255])
    return img, (y.gpu() if gpu else y)

def es_loader(files, labels, bs, workers, device_id=0):
    import cloudpickle
    pipe = es_pipeline(FileSource(files, labels, bs), batch_size=bs, num_threads=default_num_threads(), device_id=device_id,
                       py_num_workers=workers, py_start_method=os.environ.get("START", "spawn"), py_callback_pickler=cloudpickle)
    pipe.build()
    return Epochs(DALIGenericIterator(pipe, ['x','y'], auto_reset=True), lambda d: (d[0]['x'], d[0]['y']))

def torch_loop(dl, arch, n_out, epochs=2):
    "Plain PyTorch training img/s (last epoch): bf16 autocast, channels_last, SGD, no callbacks"
    m = create_vision_model(arch, n_out, pretrained=False).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9); lf = torch.nn.CrossEntropyLoss()
    for e in range(epochs):
        _sync(); t0,n = time.perf_counter(),0
        for x,y in dl:
            x = x.as_subclass(torch.Tensor).contiguous(memory_format=torch.channels_last)
            with torch.autocast('cuda', dtype=torch.bfloat16): loss = lf(m(x), y.as_subclass(torch.Tensor).long())
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step(); n += len(x)
        _sync(); ips = n/(time.perf_counter()-t0)
    return ips

def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--data', default='/tmp/bench/data_10000')
    ap.add_argument('--out', default=os.environ.get('OUT', '/tmp/out')); ap.add_argument('--bs', type=int, default=128)
    ap.add_argument('--sections', default='fit,hw,memory,mixed'); ap.add_argument('--workers', default='16,8'); ap.add_argument('--device', default='cuda')
    a = ap.parse_args(); a.sections = a.sections.split(','); a.workers = [int(o) for o in a.workers.split(',')]; out = Path(a.out); out.mkdir(parents=True, exist_ok=True); res,md = {},[]
    norm = Normalize.from_stats(*imagenet_stats)
    dls = DaliDataLoaders.from_folder(a.data, item_tfms=Resize(224), batch_tfms=norm, bs=a.bs, device=a.device)
    files = list(dls.train.items); labels = [dls.vocab.o2i[parent_label(o)] for o in files]
    def save(md_lines):
        md.extend(md_lines + ['']); print('\n'.join(md_lines), flush=True)
        (out/'profile_issue5.json').write_text(json.dumps(res, indent=2)); (out/'profile_issue5.md').write_text('\n'.join(md)+'\n')
    if 'fit' in a.sections:  # 2. training loop
        sdl = SyntheticDL(bs=a.bs, size=224, n_batches=len(dls.train), c=dls.c, device=a.device)
        r = res['fit_resnet18'] = {}
        r['fastai Learner.fit, synthetic batches'] = fit_throughput(DataLoaders(sdl, sdl), resnet18, dls.c)
        r['plain torch loop, synthetic batches'] = torch_loop(sdl, resnet18, dls.c)
        r['fastai Learner.fit, DaliDataLoaders'] = fit_throughput(dls, resnet18, dls.c)
        r['plain torch loop, DaliDataLoaders'] = torch_loop(dls.train, resnet18, dls.c)
        save([f'### resnet18 training img/s (bs {a.bs}, bf16, channels_last)', '', '| loop | img/s |', '|---|---:|'] +
             [f'| {k} | {v:,.0f} |' for k,v in r.items()])
    if 'hw' in a.sections:  # 3. hw_decoder_load
        H = {f'DaliDataLoaders train, hw_decoder_load={h}': (lambda d: lambda: d.train)(
                 DaliDataLoaders.from_folder(a.data, item_tfms=Resize(224), batch_tfms=norm, bs=a.bs, device=a.device, hw_decoder_load=h))
             for h in (None, 0.9, 1.0)}
        res['hw_decoder_load'] = bench_loaders(H, repeats=5, show_progress=False)
        save([results_markdown(res['hw_decoder_load'], 'hw_decoder_load (whole epochs, median of 5)')])
    if 'memory' in a.sections:  # 4. memory
        res['memory_20_epochs_mb'] = memory_over_epochs(dls.train, 20)
        save(['Device memory after each of 20 epochs (MiB): ' + ', '.join(f'{o:,.0f}' for o in res['memory_20_epochs_mb'])])
    if 'mixed' in a.sections:  # 1. mixed path, whole epochs (an abandoned epoch rebuilds the pipeline: a new pool)
        # one worker pool alive at a time: each spawns `w` processes that import torch and fastai
        L = {'raw DALI reader (hand-written)': raw_dali_loader(files, labels, bs=a.bs, device=a.device, shuffle=True),
             'DaliDataLoaders train (reader)': dls.train}
        res['mixed'] = bench_loaders({k:(lambda d: lambda: d)(v) for k,v in L.items()}, repeats=3, show_progress=False)
        save([results_markdown(res['mixed'], 'Mixed path (external_source) vs reader, whole epochs')])
        blk = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=read_bytes, get_y=parent_label,
                        splitter=GrandparentSplitter(), item_tfms=Resize(224), batch_tfms=norm)
        for w in a.workers:
            for name,make in ((f'hand-written DALI, parallel per-sample external_source ({w} workers)', lambda: es_loader(files, labels, a.bs, w, device_id=dali_device_id(a.device))),
                              (f'DaliDataLoaders train, get_x -> bytes ({w} workers)', lambda: blk.dali_dataloaders(a.data, bs=a.bs, device=a.device, py_workers=w).train)):
                t0 = time.perf_counter(); dl = make(); first = next(iter(dl)); del first
                res.setdefault('startup_s', {})[name] = time.perf_counter()-t0
                r = bench_loaders({name: lambda: dl}, repeats=3, show_progress=False)[name]
                r['ratio'] = r['img_s']/res['mixed']['raw DALI reader (hand-written)']['img_s']
                res['mixed'][name] = r; del dl; gc.collect()
                save([results_markdown(res['mixed'], 'Mixed path (external_source) vs reader, whole epochs'),
                      f'startup (build + first batch): {res["startup_s"][name]:.1f} s'])

if __name__ == '__main__': main()
