"Startup (build + first batch) and whole-epoch img/s of DaliDataLoaders' mixed path (get_x -> bytes) per worker count"
import sys, time, json, os
from pathlib import Path
from fastai.vision.all import *
from fastai_dali.all import *
from fastai_dali.bench import bench_loaders

def read_bytes(f): return Path(f).read_bytes()
if __name__ == '__main__':
    data,out = sys.argv[1],Path(os.environ.get('OUT', '/tmp'))
    res = {}
    rdl = DaliDataLoaders.from_folder(data, item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=128, device=sys.argv[3]).train
    r = bench_loaders({'reader': lambda: rdl}, repeats=3, show_progress=False)['reader']
    res['reader'] = dict(img_s=r['img_s'], runs=r['runs']); print('reader', res['reader'], flush=True); del rdl
    for w in [int(o) for o in sys.argv[2].split(',')]:
        blk = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=read_bytes, get_y=parent_label,
                        splitter=GrandparentSplitter(), item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats))
        t0 = time.perf_counter(); dl = blk.dali_dataloaders(data, bs=128, device=sys.argv[3], py_workers=w).train
        next(iter(dl)); t = time.perf_counter()-t0
        r = bench_loaders({'m': lambda: dl}, repeats=3, show_progress=False)['m']
        res[w] = dict(startup_s=t, img_s=r['img_s'], runs=r['runs'], ratio_to_reader=r['img_s']/res['reader']['img_s'])
        print(w, res[w], flush=True); (out/'mixed_startup.json').write_text(json.dumps(res, indent=1))
        del dl
