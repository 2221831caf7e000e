"""Data sets as WebDataset tar shards (`DaliDataLoaders.from_shards`, nbs/04d_shards.ipynb), against fastai's semantics.

The items are 8x8 lossless PNGs whose colour encodes their id (as `test_exactly_once.py`'s), written into tars with
Python's `tarfile` (PAX headers) or the `webdataset` package's `ShardWriter`, each with a `.cls` member holding its id
(so every sample names its item twice, by pixels and by label). Checked: exactly once per epoch over random sizes,
batch sizes, `drop_last`, 1-4 tars and 1-4 loader shards in one process; seeded orders; shard order for validation,
`get_preds`, `test_dl` and `tta`; the same pixels as a folder of the same images; multi-label `.json` labels; the
index files (written once, read next time, rebuilt when a tar changes); bad shards named with their key.
"""
import io, json, os, tarfile, warnings
import numpy as np, pytest, torch
from hypothesis import given, example, settings, strategies as st, HealthCheck, Phase
from PIL import Image
from fastai.vision.all import Learner, Resize, ImageDataLoaders
from fastai_dali.data import DaliDataLoaders
from fastai_dali.shards import shard_samples, shard_indexes, write_shards, read_sample
from fastai_dali.errors import DaliReadError
from conftest import DEVICE, plain, epoch_ids, gathered_valid, IdNet, IdLoss

N_MAX = 400
VOCAB = list(range(N_MAX)) + list(range(1000, 1000 + N_MAX//4))  # a class per item (valid ids from 1000)
KW = dict(device=DEVICE, num_threads=1, py_workers=0)

def png(i):
    a = np.zeros((8, 8, 3), np.uint8); a[..., 0], a[..., 1], a[..., 2] = i % 256, i // 256, 60*(i % 3)
    b = io.BytesIO(); Image.fromarray(a).save(b, format='PNG'); return b.getvalue()

def add(tf, name, data):
    ti = tarfile.TarInfo(name); ti.size = len(data); tf.addfile(ti, io.BytesIO(data))

def write_tars(root, ids, n_tars, labels=None, writer='tarfile'):
    "The samples `ids` dealt in order into `n_tars` tars under `root` (`key.png` + `key.cls`, or `labels(i)` members)"
    root.mkdir(parents=True, exist_ok=True)
    ids = list(ids); per = max(1, -(-len(ids)//n_tars))
    for t in range(n_tars):
        part = ids[t*per:(t+1)*per]
        members = lambda i: {'png': png(i), **(labels(i) if labels else {'cls': str(i).encode()})}
        if writer == 'webdataset':
            import webdataset as wds
            with wds.TarWriter(str(root/f'{t:05d}.tar')) as w:
                for i in part: w.write({'__key__': f'sample{i:06d}', **members(i)})
        else:
            with tarfile.open(root/f'{t:05d}.tar', 'w', format=tarfile.PAX_FORMAT) as tf:
                for i in part:
                    for e,b in members(i).items(): add(tf, f'sample{i:06d}.{e}', b)
    return root

@pytest.fixture(scope='module')
def once_root(tmp_path_factory): return tmp_path_factory.mktemp('shards_once')

# One tar set per (n, n_tars), made once; every example builds a loader per shard and split. CI (the CPU backend)
# checks the examples written out and 60 derandomized ones; the GPU run the examples.
@example(n=1, bs=1, n_tars=1, k=1, shuffle=False, drop_last=False, seed=0)
@example(n=9, bs=2, n_tars=4, k=4, shuffle=False, drop_last=True, seed=13)
@example(n=37, bs=5, n_tars=3, k=2, shuffle=True, drop_last=False, seed=11)
@example(n=100, bs=7, n_tars=2, k=3, shuffle=True, drop_last=True, seed=12)
@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate) if DEVICE == 'cpu' else (Phase.explicit,),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, N_MAX), bs=st.integers(1, 32), n_tars=st.integers(1, 4), k=st.integers(1, 4),
       shuffle=st.booleans(), drop_last=st.booleans(), seed=st.integers(0, 2**31-2))
def test_exactly_once_over_shards(once_root, n, bs, n_tars, k, shuffle, drop_last, seed):
    n_valid = max(1, n//4)
    tr,va = once_root/f'{n}_{n_tars}'/'train',once_root/f'{n}_{n_tars}'/'valid'
    if not tr.exists(): write_tars(tr, range(n), n_tars); write_tars(va, range(1000, 1000+n_valid), n_tars)
    shards = [DaliDataLoaders.from_shards(tr, valid=va, bs=bs, shuffle=shuffle, drop_last=drop_last, shard_id=s,
                                          num_shards=k, seed=seed, vocab=VOCAB, **KW) for s in range(k)]
    valid = list(range(1000, 1000+n_valid))
    assert [int(s.key[6:]) for s in shards[0].valid_ds.items] == valid   # items in shard order
    got = gathered_valid(shards)
    assert got[:len(valid)] == valid and len(got) - len(valid) < k, (n, bs, k)
    orders = []
    for ep in range(2):
        seen = []
        for d in shards:
            px,lb,sizes = epoch_ids(d.train)
            assert px == lb and len(sizes) == len(d.train) == len(shards[0].train)
            if drop_last: assert all(s == bs for s in sizes)
            seen += px
        assert set(seen) <= set(range(n)) and len(seen) - len(set(seen)) < k, (n, bs, k, shuffle, drop_last, ep)
        if not drop_last: assert set(seen) == set(range(n)) and len(seen) == -(-n//k)*k, (n, bs, k, shuffle, ep)
        orders.append(seen)
    if shuffle and n >= 12 and len(orders[0]) > 1:   # a new permutation each epoch (two equal: below 1e-8)
        assert orders[0] != orders[1]
        if DEVICE == 'cpu':   # the same seed the same order on every shard, another seed another one
            again = [i for s in range(k) for i in epoch_ids(DaliDataLoaders.from_shards(
                tr, valid=va, bs=bs, shuffle=True, drop_last=drop_last, shard_id=s, num_shards=k, seed=seed, vocab=VOCAB, **KW).train)[0]]
            other = [i for s in range(k) for i in epoch_ids(DaliDataLoaders.from_shards(
                tr, valid=va, bs=bs, shuffle=True, drop_last=drop_last, shard_id=s, num_shards=k, seed=seed+1, vocab=VOCAB, **KW).train)[0]]
            assert again == orders[0] and other != orders[0]
    if not shuffle and not drop_last and k == 1:   # unshuffled training: shard order
        assert orders[0] == list(range(n))

@pytest.fixture(scope='module')
def id_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp('id_shards')
    cls = lambda i: {'cls': str(i % 3).encode()}   # the class: the id modulo 3 (the id: in the pixels)
    return write_tars(root/'train', range(30), 3, labels=cls),write_tars(root/'valid', range(500, 511), 2, labels=cls)

def test_learner_in_shard_order(id_shards):
    "fit, get_preds, a test_dl over shards and tta: every item once, validation in shard order"
    tr,va = id_shards
    dls = DaliDataLoaders.from_shards(tr, valid=va, bs=4, **KW)
    assert list(dls.vocab) == [0, 1, 2]   # fastai's sorted vocab of the training labels
    learn = Learner(dls, IdNet(n_cls=3), loss_func=IdLoss())
    with learn.no_bar(): learn.fit(1)
    preds,_ = learn.get_preds()
    assert preds[:, -1].long().tolist() == list(range(500, 511))
    tdl = dls.test_dl(shard_samples(va)[:7])
    tp,_ = learn.get_preds(dl=tdl)
    assert tp[:, -1].long().tolist() == list(range(500, 507))
    tta,_ = learn.tta(n=2)
    assert tta[:, -1].round().long().tolist() == list(range(500, 511))

def test_same_pixels_as_the_folder(tmp_path):
    "write_shards of a folder: the same items, order, vocab and batches as ImageDataLoaders on the folder"
    from fastai_dali.samples import make_image_folder
    src = make_image_folder(tmp_path/'photos', n_train=5, n_valid=3, classes=('chelsea', 'coffee', 'rocket'), min_size=37, max_size=71)
    res = write_shards(src, tmp_path/'shards', per_shard=4, progress=False)
    assert [len(v) for v in res.values()] == [4, 3]   # 15 and 9 images: 4 + 3 tars
    dls = DaliDataLoaders.from_shards(tmp_path/'shards'/'train', valid=tmp_path/'shards'/'valid', item_tfms=Resize(24), bs=4, **KW)
    fdls = ImageDataLoaders.from_folder(src, item_tfms=Resize(24), bs=4, device=DEVICE, num_workers=0)
    assert list(dls.vocab) == list(fdls.vocab) and len(dls.train_ds) == 15
    d = torch.cat([plain(x).float() for x,_ in dls.valid]); f = torch.cat([plain(x).float() for x,_ in fdls.valid])
    dy = torch.cat([plain(y) for _,y in dls.valid]); fy = torch.cat([plain(y) for _,y in fdls.valid])
    assert torch.equal(dy, fy)
    # the same JPEG bytes as the folder's files, decoded by the same decoder: the folder loader's own pixels
    folder = DaliDataLoaders.from_folder(src, item_tfms=Resize(24), bs=4, **KW)
    g = torch.cat([plain(x).float() for x,_ in folder.valid])
    assert (d - g).abs().mean() == 0
    assert (d - f).abs().mean() < 2/255   # fastai's PIL decoding of the same images (JPEG decoders differ slightly)

def test_index_written_once(tmp_path):
    tr = write_tars(tmp_path/'train', range(6), 2)
    shard_indexes(tr)
    assert sorted(p.name for p in tr.iterdir()) == ['00000.idx', '00000.idx.json', '00000.tar', '00001.idx', '00001.idx.json', '00001.tar']
    first = (tr/'00000.idx').read_text()
    assert first.split('\n')[0] == 'v1.2 3' and first.split('\n')[1].startswith('png ')
    m = os.stat(tr/'00000.idx').st_mtime_ns
    with warnings.catch_warnings(): warnings.simplefilter('error'); shard_indexes(tr)   # read, not rebuilt: no warning
    assert os.stat(tr/'00000.idx').st_mtime_ns == m
    write_tars(tr, range(10, 14), 1)   # 00000.tar replaced: indexed again, said so
    with pytest.warns(UserWarning, match='changed since they were indexed'): (ix, _) = shard_indexes(tr)
    assert list(ix.samples) == [f'sample{i:06d}' for i in range(10, 14)]

def test_read_only_shards_index_in_cache(tmp_path):
    tr = write_tars(tmp_path/'train', range(4), 1)
    (ix,) = shard_indexes(tr, cache_dir=tmp_path/'cache')
    assert len(ix) == 4 and not (tr/'00000.idx').exists() and len(list((tmp_path/'cache').glob('00000-*.idx'))) == 1
    write_tars(tr, range(10, 13), 1)   # changed: indexed again there, and said so
    with pytest.warns(UserWarning, match='changed since they were indexed'): (ix,) = shard_indexes(tr, cache_dir=tmp_path/'cache')
    assert len(ix) == 3

def test_webdataset_package_and_tarfile_read_alike(tmp_path):
    a = write_tars(tmp_path/'a', range(9), 2, writer='tarfile')
    b = write_tars(tmp_path/'b', range(9), 2, writer='webdataset')
    sa,sb = shard_samples(a),shard_samples(b)
    assert [s.key for s in sa] == [s.key for s in sb] and [read_sample(s) for s in sa] == [read_sample(s) for s in sb]
    dls = DaliDataLoaders.from_shards(b, valid=a, bs=4, shuffle=False, **KW)
    assert epoch_ids(dls.train)[0] == list(range(9)) == epoch_ids(dls.valid)[0]

def test_multi_label_json(tmp_path):
    lab = lambda i: {'json': json.dumps({'tags': ['odd' if i % 2 else 'even'] + (['three'] if i % 3 == 0 else [])}).encode()}
    tr = write_tars(tmp_path/'train', range(12), 2, labels=lab); va = write_tars(tmp_path/'valid', range(100, 106), 1, labels=lab)
    dls = DaliDataLoaders.from_shards(tr, valid=va, label='json', get_y=lambda d: d['tags'], bs=3, **KW)
    assert list(dls.vocab) == ['even', 'odd', 'three']
    ys = torch.cat([plain(y) for _,y in dls.valid])
    want = torch.tensor([[i % 2 == 0, i % 2 == 1, i % 3 == 0] for i in range(100, 106)]).float()
    assert torch.equal(ys.float(), want)
    with pytest.raises(ValueError, match="label='json' needs get_y"): DaliDataLoaders.from_shards(tr, valid=va, label='json', **KW)

def test_export_and_predict(tmp_path):
    from fastai.learner import load_learner
    tr = write_tars(tmp_path/'train', range(12), 2, labels=lambda i: {'cls': str(i % 3).encode()})
    va = write_tars(tmp_path/'valid', range(100, 106), 1, labels=lambda i: {'cls': str(i % 3).encode()})
    dls = DaliDataLoaders.from_shards(tr, valid=va, bs=3, **KW)
    learn = Learner(dls, IdNet(n_cls=3), loss_func=IdLoss())
    with learn.no_bar(): learn.fit(1)
    learn.export(tmp_path/'model.pkl')
    f = tmp_path/'one.png'; f.write_bytes(png(4))
    learn2 = load_learner(tmp_path/'model.pkl')
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); p1,p2 = learn.predict(f),learn2.predict(f)
    assert p1[0] == p2[0] and torch.allclose(p1[2], p2[2], atol=1e-5)

def _tar(root, members):
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root/'00000.tar', 'w', format=tarfile.PAX_FORMAT) as tf:
        for name,data in members: add(tf, name, data)
    return root

def test_bad_shards_named(tmp_path):
    good = write_tars(tmp_path/'good', range(4), 1)
    (tmp_path/'nota').mkdir(); (tmp_path/'nota'/'00000.tar').write_bytes(b'not a tar' * 200)
    with pytest.raises(ValueError, match=r'nota/00000.tar: not a tar archive'): DaliDataLoaders.from_shards(tmp_path/'nota', valid=good, **KW)
    t = (good/'00000.tar').read_bytes()   # a shard cut short at a block's edge: no sample left out silently
    with tarfile.open(good/'00000.tar') as tf: end = [m for m in tf][-1] and tf.offset   # (where the end-of-archive block starts)
    for cut in (len(t)//2//512*512, end):   # (inside a member; right after the last member)
        (tmp_path/'cut').mkdir(exist_ok=True); (tmp_path/'cut'/'00000.tar').write_bytes(t[:cut])
        with pytest.raises(ValueError, match=r'cut/00000.tar: (truncated|not a tar archive)'): DaliDataLoaders.from_shards(tmp_path/'cut', valid=good, cache_dir=tmp_path/'c', **KW)
    noimg = _tar(tmp_path/'noimg', [('a.png', png(1)), ('a.cls', b'1'), ('b.cls', b'2')])
    with pytest.raises(ValueError, match=r"noimg/00000.tar: sample 'b' has no image"): DaliDataLoaders.from_shards(noimg, valid=good, **KW)
    with pytest.warns(UserWarning, match='1 sample'):
        dls = DaliDataLoaders.from_shards(noimg, valid=noimg, on_error='skip', **KW)
    assert [s.key for s in dls.train_ds.items] == ['a']
    nolab = _tar(tmp_path/'nolab', [('a.png', png(1)), ('a.cls', b'1'), ('b.png', png(2))])
    with pytest.raises(ValueError, match=r"nolab/00000.tar: sample 'b' has no .cls member"): DaliDataLoaders.from_shards(nolab, valid=good, **KW)
    with pytest.raises(FileNotFoundError, match='no shards found'): DaliDataLoaders.from_shards(tmp_path/'x-*.tar', valid=good, **KW)
    # a label the vocab does not have: the item named by its shard and key
    with pytest.raises(ValueError, match=r"good/00000.tar: sample 'sample000003' has the label 3, which is not in the vocab"):
        DaliDataLoaders.from_shards(good, valid=good, vocab=[0, 1, 2], **KW)
    less = write_tars(tmp_path/'less', range(2), 1)   # a validation class missing from train: named by fastai_dali
    with pytest.raises(ValueError, match=r'good/00000.tar:sample000002.png\) is not in the vocab'):
        DaliDataLoaders.from_shards(less, valid=good, **KW)
    # a corrupt JPEG inside a shard: named with its shard and key when it is read
    jpg = io.BytesIO(); Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(jpg, format='JPEG'); jpg = jpg.getvalue()
    bad = _tar(tmp_path/'badjpg', [('a.jpg', jpg), ('a.cls', b'0'), ('b.jpg', jpg[:len(jpg)//2]), ('b.cls', b'0')])
    dls = DaliDataLoaders.from_shards(bad, valid=bad, bs=2, shuffle=False, **KW)
    with pytest.raises(DaliReadError, match=r'badjpg/00000.tar:b.jpg'): list(dls.train)

@pytest.mark.skipif(DEVICE != 'cpu', reason='CPU processes only (gloo), as test_distributed.py')
@pytest.mark.parametrize('world,store', [(2, 'disk'), (3, 'disk'), (2, 's3')])
def test_shards_across_ranks(tmp_path, world, store):
    "2 and 3 CPU processes under torchrun: each rank its share of the samples, exactly once, validation gathered in shard order; from a local S3 server too (each shard read in full by one rank)"
    import contextlib, subprocess, sys
    from pathlib import Path
    from fastai_dali.storage import local_s3_server, s3_upload
    pytest.importorskip('accelerate')
    cls = lambda i: {'cls': str(i % 3).encode()}
    write_tars(tmp_path/'shards'/'train', range(17), 3, labels=cls); write_tars(tmp_path/'shards'/'valid', range(500, 511), 2, labels=cls)
    (tmp_path/'out').mkdir()
    with (local_s3_server('ranks') if store == 's3' else contextlib.nullcontext()):
        if store == 's3':
            for f in (tmp_path/'shards').rglob('*.tar'): s3_upload(f, f"s3://ranks/{f.relative_to(tmp_path/'shards').as_posix()}")
        env = {**os.environ, 'ACCELERATE_USE_CPU': '1', 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore', 'XDG_CACHE_HOME': str(tmp_path/'cache')}
        r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(world),
                            str(Path(__file__).parent/'shards_worker.py'), 's3://ranks' if store == 's3' else str(tmp_path/'shards'),
                            str(tmp_path/'out')], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    if r.returncode: pytest.fail(f"exit {r.returncode}\n{r.stderr[-6000:]}", pytrace=False)
    res = [json.loads((tmp_path/'out'/f'rank{i}.json').read_text()) for i in range(world)]
    assert [o['rank'] for o in res] == list(range(world)) and all(o['loaders'] == 4 and o['valid'] == 11 for o in res)
    if store == 's3':   # (the ranks share a cache: each shard read in full once, by one of them)
        scans = sorted(t for o in res for t in o['scans'])
        assert scans == sorted(f"s3://ranks/{f.relative_to(tmp_path/'shards').as_posix()}" for f in (tmp_path/'shards').rglob('*.tar')), scans

def test_worker_processes(id_shards):
    "The default: `get_x` (reading the shards) in DALI's spawned worker processes; one shuffled epoch, every sample once"
    tr,va = id_shards
    dls = DaliDataLoaders.from_shards(tr, valid=va, bs=4, device=DEVICE, num_threads=1, py_workers=2, seed=3)
    px,_,sizes = epoch_ids(dls.train)
    assert len(px) == 28 and len(set(px)) == 28 and set(px) <= set(range(30))   # drop_last: 7 full batches of 30

@pytest.mark.parametrize('command', ['fastai-dali-shards', 'fastai-dali shards'])
def test_shards_command(tmp_path, capsys, command):
    "`fastai-dali-shards FOLDER OUT --per-shard N` (and the same through `fastai-dali shards`), as the console command calls it; a missing folder: its message and exit status 2"
    from fastai_dali.bench import cli
    from fastai_dali.shards import shards_main
    from fastai_dali.samples import make_image_folder
    run = shards_main if command == 'fastai-dali-shards' else (lambda args: cli(['shards', *args]))
    src = make_image_folder(tmp_path/'photos', n_train=3, n_valid=2, classes=('coffee', 'rocket'))
    assert run([str(src), str(tmp_path/'out'), '--per-shard', '4']) is None   # (a console script exits 0 on None)
    assert 'train: 2 shard(s), valid: 1 shard(s)' in capsys.readouterr().out
    assert json.loads((tmp_path/'out'/'vocab.json').read_text()) == ['coffee', 'rocket']
    with pytest.raises(SystemExit) as e: run([str(tmp_path/'nope'), str(tmp_path/'out2')])
    assert e.value.code == 2 and 'does not exist' in capsys.readouterr().err

def test_skip_unreadable_in_shards(tmp_path):
    "on_error='skip' as for folders: a truncated JPEG inside a shard is left out, named by its shard and key, the split kept"
    jpg = io.BytesIO(); Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(jpg, format='JPEG'); jpg = jpg.getvalue()
    tr = _tar(tmp_path/'train', [(f'{k}.jpg', jpg if k != 'b' else jpg[:len(jpg)//2]) for k in 'abc'] + [(f'{k}.cls', b'0') for k in 'abc'])
    va = _tar(tmp_path/'valid', [('v.jpg', jpg), ('v.cls', b'0')])
    with pytest.warns(UserWarning, match=r"(?s)left out 1 of 4 images.*train/00000.tar:b.jpg"):
        dls = DaliDataLoaders.from_shards(tr, valid=va, on_error='skip', bs=1, **KW)
    assert [s.key for s in dls.train_ds.items] == ['a', 'c'] and [s.key for s in dls.valid_ds.items] == ['v']

@pytest.mark.skipif(DEVICE != 'cpu', reason="how 'spawn' imports a script: a CPU run's, CI runs this")
@pytest.mark.parametrize('how', ['file', 'stdin'])
def test_top_level_script_writes_and_reads_shards(tmp_path, how):
    "A plain script without `if __name__ == '__main__':` (a file, or code piped to `python -`, which spawned processes cannot import at all) writes shards (asking for worker processes) and reads them with DALI's worker processes asked for too: both run in its own process, with no error, and each says so once"
    import subprocess, sys, textwrap
    script = tmp_path/'shards.py'
    script.write_text(textwrap.dedent(f'''
        from pathlib import Path
        from fastai.vision.all import *
        from fastai_dali.all import *
        from fastai_dali.samples import make_image_folder
        path = make_image_folder(Path({str(tmp_path)!r})/'p', n_train=6, n_valid=2, classes=('coffee', 'rocket'))
        res = write_shards(path, Path({str(tmp_path)!r})/'s', per_shard=2, progress=False, procs=2)
        dls = DaliDataLoaders.from_shards(res['train'], valid=res['valid'], item_tfms=Resize(16), bs=2, device='cpu', py_workers=2)
        x,y = dls.one_batch()
        import multiprocessing
        print('shards', len(res['train']), len(res['valid']), 'batch', tuple(x.shape), 'workers', len(multiprocessing.active_children()))
        '''))
    run = dict(file=dict(args=[sys.executable, str(script)]), stdin=dict(args=[sys.executable, '-'], input=script.read_text()))[how]
    r = subprocess.run(capture_output=True, text=True, timeout=300, cwd=tmp_path, **run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == 'shards 6 2 batch (2, 3, 16, 16) workers 0', r.stdout
    said = dict(file="outside `if __name__ == '__main__':`", stdin="read from standard input (<stdin>)")[how]
    assert r.stderr.count(said) == 2 and r.stderr.count('`write_shards`') == 1, r.stderr[-3000:]

def test_workers_import_neither_torch_nor_fastai(tmp_path):
    "DALI's worker processes unpickle `from_shards`' per-batch source (an `EpochSource` over a `ShardSource`) and read its samples without importing torch or fastai (each took seconds to start with them); the bytes are the shard's"
    import hashlib
    from fastai_dali.sources import ShardSource
    from conftest import seen_by_a_worker
    tars = write_tars(tmp_path/'train', range(6), 2, labels=lambda i: {'cls': str(i % 2).encode()})
    dls = DaliDataLoaders.from_shards(tars, valid=tars, item_tfms=Resize(8), bs=2, **KW)
    src = dls.train.dali_inputs().python
    assert isinstance(src, ShardSource), type(src)
    assert seen_by_a_worker(src, 5) == ['6', hashlib.md5(read_sample(dls.train.items[5])).hexdigest(), 'False', 'False']
    assert read_sample(dls.train.items[5]) == png(5)

def test_rewrite_with_fewer_shards_warns(tmp_path):
    "Writing fewer shards over a folder that holds more: the ones left from before (which `from_shards` of the folder would read too) are named"
    from fastai_dali.samples import make_image_folder
    src = make_image_folder(tmp_path/'photos', n_train=6, n_valid=2, classes=('coffee', 'rocket'))
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # (the first write, and the same write again: nothing left over, no warning)
        write_shards(src, tmp_path/'out', per_shard=2, progress=False); write_shards(src, tmp_path/'out', per_shard=2, progress=False)
    with pytest.warns(UserWarning, match=r"^4 shard\(s\) under .*out were not written now .* e\.g\. .*out/train/00003\.tar"):
        res = write_shards(src, tmp_path/'out', per_shard=5, progress=False)
    assert [len(v) for v in res.values()] == [3, 1]
