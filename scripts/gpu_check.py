"""Issue 2's proof on a GPU machine, in one run: parity of the GPU path with ImageDataLoaders, a short training run,
and a first throughput figure (raw DALI vs DaliDataLoaders vs ImageDataLoaders).

    python scripts/gpu_check.py --n 10000 --out $OUT        # on the H200 (see ../shared/gpu/README.md)
    python scripts/gpu_check.py --n 300 --device cpu --workers 2 --out /tmp/out   # the same on a CPU-only machine
"""
import argparse, json, os, sys, time, platform, multiprocessing as mp
from pathlib import Path
import numpy as np, torch
from PIL import Image

def _make(args):
    "Write JPEGs `idxs` of class `c`: random crops of a scikit-image photo resized to 300-640 x 240-500 px"
    root, split, c, idxs, seed = args
    from fastai_dali.demo import sample_photos
    p = sample_photos([c])[c]
    rng = np.random.default_rng(seed)
    (root/split/c).mkdir(parents=True, exist_ok=True)
    for i in idxs:
        H,W = p.shape[:2]
        h,w = int(rng.integers(H//3, H+1)), int(rng.integers(W//3, W+1))
        y,x = int(rng.integers(0, H-h+1)), int(rng.integers(0, W-w+1))
        tw,th = int(rng.integers(300, 641)), int(rng.integers(240, 501))
        Image.fromarray(p[y:y+h, x:x+w]).resize((tw,th), Image.BILINEAR).save(root/split/c/f'{c}_{i:06d}.jpg', quality=90)

def make_dataset(root, n, classes=('astronaut','coffee','chelsea','rocket','immunohistochemistry'), valid_frac=0.2, procs=8):
    root = Path(root)
    if (root/'done').exists(): return root
    per = n//len(classes); nv = int(per*valid_frac)
    jobs = []
    for k,c in enumerate(classes):
        for split,rng_ in (('train', range(per-nv)), ('valid', range(per-nv, per))):
            chunks = np.array_split(np.array(list(rng_)), procs)
            jobs += [(root, split, c, list(ch), 1000*k+j+(0 if split=='train' else 500)) for j,ch in enumerate(chunks) if len(ch)]
    with mp.get_context('fork').Pool(procs) as pool: pool.map(_make, jobs)
    (root/'done').touch()
    return root

def _dali_only(dl):
    "Iterate the DALI iterator behind `dl` without the fastai wrapper (types, device, leftover transforms)"
    it = dl._build()[0]
    def gen():
        for d in it: yield (d[0]['x'], d[0]['y'])
        it.reset()
    dl._in_epoch = True  # the loader must rebuild next time
    return gen()

def read_bytes(f): return Path(f).read_bytes()
def zip_names(p):
    import zipfile
    return sorted(n for n in zipfile.ZipFile(p).namelist() if n.endswith('.jpg'))
def _exact(dl):
    "Iterate `dl` with fastai's exact crop window (the setting is read when the pipeline is built)"
    import fastai_dali.transforms as T
    T.exact_resize_crop = True
    try: yield from dl
    finally: T.exact_resize_crop = False

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--n', type=int, default=10000); ap.add_argument('--device', default='cuda')
    ap.add_argument('--workers', type=int, default=16); ap.add_argument('--bs', type=int, default=128)
    ap.add_argument('--size', type=int, default=224); ap.add_argument('--out', default=os.environ.get('OUT', '/tmp/out'))
    ap.add_argument('--data', default='/tmp/fastai_dali_bench'); ap.add_argument('--max-batches', type=int, default=60)
    ap.add_argument('--epochs', type=int, default=1)
    ap.add_argument('--sections', default='parity,train,throughput,mixed', help='comma-separated subset to run')
    a = ap.parse_args()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    from fastai.vision.all import (FuncSplitter, ImageDataLoaders, Resize, ResizeMethod, PadMode, Normalize, imagenet_stats,
                                   vision_learner, resnet18, accuracy, first, parent_label)
    import fastai
    from fastai_dali.all import DaliDataLoaders, dali_cuda_count
    from fastai_dali.bench import raw_dali_loader, compare_loaders, results_markdown
    import nvidia.dali
    res = {'machine': {'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                       'cpus': os.cpu_count(), 'dali': nvidia.dali.__version__, 'fastai': fastai.__version__,
                       'torch': torch.__version__, 'python': platform.python_version(), 'dali_cuda_devices': dali_cuda_count()},
           'command': ' '.join(sys.argv)}
    print(res['machine'], flush=True)
    t0 = time.time()
    root = make_dataset(a.data + f'_{a.n}', a.n, procs=min(16, os.cpu_count()))
    print(f'dataset: {a.n} JPEGs in {time.time()-t0:.1f}s', flush=True)

    sections = a.sections.split(',')
    # 1. parity with ImageDataLoaders on a small folder, per ResizeMethod (valid: deterministic centre crop)
    small = make_dataset(a.data + '_small', 150, procs=min(16, os.cpu_count()))
    par = {}
    if 'parity' not in sections: par_methods = []
    import fastai_dali.transforms as T
    par_methods = [('crop', Resize(a.size)), ('crop_exact', Resize(a.size)), ('squish', Resize(a.size, method=ResizeMethod.Squish)),
                     ('pad_zeros', Resize(a.size, method=ResizeMethod.Pad, pad_mode=PadMode.Zeros)),
                     ('pad_border', Resize(a.size, method=ResizeMethod.Pad, pad_mode=PadMode.Border)),
                     ('pad_reflection', Resize(a.size, method=ResizeMethod.Pad, pad_mode=PadMode.Reflection))]
    if 'parity' not in sections: par_methods = []
    for name,tfm in par_methods:
        T.exact_resize_crop = name == 'crop_exact'
        dls = DaliDataLoaders.from_folder(small, item_tfms=tfm, bs=16, device=a.device)
        fdls = ImageDataLoaders.from_folder(small, item_tfms=tfm, bs=16, device=a.device, num_workers=0)
        assert dls.vocab == fdls.vocab and list(dls.valid.items) == list(fdls.valid.items)
        assert (len(dls.train), len(dls.valid)) == (len(fdls.train), len(fdls.valid))
        dx = torch.cat([x.float() for x,_ in dls.valid]); dy = torch.cat([y for _,y in dls.valid])
        fx = torch.cat([x.float() for x,_ in fdls.valid]); fy = torch.cat([y for _,y in fdls.valid])
        assert torch.equal(dy.cpu(), fy.cpu()), 'labels differ'
        assert dx.device.type == torch.device(a.device).type, dx.device
        d = (dx.cpu()-fx.cpu()).abs()*255
        par[name] = {'mean_abs_diff_255': float(d.mean()), 'max_abs_diff_255': float(d.max()),
                     'p99_abs_diff_255': float(d.flatten().kthvalue(int(0.99*d.numel())).values), 'n': len(dx),
                     'report': dls.valid.dali_report().how.tolist()}
        print(name, par[name], flush=True)
    T.exact_resize_crop = False
    res['parity_valid_pixels'] = par

    # 2. a short training run on the GPU path
    dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(a.size), batch_tfms=Normalize.from_stats(*imagenet_stats),
                                      bs=a.bs, device=a.device)
    if 'train' in sections:
        learn = vision_learner(dls, resnet18, pretrained=False, metrics=accuracy)
        if a.device != 'cpu': learn = learn.to_fp16()
        t0 = time.time(); learn.fine_tune(a.epochs, 1e-3); t = time.time()-t0
        preds,targs = learn.get_preds()
        assert len(preds) == len(dls.valid.items)
        assert torch.equal(targs.cpu(), torch.tensor([dls.vocab.o2i[parent_label(o)] for o in dls.valid.items]))
        res['fine_tune'] = {'arch': 'resnet18 (random init)', 'epochs': f'1 frozen + {a.epochs}', 'seconds': t,
                            'accuracy': float(learn.validate()[1]), 'n_train': len(dls.train.items), 'bs': a.bs}
        print(res['fine_tune'], flush=True)

    # 3. throughput: same files, same work (decode, crop to square, resize 224, normalize, CHW float on device)
    files = dls.train.items; labels = [dls.vocab.o2i[parent_label(o)] for o in files]
    fdls = ImageDataLoaders.from_folder(root, item_tfms=Resize(a.size), batch_tfms=Normalize.from_stats(*imagenet_stats),
                                        bs=a.bs, device=a.device, num_workers=a.workers)
    loaders = {
        'raw DALI (hand-written)': lambda: raw_dali_loader(files, labels, bs=a.bs, size=a.size, device=a.device, shuffle=True),
        'DaliDataLoaders train': lambda: dls.train,
        'DaliDataLoaders valid': lambda: dls.valid,
        f'ImageDataLoaders train ({a.workers} workers)': lambda: fdls.train,
        'DaliDataLoaders train, DALI iterator alone': lambda: _dali_only(dls.train),
        'DaliDataLoaders train, Squish': lambda: dls_sq.train,
        'DaliDataLoaders train, exact crop window': lambda: _exact(dls_ex.train),
    }
    if 'throughput' not in sections:
        for k in list(loaders)[4:]: del loaders[k]
    if 'mixed' in sections:
        from fastai.vision.all import DataBlock, ImageBlock, CategoryBlock, GrandparentSplitter, get_image_files
        import zipfile
        from fastai_dali.data import ZipMember
        zpath = Path(a.data + f'_{a.n}.zip')
        if not zpath.exists():
            with zipfile.ZipFile(zpath, 'w') as z:
                for f in get_image_files(root): z.write(f, f.relative_to(root).as_posix())
        blk = lambda **kw: DataBlock(blocks=(ImageBlock, CategoryBlock), item_tfms=Resize(a.size),
                                     batch_tfms=Normalize.from_stats(*imagenet_stats), **kw)
        dls_py = blk(get_items=get_image_files, get_x=read_bytes, get_y=parent_label, splitter=GrandparentSplitter()
                     ).dali_dataloaders(root, bs=a.bs, device=a.device)
        dls_zip = blk(get_items=zip_names, get_x=ZipMember(zpath), get_y=lambda n: n.split('/')[1],
                      splitter=FuncSplitter(lambda n: n.startswith('valid'))).dali_dataloaders(zpath, bs=a.bs, device=a.device)
        loaders['DaliDataLoaders train, get_x -> bytes of a file (external_source)'] = lambda: dls_py.train
        loaders['DaliDataLoaders train, get_x -> zip member (external_source)'] = lambda: dls_zip.train
    if 'aug' in sections:  # aug_transforms(): hand-written DALI with the same kind of ops vs ours vs ImageDataLoaders
        from fastai.vision.all import aug_transforms, RandomResizedCrop
        from fastai_dali.bench import raw_dali_aug_pipeline
        aug = [*aug_transforms(), Normalize.from_stats(*imagenet_stats)]
        dls_aug = DaliDataLoaders.from_folder(root, item_tfms=Resize(a.size), batch_tfms=aug, bs=a.bs, device=a.device)
        dls_rrc = DaliDataLoaders.from_folder(root, item_tfms=RandomResizedCrop(a.size, min_scale=0.35), batch_tfms=aug,
                                              bs=a.bs, device=a.device)
        fdls_aug = ImageDataLoaders.from_folder(root, item_tfms=Resize(a.size), batch_tfms=aug, bs=a.bs, device=a.device,
                                                num_workers=a.workers)
        fdls_rrc = ImageDataLoaders.from_folder(root, item_tfms=RandomResizedCrop(a.size, min_scale=0.35), batch_tfms=aug,
                                                bs=a.bs, device=a.device, num_workers=a.workers)
        res['aug_report'] = dls_rrc.train.dali_report().values.tolist()
        print(dls_rrc.train.dali_report().to_string(), flush=True)
        aug_loaders = {
            'raw DALI aug (hand-written: crop, mirror, rotate+zoom warp_affine, brightness_contrast)':
                lambda: raw_dali_loader(files, labels, bs=a.bs, size=a.size, device=a.device, shuffle=True, pipeline=raw_dali_aug_pipeline),
            'DaliDataLoaders train, Resize + aug_transforms()': lambda: dls_aug.train,
            'DaliDataLoaders train, RandomResizedCrop(min_scale=0.35) + aug_transforms()': lambda: dls_rrc.train,
            f'ImageDataLoaders train ({a.workers} workers), Resize + aug_transforms()': lambda: fdls_aug.train,
            f'ImageDataLoaders train ({a.workers} workers), RandomResizedCrop + aug_transforms()': lambda: fdls_rrc.train,
        }
        res['throughput_aug'] = compare_loaders(aug_loaders, max_batches=a.max_batches, warmup=3, repeats=2)
        print(results_markdown(res['throughput_aug']), flush=True)
    dls_ex = DaliDataLoaders.from_folder(root, item_tfms=Resize(a.size), batch_tfms=Normalize.from_stats(*imagenet_stats),
                                         bs=a.bs, device=a.device)
    dls_sq = DaliDataLoaders.from_folder(root, item_tfms=Resize(a.size, method='squish'),
                                         batch_tfms=Normalize.from_stats(*imagenet_stats), bs=a.bs, device=a.device)
    thr = compare_loaders(loaders, max_batches=a.max_batches, warmup=3, repeats=2) if 'throughput' in sections or 'mixed' in sections else {}
    res['throughput'] = thr
    print(results_markdown(thr), flush=True)
    (out/'gpu_results.json').write_text(json.dumps(res, indent=2))
    md = [f"# fastai_dali on {res['machine']['gpu'] or 'CPU'}", '', '```', json.dumps(res['machine']), res['command'], '```', '',
          '## Valid pixel parity with ImageDataLoaders (|Δ| in 0-255 units)', '', '| method | mean | p99 | max |', '|---|---:|---:|---:|']
    md += [f"| {k} | {v['mean_abs_diff_255']:.2f} | {v['p99_abs_diff_255']:.1f} | {v['max_abs_diff_255']:.0f} |" for k,v in par.items()]
    md += ['', '## fine_tune', '', '```', json.dumps(res.get('fine_tune')), '```', '']
    if thr: md += [results_markdown(thr, f'Throughput, bs {a.bs}, {a.size}px')]
    if 'throughput_aug' in res: md += ['', results_markdown(res['throughput_aug'], f'Throughput with augmentation, bs {a.bs}, {a.size}px')]
    (out/'gpu_results.md').write_text('\n'.join(md)+'\n')
    print('\n'.join(md))

if __name__ == '__main__': main()
