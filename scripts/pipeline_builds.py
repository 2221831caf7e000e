"""What does building a DALI pipeline cost, and which part? A reader's loader rebuilds its pipeline when an epoch is
abandoned (`one_batch`, `show_batch`, a `break`), so the build is paid each time. Times (median of 5 after one
warm-up, seconds) for: hand-written pipelines (reader + decoder, + resize) with the decoder on the CPU, 'mixed' with
hw_decoder_load 1.0 and 0.0, with and without jpeg_fancy_upsampling; and a loader's build as it does it (`Feed.build`;
the result keys keep their earlier name, `DaliDL._build`).

    python scripts/pipeline_builds.py OUT [--device cuda|cpu]
"""
import argparse, gc, json, statistics, sys, tempfile, time
from pathlib import Path

def rebuild(dl):
    "Build `dl`'s pipeline again, as its next epoch would after an abandoned one"
    return dl.feed.build(dl.spec(), dl.get_idxs)

def folder(root):
    "64 small JPEGs (20-60 px a side) in two classes, from the package's one sample-data generator"
    from fastai_dali.samples import make_image_folder
    return make_image_folder(root, n_train=24, n_valid=8, classes=('coffee', 'rocket'), min_size=20, max_size=60)

def timed(f, reps=5):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter()-t0)
    return round(statistics.median(ts), 4)

def main():
    p = argparse.ArgumentParser(); p.add_argument('out'); p.add_argument('--device', default='cuda'); a = p.parse_args()
    from nvidia.dali import pipeline_def, fn, types
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    root = folder(Path(tempfile.mkdtemp())/'pipeline_builds')
    files = sorted(str(f) for f in root.rglob('*.jpg'))
    gpu = a.device != 'cpu'
    def raw(decoder='mixed', resize=False, **dkw):
        @pipeline_def(batch_size=8, num_threads=1, device_id=0 if gpu else None, seed=0, prefetch_queue_depth=2)
        def pipe():
            jpegs,_ = fn.readers.file(files=files, name='Reader')
            img = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, **dkw)
            if resize: img = fn.resize(img, size=[4, 4])
            return img
        def go():
            p = pipe(); p.build(); p.run(); del p
        return go
    res = {}
    variants = dict(cpu_decoder=dict(decoder='cpu'))
    if gpu: variants.update(mixed_hw1=dict(hw_decoder_load=1.0), mixed_hw0=dict(hw_decoder_load=0.0),
                            mixed_hw1_fancy=dict(hw_decoder_load=1.0, jpeg_fancy_upsampling=True),
                            mixed_hw0_fancy=dict(hw_decoder_load=0.0, jpeg_fancy_upsampling=True),
                            mixed_hw1_fancy_resize=dict(hw_decoder_load=1.0, jpeg_fancy_upsampling=True, resize=True))
    for k,v in variants.items():
        res[f'raw build+run, {k}'] = timed(raw(**v)); print(k, res[f'raw build+run, {k}'], flush=True)
    # the same while another pipeline stays alive (built and run once): which kind of pipeline must live?
    def keeper(kind):
        @pipeline_def(batch_size=1, num_threads=1, device_id=0 if gpu else None, seed=0, prefetch_queue_depth=1)
        def pipe():
            jpegs,_ = fn.readers.file(files=files[:1])
            if kind == 'plain': return jpegs.gpu() if gpu else jpegs
            return fn.decoders.image(jpegs, device='mixed' if kind == 'mixed' and gpu else 'cpu', output_type=types.RGB)
        p = pipe(); p.build(); p.run(); return p
    kinds = ('plain', 'cpu_decoder', 'mixed') if gpu else ('plain',)
    for kk in kinds:
        kp = keeper(kk)
        for k in ('cpu_decoder', 'mixed_hw1_fancy') if gpu else ('cpu_decoder',):
            res[f'raw build+run, {k}, a {kk} pipeline alive'] = timed(raw(**variants[k])); print(kk, k, res[f'raw build+run, {k}, a {kk} pipeline alive'], flush=True)
        del kp; gc.collect()
    from fastai.vision.all import Resize
    from fastai_dali.all import DaliDataLoaders
    for k,kw in dict(default={}, hw0=dict(hw_decoder_load=0.0), threads4=dict(num_threads=4)).items():
        dls = DaliDataLoaders.from_folder(root, valid_pct=0.25, item_tfms=Resize(4), bs=8, device=a.device, num_threads=kw.pop('num_threads', 1), **kw)
        dls.train.one_batch()
        res[f'DaliDL._build, {k}'] = timed(lambda: rebuild(dls.train)); print(k, res[f'DaliDL._build, {k}'], flush=True)
        res[f'one_batch (abandons, rebuilds), {k}'] = timed(dls.train.one_batch)
        res[f'full train epoch (rebuilds), {k}'] = timed(lambda: list(dls.train))
        del dls; gc.collect()
    kp = keeper('mixed' if gpu else 'plain')
    dls = DaliDataLoaders.from_folder(root, valid_pct=0.25, item_tfms=Resize(4), bs=8, device=a.device, num_threads=1)
    dls.train.one_batch()
    res['DaliDL._build, a mixed pipeline alive'] = timed(lambda: rebuild(dls.train))
    res['one_batch (abandons, rebuilds), a mixed pipeline alive'] = timed(dls.train.one_batch)
    del dls,kp; gc.collect()
    for k,v in res.items(): print(f'{v:8.4f} s  {k}')
    (out/'pipeline_builds.json').write_text(json.dumps(res, indent=1))

if __name__ == '__main__': main()
