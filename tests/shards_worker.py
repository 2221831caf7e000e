"""One rank of `test_shards.py`'s distributed checks (DALI's CPU backend, gloo), started by torchrun:

    ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 torchrun --nproc_per_node K tests/shards_worker.py SHARDS OUT

SHARDS (a folder, or `s3://bucket/prefix` in object storage) holds `train/*.tar` and `valid/*.tar` of id images
(`test_shards.write_tars`). Each rank:
1. loaders from shards, for shuffle and drop_last both ways: per epoch (3) the ranks run the same number of batches,
   see every training sample (at most `world-1` twice; all of them without drop_last), a new permutation each epoch;
   unshuffled, the batches gathered from every rank (`to_detach`) are the samples in shard order;
2. a Learner under `distrib_ctx`: `fit` on every rank's share, `get_preds` gathered in shard order.
In object storage the ranks share one cache: each shard is read in full (indexed and copied) by one rank only, `scans`.
Writes OUT/rank<r>.json; a failed check ends the rank with an error.
"""
import json, os, sys, warnings
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings('ignore')
from conftest import ids_of, IdNet, IdLoss
from distributed_worker import gather, check_train_epoch, gathered_in_order
from fastai.vision.all import Learner
from fastai_dali.all import *
from fastai_dali.shards import ShardIndex

SCANS = []   # the shards this rank read in full from object storage
_scan_object = ShardIndex.scan_object.__func__
ShardIndex.scan_object = classmethod(lambda cls, tar, keep=None: SCANS.append(tar) or _scan_object(cls, tar, keep))

def loader_checks(root, world):
    n = 0
    for shuffle in (False, True):
        for drop_last in (False, True):
            dls = DaliDataLoaders.from_shards(root('train'), valid=root('valid'), bs=3, shuffle=shuffle, drop_last=drop_last,
                                              device='cpu', num_threads=1, py_workers=0, seed=5)
            ids = [int(s.key[6:]) for s in dls.train_ds.items]
            dl,orders = dls.train.distributed(),[]
            for ep in range(3):
                per_rank,trimmed = [],[]
                for x,_ in dl: per_rank.append(ids_of(x)); trimmed += dl.to_detach(torch.tensor(ids_of(x))).tolist()
                per_rank = gather(per_rank)
                orders.append(gathered_in_order(per_rank))
                assert len({len(b) for b in per_rank}) == 1, (shuffle, drop_last, [len(b) for b in per_rank])
                if shuffle: check_train_epoch(per_rank, ids, world, drop_last)
                elif not drop_last: assert trimmed == ids, (trimmed, ids)
            if shuffle: assert orders[0] != orders[1] != orders[2], orders
            n += 1
    va = dls.valid.distributed()
    got = [i for x,_ in va for i in va.to_detach(torch.tensor(ids_of(x))).tolist()]
    assert got == [int(s.key[6:]) for s in dls.valid_ds.items], got
    return n

def learner_checks(root):
    dls = DaliDataLoaders.from_shards(root('train'), valid=root('valid'), bs=4, device='cpu', num_threads=1, py_workers=0)
    learn = Learner(dls, IdNet(n_cls=len(dls.vocab)), loss_func=IdLoss())
    with learn.distrib_ctx(sync_bn=False), learn.no_bar():
        learn.fit(1)
        preds,_ = learn.get_preds()
    want = [int(s.key[6:]) for s in dls.valid_ds.items]
    assert preds[:, -1].long().tolist() == want, (preds[:, -1].long().tolist(), want)
    return len(want)

if __name__ == '__main__':
    at,out = sys.argv[1],Path(sys.argv[2])
    root = (lambda s: f'{at}/{s}/') if at.startswith('s3://') else (lambda s: Path(at)/s)
    rank,world = int(os.environ['RANK']),int(os.environ['WORLD_SIZE'])
    valid = learner_checks(root)   # (distrib_ctx starts the process group the loader checks use)
    if not dist.is_initialized(): dist.init_process_group('gloo')
    res = dict(rank=rank, world=world, loaders=loader_checks(root, world), valid=valid, scans=SCANS)
    (out/f'rank{rank}.json').write_text(json.dumps(res))
