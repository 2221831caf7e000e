"""Why do DALI's GPU Resize pixels depart from fastai's more than the CPU backend's, and what does fastai's Crop window
cost? One run, four parts, each against fastai/PIL on the same files (|Δ| in 0..255 units):

  (a) decoder alone: DALI's decoder (GPU: 'mixed' with hw_decoder_load 1.0 and 0.0, each with and without
      jpeg_fancy_upsampling, libjpeg-turbo's chroma upsampling, which PIL uses) against PIL's, per image;
  (b) resize alone: PIL-decoded pixels through DALI's resize (fn.external_source; GPU and CPU backends, antialiased
      linear as `Resize` is translated) against PIL's resize, for Squish (whole image) and Crop (fastai's window);
  (c) the whole valid pipeline, DaliDataLoaders against ImageDataLoaders: Crop (default), Crop exact, Squish,
      with the images shifted against fastai's (best integer shift != 0);
  (d) throughput on `--n` generated JPEGs (bs 128, Resize(224) + Normalize): the hand-written DALI pipeline and
      DaliDataLoaders valid with the default window and with `exact_resize_crop = True` (and train), as ratios;
      on the GPU also the hand-written pipeline decoding with jpeg_fancy_upsampling=True.

Parts (a)-(c) use two generated folders: 'small' (40..120 px, Resize(48), as reported) and 'large' (300..640 px,
Resize(224)). Writes OUT/profile_resize.json and OUT/profile_resize.md, prints a summary.

    python scripts/profile_resize.py $OUT                          # on the H200 (under 3 minutes)
    python scripts/profile_resize.py /tmp/out --device cpu --n 200 # DALI's CPU backend, small (4 minutes on 2 cores)
"""
import argparse, json, os, platform, sys, time
from pathlib import Path
import numpy as np, torch
from PIL import Image

def make_folder(root, n, lo, hi, seed):
    "`root/{train,valid}/a/*.jpg`: `n` valid (and 8 train) JPEGs, random crops of scikit-image photos resized to lo..hi px"
    from fastai_dali.demo import sample_photos
    root,rng = Path(root),np.random.default_rng(seed)
    if (root/'done').exists(): return root
    photos = list(sample_photos().values())
    for split,k in (('train', 8), ('valid', n)):
        (root/split/'a').mkdir(parents=True, exist_ok=True)
        for i in range(k):
            p = photos[i % len(photos)]
            h,w = int(rng.integers(p.shape[0]//4, p.shape[0]+1)), int(rng.integers(p.shape[1]//4, p.shape[1]+1))
            y,x = int(rng.integers(0, p.shape[0]-h+1)), int(rng.integers(0, p.shape[1]-w+1))
            th,tw = (int(o) for o in rng.integers(lo, hi+1, size=2))
            Image.fromarray(p[y:y+h, x:x+w]).resize((tw, th), Image.BILINEAR).save(root/split/'a'/f'{i:04d}.jpg', quality=90)
    (root/'done').touch()
    return root

def pil(f): return np.asarray(Image.open(f).convert('RGB'))

def stats(per_img, pix_max):
    "Summary of per-image mean |Δ| (0..255) and the largest pixel |Δ|"
    a = np.asarray(per_img)
    return {'mean': float(a.mean()), 'worst_image': float(a.max()), 'max_pixel': float(pix_max), 'n': len(a)}

def diff(a, b):
    d = np.abs(a.astype(np.float32) - b.astype(np.float32))
    return float(d.mean()), float(d.max())

def run_batches(pipe, n):
    "The first `n` samples of `pipe`'s first output, as HWC numpy arrays (on the CPU)"
    pipe.build(); res = []
    while len(res) < n:
        o = pipe.run()[0]
        res += [np.array(t) for t in (o.as_cpu() if hasattr(o, 'as_cpu') else o)]
    return res[:n]

# ------------------------------------------------------------------------------------------------ (a) decoder
def decoder_alone(files, device, bs=32):
    from nvidia.dali import pipeline_def, fn, types
    from fastai_dali.core import dali_device_id
    @pipeline_def
    def dec(kw):
        j,_ = fn.readers.file(files=[str(f) for f in files], pad_last_batch=True)
        return fn.decoders.image(j, device='cpu' if device == 'cpu' else 'mixed', output_type=types.RGB, adjust_orientation=False, **kw)
    cases = {'cpu decoder': {}} if device == 'cpu' else {
        f'mixed, hw_decoder_load={l}' + (', jpeg_fancy_upsampling' if fancy else ''): dict(hw_decoder_load=l, jpeg_fancy_upsampling=fancy)
        for l in (1.0, 0.0) for fancy in (False, True)}
    res = {}
    for name,kw in cases.items():
        out = run_batches(dec(kw, batch_size=bs, num_threads=4, device_id=dali_device_id(device), seed=0), len(files))
        d = [diff(o, pil(f)) for o,f in zip(out, files)]
        res[name] = stats([m for m,_ in d], max(x for _,x in d))
    return res

# --------------------------------------------------------------------------------------------- (b) resize alone
def fastai_window(size, H, W):
    "fastai's centre Crop window (y0, x0, ch, cw) for a `Resize(size)`-style (w, h) `size` (Resize.encodes' arithmetic)"
    w,h = size
    m = W/w if W/w < H/h else H/h
    cw,ch = int(m*w),int(m*h)
    return int(0.5*(H-ch)), int(0.5*(W-cw)), ch, cw

def resize_alone(files, size, device, bs=16):
    "PIL pixels (whole image, or fastai's window) resized by DALI (`device` and CPU) against PIL's BILINEAR resize"
    from nvidia.dali import pipeline_def, fn, types
    from fastai_dali.core import dali_device_id
    w,h = size
    res = {}
    for method in ('squish', 'crop'):
        arrs = []
        for f in files:
            a = pil(f)
            if method == 'crop':
                y0,x0,ch,cw = fastai_window(size, *a.shape[:2])
                a = np.ascontiguousarray(a[y0:y0+ch, x0:x0+cw])
            arrs.append(a)
        ref = [np.asarray(Image.fromarray(a).resize((w, h), Image.BILINEAR)) for a in arrs]
        for dev in dict.fromkeys([device, 'cpu']):
            batches = [arrs[i:i+bs] for i in range(0, len(arrs), bs)]
            batches[-1] = batches[-1] + [batches[-1][-1]]*(bs-len(batches[-1]))   # full batches, the last padded
            @pipeline_def
            def rs():
                x = fn.external_source(source=batches, cycle=True, batch=True, layout='HWC')
                return fn.resize(x if dev == 'cpu' else x.gpu(), size=[h, w], interp_type=types.INTERP_LINEAR, antialias=True)
            out = run_batches(rs(batch_size=bs, num_threads=4, device_id=dali_device_id(dev), seed=0), len(arrs))
            d = [diff(o, r) for o,r in zip(out, ref)]
            res[f'{method}, DALI {dev} resize'] = stats([m for m,_ in d], max(x for _,x in d))
    return res

# ------------------------------------------------------------------------------------------- (c) whole pipeline
def best_shift(a, b, r=2):
    "The integer shift (dy, dx), |dy|,|dx| <= r, that best aligns images `a` and `b` (C,H,W): least mean |Δ| on the overlap"
    H,W = a.shape[1:]
    def d(dy, dx):
        return (a[:, max(dy,0):H+min(dy,0), max(dx,0):W+min(dx,0)] - b[:, max(-dy,0):H+min(-dy,0), max(-dx,0):W+min(-dx,0)]).abs().mean().item()
    return min(((dy, dx) for dy in range(-r, r+1) for dx in range(-r, r+1)), key=lambda s: d(*s))

def whole_pipeline(root, size, device):
    from fastai.vision.all import ImageDataLoaders, Resize
    from fastai_dali.data import DaliDataLoaders
    import fastai_dali.transforms as T
    px = lambda dl: torch.cat([b[0].as_subclass(torch.Tensor).cpu() for b in dl])
    res = {}
    for name,kw in (('crop', {}), ('crop exact', {}), ('squish', dict(method='squish'))):
        T.exact_resize_crop = name == 'crop exact'
        try:
            x = px(DaliDataLoaders.from_folder(root, item_tfms=Resize(size, **kw), bs=16, device=device).valid)
        finally: T.exact_resize_crop = False
        f = px(ImageDataLoaders.from_folder(root, item_tfms=Resize(size, **kw), bs=16, device='cpu', num_workers=0).valid)
        d = (x-f).abs()*255
        res[name] = stats(d.flatten(1).mean(1).tolist(), d.max().item())
        res[name]['shifted'] = sum(best_shift(a, b) != (0, 0) for a,b in zip(x, f))
    return res

# ------------------------------------------------------------------------------------------------ (d) throughput
from nvidia.dali import pipeline_def as _pipeline_def

@_pipeline_def
def fancy_pipeline(files, labels, size=224, shuffle=False, mean=(0.485,0.456,0.406), std=(0.229,0.224,0.225)):
    "`fastai_dali.bench.raw_dali_pipeline`, its GPU decoder upsampling chroma as libjpeg-turbo does (jpeg_fancy_upsampling)"
    from nvidia.dali import fn, types
    jpegs,y = fn.readers.file(files=[str(f) for f in files], labels=list(labels), shuffle_after_epoch=shuffle,
                              pad_last_batch=True, name='Reader')
    img = fn.decoders.image(jpegs, device='mixed', output_type=types.RGB, jpeg_fancy_upsampling=True)
    img = fn.resize(img, resize_shorter=size, interp_type=types.INTERP_LINEAR, antialias=True)
    img = fn.crop_mirror_normalize(img, crop=(size,size), dtype=types.FLOAT, output_layout='CHW',
                                   mean=[m*255 for m in mean], std=[s*255 for s in std])
    return img, y.gpu()

class Exact:
    "Iterate `dl` with `exact_resize_crop = True` (read when its pipeline is built)"
    def __init__(self, dl): self.dl = dl
    def __iter__(self):
        import fastai_dali.transforms as T
        T.exact_resize_crop = True
        try: yield from self.dl
        finally: T.exact_resize_crop = False

def throughput(n, device, bs, data, max_batches, bench=None):
    from fastai.vision.all import Resize, Normalize, imagenet_stats, parent_label
    from fastai_dali.data import DaliDataLoaders
    from fastai_dali.bench import make_bench_dataset, raw_dali_loader, compare_loaders
    root = Path(bench) if bench else make_bench_dataset(Path(data)/f'bench_{n}', n)
    dls = DaliDataLoaders.from_folder(root, item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=bs, device=device)
    ex = DaliDataLoaders.from_folder(root, item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=bs, device=device)
    lab = lambda fs: [dls.vocab.o2i[parent_label(o)] for o in fs]
    vf,tf = list(dls.valid.items),list(dls.train.items)
    L = {'hand-written DALI (valid files)': lambda: raw_dali_loader(vf, lab(vf), bs=bs, size=224, device=device),
         'DaliDataLoaders valid, default window': lambda: dls.valid,
         'DaliDataLoaders valid, exact_resize_crop=True': lambda: Exact(ex.valid),
         'hand-written DALI (train files, shuffled)': lambda: raw_dali_loader(tf, lab(tf), bs=bs, size=224, device=device, shuffle=True),
         'DaliDataLoaders train, default window (random)': lambda: dls.train}
    if device != 'cpu':
        L['hand-written DALI (valid files), jpeg_fancy_upsampling=True'] = lambda: raw_dali_loader(vf, lab(vf), bs=bs, size=224,
                                                                                    device=device, pipeline=fancy_pipeline)
    res = compare_loaders(L, max_batches=max_batches, warmup=3, repeats=2)
    k = 'DaliDataLoaders train, default window (random)'
    res[k]['ratio'] = res[k]['img_s']/res['hand-written DALI (train files, shuffled)']['img_s']
    return {k: {'img_s': v['img_s'], 'ratio': v['ratio'], 'runs': v['runs']} for k,v in res.items()}

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('out'); ap.add_argument('--device', default='cuda'); ap.add_argument('--n', type=int, default=10000)
    ap.add_argument('--bs', type=int, default=128); ap.add_argument('--max-batches', type=int, default=60)
    ap.add_argument('--n-pixels', type=int, default=64, help='valid images per folder for parts (a)-(c)')
    ap.add_argument('--data', default='/tmp/fastai_dali_profile_resize', help='where the generated images go')
    ap.add_argument('--bench', help="an existing ImageNet-style folder for (d), e.g. /tmp/bench/data_10000 (default: generate --n JPEGs)")
    ap.add_argument('--parts', default='a,b,c,d')
    a = ap.parse_args()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    import fastai, nvidia.dali
    t0 = time.time()
    res = {'machine': {'gpu': torch.cuda.get_device_name(0) if a.device != 'cpu' else None, 'cpus': os.cpu_count(),
                       'dali': nvidia.dali.__version__, 'fastai': fastai.__version__, 'torch': torch.__version__,
                       'python': platform.python_version()}, 'command': ' '.join(sys.argv)}
    print(res['machine'], flush=True)
    groups = {'small (40-120 px, Resize(48))': (make_folder(Path(a.data)/'small', a.n_pixels, 40, 120, 0), 48),
              'large (300-640 px, Resize(224))': (make_folder(Path(a.data)/'large', a.n_pixels, 300, 640, 1), 224)}
    parts = a.parts.split(',')
    for g,(root,size) in groups.items():
        files = sorted((root/'valid'/'a').glob('*.jpg'))
        if 'a' in parts: res.setdefault('a_decoder', {})[g] = decoder_alone(files, a.device)
        if 'b' in parts: res.setdefault('b_resize', {})[g] = resize_alone(files, (size, size), a.device)
        if 'c' in parts: res.setdefault('c_pipeline_valid', {})[g] = whole_pipeline(root, size, a.device)
        print(g, 'done', f'{time.time()-t0:.0f}s', flush=True)
    if 'd' in parts: res['d_throughput'] = throughput(a.n, a.device, a.bs, a.data, a.max_batches, a.bench)
    res['seconds'] = time.time()-t0
    (out/'profile_resize.json').write_text(json.dumps(res, indent=2))
    md = [f"# Resize on {res['machine']['gpu'] or 'CPU'}: decoder, resize, pipeline, throughput", '', '```',
          json.dumps(res['machine']), res['command'], '```', '']
    for part,title in (('a_decoder', '(a) decoder alone vs PIL'), ('b_resize', '(b) resize alone (PIL pixels) vs PIL'),
                       ('c_pipeline_valid', '(c) DaliDataLoaders valid vs ImageDataLoaders')):
        if part not in res: continue
        md += [f'## {title} (|Δ| 0..255)', '', '| images | case | mean | worst image | max pixel | shifted |', '|---|---|---:|---:|---:|---:|']
        md += [f"| {g} | {k} | {v['mean']:.3f} | {v['worst_image']:.2f} | {v['max_pixel']:.0f} | {v.get('shifted', '')} |"
               for g,r in res[part].items() for k,v in r.items()]
        md += ['']
    if 'd_throughput' in res:
        md += [f'## (d) throughput, bs {a.bs}, Resize(224) + Normalize, {a.n} JPEGs (ratio: to the hand-written pipeline on the same split)',
               '', '| loader | img/s | ratio |', '|---|---:|---:|']
        md += [f"| {k} | {v['img_s']:,.0f} | {v['ratio']:.2f} |" for k,v in res['d_throughput'].items()]
    (out/'profile_resize.md').write_text('\n'.join(md)+'\n')
    print('\n'.join(md))
    print(f"wrote {out}/profile_resize.json and profile_resize.md in {res['seconds']:.0f}s")

if __name__ == '__main__': main()
