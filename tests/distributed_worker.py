"""One rank of the distributed checks of `test_distributed.py` (DALI's CPU backend, gloo), started by torchrun:

    ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/distributed_worker.py ROOT OUT

1. A Learner under `distrib_ctx`: every batch of `fit` and `get_preds` comes from a `DaliDL` (DALI, not fastai's PIL
   path); per epoch the ranks run the same number of batches and see every training item, at most `world-1` twice;
   the gathered `get_preds` are the single-process ones, in dataset order; a second `get_preds` builds no pipeline;
   a `test_dl` of 7 items (padded on 2 ranks) and `tta` give every item once, in order.
2. Loaders alone, for n = 1..13 items, shuffled or not, drop_last or not: the same checks, over 3 epochs.
3. Masks and multi-label targets of an unshuffled loader, gathered from every rank (`to_detach`): the single-process
   ones, in dataset order.
4. Ranks that disagree (a different batch size) get a clear error on every rank instead of a hang.
5. `DeviceLossCallback` under `distrib_ctx`: fastai's records (the smoothed loss gathered from every rank) are the same.
Each rank writes OUT/rank<r>.json; any failed check ends the rank with an error (non-zero exit status).
"""
import json, os, sys, warnings
from pathlib import Path
import numpy as np, torch, torch.distributed as dist
sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings('ignore')
from conftest import make_id_folder, ids_of, id_of, cls_of, IdNet, IdLoss, plain
from fastai.vision.all import (Learner, Callback, Datasets, PILImage, parent_label, Categorize, ToTensor, IntToFloatTensor,
                               get_image_files, set_seed)
from fastai_dali.all import *

class Record(Callback):
    "The loader type of every batch, and per training epoch the item ids of its batches"
    order = 99
    def __init__(self): self.epochs,self.types = [],set()
    def before_train(self): self.epochs.append([])
    def before_batch(self):
        self.types.add(type(self.dl).__name__)
        if self.training: self.epochs[-1].append(ids_of(self.xb[0]))

def gather(o):
    res = [None]*dist.get_world_size(); dist.all_gather_object(res, o); return res

def check_train_epoch(per_rank, items, world, drop_last=True):
    "Batches of one epoch from every rank: equal counts; training items only, each at most twice, at most world-1 repeats"
    assert len({len(b) for b in per_rank}) == 1, f"ranks ran different numbers of batches: {[len(b) for b in per_rank]}"
    seen = [i for b in per_rank for x in b for i in x]
    assert set(seen) <= set(items) and len(seen) - len(set(seen)) < world, (sorted(seen), sorted(items))
    if not drop_last: assert set(seen) == set(items), (sorted(seen), sorted(items))

def gathered_in_order(per_rank):
    "Batch j of every rank in rank order, then batch j+1...: what fastai's gathering gives"
    return [i for j in range(len(per_rank[0])) for b in per_rank for i in b[j]]

def learner_checks(root, rank, world):
    dls = DaliDataLoaders.from_folder(root, bs=4, device='cpu', num_threads=1)
    rec = Record()
    learn = Learner(dls, IdNet(), loss_func=IdLoss(), cbs=rec)
    with learn.distrib_ctx(sync_bn=False):
        learn.fit(2)
        preds,targs = learn.get_preds()
        # fastai makes new loaders (and so new shards) at every call: they run on the pipeline built the first time
        built = dls.valid.pipelines.n_builds
        again,_ = learn.get_preds()
        assert dls.valid.pipelines.n_builds == built and torch.equal(again, preds), "get_preds built a pipeline again"
        tdl = dls.test_dl(dls.valid_ds.items[:7])   # 7 items: padded to 8 on 2 ranks
        tpreds,_ = learn.get_preds(dl=tdl)
        tta_preds,tta_targs = learn.tta(n=2)
    assert rec.types == {'DaliDL'}, f"batches came from {rec.types}, not only from DaliDL"
    train = [id_of(f) for f in dls.train_ds.items]
    for ep in rec.epochs: check_train_epoch(gather(ep), train, world)
    valid = [id_of(f) for f in dls.valid_ds.items]
    assert preds[:, -1].long().tolist() == valid, (preds[:, -1].long().tolist(), valid)
    # a test_dl and tta, gathered: every item once, in order (no augmentation here, so tta's passes are the plain one)
    assert tpreds[:, -1].long().tolist() == valid[:7], (tpreds[:, -1].long().tolist(), valid[:7])
    assert tta_preds[:, -1].round().long().tolist() == valid and torch.equal(plain(tta_targs), plain(targs))
    # what one process computes with the same model on the whole valid set (fastai's get_preds would gather here too:
    # WORLD_SIZE is set), in dataset order
    with torch.no_grad(): xs,ys = zip(*[(learn.loss_func.activation(learn.model(x)), y) for x,y in dls.valid])
    assert torch.equal(plain(targs), plain(torch.cat(ys))) and torch.allclose(preds, torch.cat(xs), atol=1e-5)
    return dict(train_epochs=len(rec.epochs), valid=len(valid))

def loader_checks(root, rank, world):
    files = sorted(get_image_files(root/'train'), key=id_of)
    n_checked = 0
    for n in range(1, 14):
        ds = Datasets(files[:n], [[PILImage.create], [parent_label, Categorize()]])
        ids = [id_of(f) for f in files[:n]]
        for shuffle in (False, True):
            for drop_last in (False, True):
                dl = DaliDL(ds, bs=3, shuffle=shuffle, drop_last=drop_last, device='cpu', num_threads=1,
                            after_item=[ToTensor()], after_batch=[IntToFloatTensor()]).distributed()
                orders = []
                for ep in range(3):
                    per_rank,trimmed = [],[]
                    for x,_ in dl:  # fastai gathers each batch from every rank (`to_detach`), the padding dropped
                        per_rank.append(ids_of(x)); trimmed += dl.to_detach(torch.tensor(ids_of(x))).tolist()
                    per_rank = gather(per_rank)
                    orders.append(gathered_in_order(per_rank))
                    if not shuffle and not drop_last: assert trimmed == ids, (n, trimmed, ids)
                    assert len({len(b) for b in per_rank}) == 1, (n, shuffle, drop_last, [len(b) for b in per_rank])
                    if shuffle: check_train_epoch(per_rank, ids, world, drop_last)
                    else:  # batch j of every rank in rank order, then batch j+1...: the items in order
                        got = gathered_in_order(per_rank)
                        assert got[:n] == ids[:len(got)] and len(got) - min(len(got), n) < world, (n, got, ids)
                        if not drop_last: assert len(got) >= n, (n, got, ids)
                # a new permutation each epoch (with 8+ items two equal ones would be a 1-in-20,000 accident)
                if shuffle and n >= 8: assert orders[0] != orders[1] != orders[2], (n, drop_last, orders)
                n_checked += 1
    return dict(loaders=n_checked)

def target_checks(root, rank, world):
    from PIL import Image
    from fastai.vision.all import DataBlock, ImageBlock, MaskBlock, MultiCategoryBlock, FuncSplitter
    files = sorted(get_image_files(root/'valid'), key=id_of)
    items = sorted(get_image_files(root/'train'), key=id_of)[:3] + files  # a small training split, all of valid
    is_valid = lambda f: f.parent.parent.name == 'valid'
    mdir = root.parent/f'masks{rank}'; mdir.mkdir(exist_ok=True)
    for f in items: Image.fromarray(np.full((8, 8), id_of(f) % 7, np.uint8)).save(mdir/f'{f.stem}.png')
    def gathered(dl):
        "Every batch gathered from every rank as fastai does, the padding dropped: (ids, targets)"
        ids,ys = [],[]
        for x,y in dl: ids += dl.to_detach(torch.tensor(ids_of(x))).tolist(); ys.append(dl.to_detach(y))
        return ids,torch.cat(ys)
    valid = [id_of(f) for f in files]
    blk = DataBlock(blocks=(ImageBlock, MaskBlock(codes=list(range(7)))), get_items=lambda _: items,
                    get_y=lambda f: mdir/f'{f.stem}.png', splitter=FuncSplitter(is_valid))
    dls = blk.dali_dataloaders(None, bs=3, device='cpu', num_threads=1)
    ids,masks = gathered(dls.valid.distributed())
    assert ids == valid and plain(masks).flatten(1).tolist() == [[i % 7]*64 for i in valid], (ids, valid)
    blk = DataBlock(blocks=(ImageBlock, MultiCategoryBlock), get_items=lambda _: items,
                    get_y=lambda f: [cls_of(id_of(f)), 'odd' if id_of(f) % 2 else 'even'], splitter=FuncSplitter(is_valid))
    dls = blk.dali_dataloaders(None, bs=3, device='cpu', num_threads=1)
    single = torch.cat([plain(y) for _,y in dls.valid])  # this process alone, all items
    ids,ys = gathered(dls.valid.distributed())
    assert ids == valid and torch.equal(plain(ys), single), (ids, valid)
    return dict(targets_checked=len(valid))

def callback_checks(root, rank, world):
    flat = lambda xs: [torch.as_tensor(x).flatten().tolist() for x in xs]
    recs = []
    # fastai's own loop (no fast path), then the fast path's DeviceLossCallback with a second one passed to `fit`
    for fast,cbs in ((False, []), (True, [DeviceLossCallback()])):
        set_seed(0)
        dls = DaliDataLoaders.from_folder(root, bs=4, device='cpu', num_threads=1)
        dls.fast_path = fast
        learn = Learner(dls, IdNet(), loss_func=IdLoss(), lr=1e-2)
        with learn.distrib_ctx(sync_bn=False), learn.no_bar(): learn.fit(2, cbs=cbs)
        recs.append((flat(learn.recorder.losses), [flat(v) for v in learn.recorder.values]))
    assert recs[0] == recs[1] and len(recs[0][0]) == 2*len(dls.train.distributed()), recs  # 2 epochs of this rank's shard
    return dict(callback_losses=len(recs[0][0]))

def mismatch_checks(root, rank, world):
    ds = Datasets(get_image_files(root/'train')[:8], [[PILImage.create], [parent_label, Categorize()]])
    dl = DaliDL(ds, bs=3+rank, device='cpu', num_threads=1, after_item=[ToTensor()], after_batch=[IntToFloatTensor()])
    try: dl.distributed()
    except ValueError as e:
        assert 'disagree' in str(e), e
        return dict(mismatch_error=str(e)[:200])
    raise AssertionError("ranks with different batch sizes were not stopped")

if __name__ == '__main__':
    root,out = Path(sys.argv[1]),Path(sys.argv[2])
    rank,world = int(os.environ['RANK']),int(os.environ['WORLD_SIZE'])
    res = dict(rank=rank, world=world, local_rank=int(os.environ['LOCAL_RANK']))
    res.update(learner_checks(root, rank, world))   # distrib_ctx initializes the process group (accelerate)
    res.update(loader_checks(root, rank, world))
    res.update(target_checks(root, rank, world))
    res.update(callback_checks(root, rank, world))
    res.update(mismatch_checks(root, rank, world))
    (out/f'rank{rank}.json').write_text(json.dumps(res))
    dist.barrier()
