"""A user's training script with `ResumeCallback`, run by `test_resume.py` in processes of its own:
    python resume_script.py ROOT OUT SOURCE [KILL]
SOURCE: 'folder' (`from_folder`), 'mixed' (a `get_x` giving each file's bytes) or 'shards' (`from_shards` on ROOT's shards).
Every training batch goes to OUT/batches.jsonl as it is trained (epoch, iteration, a digest of its images, its labels);
the final weights to OUT/final.pth. KILL 'E,B': the process kills itself (SIGKILL) after training batch B of epoch E.
CONTROL=restart in the environment: the loader is not resumed (it restarts its epoch): the control that must differ.
DEVICE=cuda in the environment: the loaders (and the fit) on the GPU. FIT=fine_tune: `learn.fine_tune(2, freeze_epochs=1)` (two fits) instead of `fit_one_cycle(3)`;
FIT=own_cbs: two fits (1 epoch, then 2), each given a new `ResumeCallback` (`fit(cbs=...)`), none on the `Learner`.
Under torchrun (WORLD_SIZE > 1) the fit runs in `learn.distrib_ctx()`, and each rank writes OUT/batches.rank<r>.jsonl."""
import hashlib, json, os, signal, sys, warnings
from pathlib import Path
warnings.filterwarnings('ignore')
import torch
from fastai.vision.all import *
from fastai_dali.all import *
from fastai_dali.resume import ResumeCallback

class Record(Callback):
    order = 100
    def __init__(self, fn): self.fn = fn
    def after_batch(self):
        if not self.training: return
        x,y = self.xb[0],self.yb[0]
        with open(self.fn, 'a') as f:
            f.write(json.dumps([self.epoch, self.iter, hashlib.sha1(x.cpu().numpy().tobytes()).hexdigest(), y.tolist()]) + '\n')

class Kill(Callback):
    order = 101
    def __init__(self, at): self.at = at
    def after_batch(self):
        if self.training and (self.epoch, self.iter) == self.at: os.kill(os.getpid(), signal.SIGKILL)

def main(root, out, source, kill=None):
    root,out = Path(root),Path(out); out.mkdir(parents=True, exist_ok=True)
    set_seed(0, reproducible=True)   # (the run it is compared with: the same seeds)
    if os.environ.get('CONTROL') == 'restart': DaliDL.resume = lambda self, cp: None
    world,rank = int(os.environ.get('WORLD_SIZE', 1)),int(os.environ.get('RANK', 0))
    kw = dict(item_tfms=RandomResizedCrop(32, min_scale=0.5), batch_tfms=[Flip(p=0.5), Normalize.from_stats(*imagenet_stats)], bs=8 if world == 1 else 4,   # (2 ranks: 5 batches each)
              device=os.environ.get('DEVICE', 'cpu'))
    if source == 'folder': dls = DaliDataLoaders.from_folder(root, **kw)
    elif source == 'mixed':
        blk = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=lambda f: Path(f).read_bytes(),
                        get_y=parent_label, splitter=GrandparentSplitter(), item_tfms=kw.pop('item_tfms'), batch_tfms=kw.pop('batch_tfms'))
        dls = DaliDataLoaders.from_dblock(blk, root, py_workers=0, **kw)
    else: dls = DaliDataLoaders.from_shards(str(root/'shards'/'train'/'*.tar'), valid=str(root/'shards'/'valid'/'*.tar'), **kw)
    own = os.environ.get('FIT') == 'own_cbs'
    cbs = [] if own else [ResumeCallback(every=3)]
    cbs += [Record(out/(f'batches.rank{rank}.jsonl' if world > 1 else 'batches.jsonl'))]
    if kill: cbs.append(Kill(tuple(int(v) for v in kill.split(','))))
    learn = vision_learner(dls, resnet18, pretrained=False, cbs=cbs, path=out)
    with learn.no_bar():
        if world > 1:
            with learn.distrib_ctx(sync_bn=False): learn.fit_one_cycle(3, 1e-3)   # (SyncBatchNorm needs a GPU)
        elif os.environ.get('FIT') == 'fine_tune': learn.fine_tune(2, 1e-3, freeze_epochs=1)
        elif own: learn.fit_one_cycle(1, 1e-3, cbs=ResumeCallback(every=3)); learn.fit_one_cycle(2, 1e-3, cbs=ResumeCallback(every=3))
        else: learn.fit_one_cycle(3, 1e-3)
    if rank == 0: torch.save(learn.model.state_dict(), out/'final.pth')

if __name__ == '__main__': main(*sys.argv[1:])
