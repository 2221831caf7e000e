"""Where does the exact Resize(Crop) window cost its time on the GPU? Times DALI pipelines that differ in one step.
    python scripts/profile_resize.py DATA_DIR"""
import sys, time, glob, torch
from nvidia.dali import pipeline_def, fn, types
import nvidia.dali.math as dmath

files = sorted(glob.glob(sys.argv[1] + '/train/*/*.jpg'))
S = 224

@pipeline_def
def p(variant):
    j,_ = fn.readers.file(files=files, shuffle_after_epoch=True, name='R', pad_last_batch=True)
    img = fn.decoders.image(j, device='mixed', output_type=types.RGB)
    kw = dict(interp_type=types.INTERP_LINEAR, antialias=True)
    if variant == 'squish': img = fn.resize(img, size=[S,S], **kw)
    elif variant == 'roi_const': img = fn.resize(img, size=[S,S], roi_start=[0.1,0.1], roi_end=[0.9,0.9], roi_relative=True, **kw)
    elif variant in ('roi_peek', 'roi_peek_rel'):
        sh = fn.peek_image_shape(j); H,W = sh[0], sh[1]
        cw,ch = dmath.min(W, H), dmath.min(H, W)
        y0 = dmath.floor(0.5*(H-ch)); x0 = dmath.floor(0.5*(W-cw))
        st = fn.stack(fn.cast(y0, dtype=types.FLOAT), fn.cast(x0, dtype=types.FLOAT))
        en = fn.stack(fn.cast(y0+ch, dtype=types.FLOAT), fn.cast(x0+cw, dtype=types.FLOAT))
        img = fn.resize(img, size=[S,S], roi_start=st, roi_end=en, **kw)
    elif variant == 'arith_only':
        sh = fn.peek_image_shape(j); H,W = sh[0], sh[1]
        cw = dmath.min(W, H); x0 = dmath.floor(0.5*(W-cw))
        img = fn.resize(img, size=[S,S], **kw)
        return fn.crop_mirror_normalize(img, dtype=types.FLOAT, output_layout='CHW'), x0
    elif variant == 'not_smaller': img = fn.resize(img, size=[S,S], mode='not_smaller', **kw)
    out = fn.crop_mirror_normalize(img, crop=(S,S), dtype=types.FLOAT, output_layout='CHW')
    return out

for v in ['squish', 'roi_const', 'roi_peek', 'arith_only', 'not_smaller']:
    pipe = p(v, batch_size=128, num_threads=16, device_id=0, seed=0, prefetch_queue_depth=2); pipe.build()
    for _ in range(5): pipe.run()
    torch.cuda.synchronize(); t=time.perf_counter(); n=40
    for _ in range(n): pipe.run()
    torch.cuda.synchronize(); print(f'{v:12s} {n*128/(time.perf_counter()-t):8.0f} img/s', flush=True)
    del pipe
