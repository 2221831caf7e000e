"Shards on the CPU backend: py_workers 0, 1, 2 against the folder, whole epochs, 5 interleaved rounds. Usage: python scripts/shards_py_workers.py OUT.json FOLDER SHARDS"
import json, sys
from pathlib import Path
from fastai.vision.all import Resize, Normalize, imagenet_stats
from fastai_dali.all import *
from fastai_dali.bench import bench_loaders, results_markdown
if __name__ == '__main__':
    root,sd = Path(sys.argv[2]),Path(sys.argv[3])  # the bench's folder and its shards (fastai-dali bench --sections shards --out DIR)
    kw = dict(item_tfms=Resize(224), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=64, device='cpu')
    f = DaliDataLoaders.from_folder(root, **kw)
    S = {w: DaliDataLoaders.from_shards(sd/'train', valid=sd/'valid', py_workers=w, **kw) for w in (0, 1, 2)}
    L = {'folder': lambda: f.train, **{f'shards, py_workers={w}': (lambda d: lambda: d.train)(d) for w,d in S.items()}}
    res = bench_loaders(L, repeats=5, warmup=3, show_progress=False)
    print(results_markdown(res))
    print({k: [round(x) for x in v['runs']] for k,v in res.items()})
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
