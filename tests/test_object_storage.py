"""Shards in object storage (`from_shards('s3://...')`; nbs/03bb_storage.ipynb, 04d_shards.ipynb) against a real S3 server
started by the tests (moto's, in a process of its own: `local_s3_server`), nothing of ours mocked: the batches equal those of
the same shards on the local disk, epoch after epoch, through DALI's Python workers; a second open reads no tar; bad input
(a missing bucket or object, refused or missing credentials, an endpoint that refuses or never answers, a truncated tar,
an object replaced after it was indexed) raises naming the object, within a bounded wait, and never shows the secret."""
import json, os, socket, tempfile, urllib.request
from pathlib import Path
from types import SimpleNamespace
import pytest, torch
from fastai.vision.all import Resize, Normalize, imagenet_stats
from fastai_dali.data import DaliDataLoaders
from fastai_dali.samples import make_image_folder
from fastai_dali.shards import write_shards, ShardIndex, read_sample
from fastai_dali import storage
from fastai_dali.storage import local_s3_server, s3_client, s3_head
from conftest import DEVICE

def upload(folder, bucket):
    "The shards and the vocab of `folder` (as `write_shards` wrote them) into `bucket`, keyed by their paths in it"
    c = s3_client()
    for f in sorted(Path(folder).rglob('*')):
        if f.is_file() and (f.suffix == '.tar' or f.name == 'vocab.json'): c.upload_file(str(f), bucket, f.relative_to(folder).as_posix())

@pytest.fixture(scope='module')
def s3(tmp_path_factory):
    d = tmp_path_factory.mktemp('s3')
    r = make_image_folder(d/'data', n_train=10, n_valid=3, min_size=40, max_size=70, seed=2)
    write_shards(r, d/'shards', per_shard=12, progress=False)   # (4 training shards, 1 validation shard)
    with local_s3_server('shards') as url:
        upload(d/'shards', 'shards')
        yield SimpleNamespace(url=url, local=d/'shards', folder=r)

@pytest.fixture
def fresh_client():
    "A test that changes the environment's S3 settings: clients made from it, and none kept after"
    storage._clients.clear(); yield; storage._clients.clear()

KW = dict(item_tfms=Resize(32), batch_tfms=Normalize.from_stats(*imagenet_stats), bs=8, seed=0, device=DEVICE)

def batches(dl): return [(x.cpu().clone(), y.cpu().clone()) for x,y in dl]
def same(a, b): return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1,y1),(x2,y2) in zip(a, b))

@pytest.mark.parametrize('keep_local', [None, False])   # (copies on the local disk, where it has room; a request a sample)
def test_same_batches_as_the_local_disk(s3, tmp_path, keep_local):
    loc = DaliDataLoaders.from_shards(s3.local/'train', valid=s3.local/'valid', cache_dir=tmp_path/'local', py_workers=2, **KW)
    rem = DaliDataLoaders.from_shards('s3://shards/train/{00000..00003}.tar', valid='s3://shards/valid/', cache_dir=tmp_path/'s3',
                                      py_workers=2, keep_local=keep_local, **KW)
    copies = sorted((tmp_path/'s3'/'s3').glob('*.tar'))
    assert len(copies) == (5 if keep_local is None else 0)
    if copies: assert sorted(p.read_bytes() for p in copies) == sorted(p.read_bytes() for p in s3.local.rglob('*.tar'))
    assert [str(s).split('/')[-1] for s in rem.train_ds.items] == [str(s).split('/')[-1] for s in loc.train_ds.items]
    assert rem.vocab == loc.vocab and len(rem.train_ds) == 40 and len(rem.valid_ds) == 12   # (the vocab.json in the bucket)
    for _ in range(2): assert same(batches(rem.train), batches(loc.train))   # fastai's permutation, epoch after epoch
    assert same(batches(rem.valid), batches(loc.valid))
    assert batches(rem.train) != batches(loc.valid)   # (the control: other batches differ)
    # a glob, a folder and a brace pattern name the same objects
    from fastai_dali.shards import shard_paths
    tars = [f's3://shards/train/{i:05d}.tar' for i in range(4)]
    for p in ('s3://shards/train/*.tar', 's3://shards/train/', 's3://shards/train', 's3://shards/train/{00000..00003}.tar'): assert shard_paths(p) == tars

def test_written_straight_to_the_store(s3, tmp_path):
    "`write_shards` to `s3://`: each shard uploaded as written, the same bytes as on the local disk, and the vocab beside them"
    s3_client().create_bucket(Bucket='written')
    res = write_shards(s3.folder, 's3://written/imagenette/', per_shard=12, progress=False)
    assert res == {'train': [f's3://written/imagenette/train/{i:05d}.tar' for i in range(4)], 'valid': ['s3://written/imagenette/valid/00000.tar']}
    get = lambda k: s3_client().get_object(Bucket='written', Key=k)['Body'].read()
    assert all(get(u[len('s3://written/'):]) == (s3.local/s/u.rsplit('/', 1)[1]).read_bytes() for s,us in res.items() for u in us)
    assert json.loads(get('imagenette/vocab.json')) == json.loads((s3.local/'vocab.json').read_text())
    assert not list(Path(tempfile.gettempdir()).glob('fastai_dali_shard_*'))   # (no local copy left behind)

def test_second_open_reads_no_tar(s3, tmp_path, monkeypatch):
    first = DaliDataLoaders.from_shards('s3://shards/train/', valid='s3://shards/valid/', cache_dir=tmp_path, py_workers=0, **KW)
    idx = sorted((tmp_path/'s3').glob('*.idx'))
    assert len(idx) == 5
    side = json.loads(idx[0].with_name(idx[0].name + '.json').read_text())
    assert side['tar_etag'] in {s3_head(t)[1] for t in [f's3://shards/train/{i:05d}.tar' for i in range(4)] + ['s3://shards/valid/00000.tar']}
    def no_scan(tar): raise AssertionError(f'{tar} read whole again')
    monkeypatch.setattr(ShardIndex, 'scan_object', classmethod(lambda cls, tar: no_scan(tar)))   # (a tripwire: the second open must not read a tar)
    again = DaliDataLoaders.from_shards('s3://shards/train/', valid='s3://shards/valid/', cache_dir=tmp_path, py_workers=0, **KW)
    assert again.train_ds.items == first.train_ds.items
    monkeypatch.undo()

def test_object_replaced_after_indexing_named(s3, tmp_path):
    c = s3_client(); c.create_bucket(Bucket='replaced')
    tar = (s3.local/'train'/'00000.tar').read_bytes()
    c.put_object(Bucket='replaced', Key='train/00000.tar', Body=tar); c.put_object(Bucket='replaced', Key='valid/00000.tar', Body=tar)
    dls = DaliDataLoaders.from_shards('s3://replaced/train/', valid='s3://replaced/valid/', cache_dir=tmp_path, py_workers=2, keep_local=False, **KW)
    kept = DaliDataLoaders.from_shards('s3://replaced/train/', valid='s3://replaced/valid/', cache_dir=tmp_path/'kept', py_workers=0, **KW)
    before = [read_sample(o) for o in kept.train_ds.items]
    assert len(batches(dls.train)) == 1   # (12 samples, bs 8: the training loader drops the last, short batch)
    im = ShardIndex.scan(s3.local/'train'/'00000.tar').images
    changed = bytearray(tar); changed[im.offsets[0] + im.sizes[0]//2] ^= 0xFF   # (a byte of an image's data: the same tar, another version)
    c.put_object(Bucket='replaced', Key='train/00000.tar', Body=bytes(changed))
    with pytest.raises(Exception, match=r's3://replaced/train/00000.tar: the object changed after it was indexed'): batches(dls.train)
    assert [read_sample(o) for o in kept.train_ds.items] == before and len(batches(kept.train)) == 1   # (from its local copy: the version indexed)
    with pytest.warns(UserWarning, match='changed since they were indexed'):   # opened again: indexed anew, and read
        dls = DaliDataLoaders.from_shards('s3://replaced/train/', valid='s3://replaced/valid/', cache_dir=tmp_path, py_workers=0, **KW)
    assert len(batches(dls.train)) == 1   # (12 samples, bs 8: the training loader drops the last, short batch)

def test_missing_and_truncated_named(s3, tmp_path):
    kw = dict(cache_dir=tmp_path, py_workers=0, **KW)
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket/train/: the bucket 'no-such-bucket' does not exist"):
        DaliDataLoaders.from_shards('s3://no-such-bucket/train/*.tar', valid='s3://shards/valid/', **kw)
    with pytest.raises(FileNotFoundError, match=r's3://shards/train/00004.tar: no such object or shards \(3 of the 7 parts'):
        DaliDataLoaders.from_shards('s3://shards/train/{00000..00006}.tar', valid='s3://shards/valid/', **kw)
    with pytest.raises(FileNotFoundError, match="no shards found at 's3://shards/train/x-\\*.tar'"):
        DaliDataLoaders.from_shards('s3://shards/train/x-*.tar', valid='s3://shards/valid/', **kw)
    c = s3_client(); c.create_bucket(Bucket='cut')
    tar = (s3.local/'train'/'00000.tar').read_bytes()
    c.put_object(Bucket='cut', Key='train/00000.tar', Body=tar[:len(tar)//2 + 100])
    with pytest.raises(ValueError, match=r's3://cut/train/00000.tar: (truncated|not a whole tar archive)'):
        DaliDataLoaders.from_shards('s3://cut/train/', valid='s3://shards/valid/', **kw)

def test_credentials_refused_or_missing_named(tmp_path, monkeypatch, fresh_client):
    secret = 'sEcReT-KeY-0123456789'
    with local_s3_server('locked') as url:
        c = s3_client(); c.put_object(Bucket='locked', Key='train/00000.tar', Body=b'\0' * 1024)
        req = urllib.request.Request(url + '/moto-api/reset-auth', data=b'0', headers={'Content-Type': 'text/plain'}, method='POST')
        urllib.request.urlopen(req).read()   # (moto checks credentials from now on: ours are no IAM user's)
        monkeypatch.setenv('AWS_SECRET_ACCESS_KEY', secret); storage._clients.clear()
        with pytest.raises(PermissionError, match='s3://locked/train/00000.tar: access denied') as e:
            DaliDataLoaders.from_shards('s3://locked/train/00000.tar', valid='s3://locked/train/00000.tar', cache_dir=tmp_path, **KW)
        assert secret not in str(e.value) and not any(secret in f.read_text(errors='ignore') for f in tmp_path.rglob('*') if f.is_file())
        for k in ('AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'AWS_SESSION_TOKEN', 'AWS_PROFILE'): monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv('AWS_SHARED_CREDENTIALS_FILE', str(tmp_path/'none')); monkeypatch.setenv('AWS_CONFIG_FILE', str(tmp_path/'none'))
        monkeypatch.setenv('AWS_EC2_METADATA_DISABLED', 'true'); storage._clients.clear()
        with pytest.raises(PermissionError, match='s3://locked/train/00000.tar: no AWS credentials found'):
            DaliDataLoaders.from_shards('s3://locked/train/00000.tar', valid='s3://locked/train/00000.tar', cache_dir=tmp_path, **KW)

@pytest.mark.parametrize('endpoint', ['refusing', 'silent'])
def test_unreachable_endpoint_named_in_bounded_time(tmp_path, monkeypatch, fresh_client, endpoint):
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
        if endpoint == 'silent': s.listen(8)   # (connections wait in its queue: a server that never answers)
        else: s.close()
        monkeypatch.setenv('AWS_ENDPOINT_URL', f'http://127.0.0.1:{port}')
        for k,v in dict(AWS_ACCESS_KEY_ID='testing', AWS_SECRET_ACCESS_KEY='testing', AWS_DEFAULT_REGION='us-east-1').items(): monkeypatch.setenv(k, v)
        with pytest.raises(ConnectionError, match=rf's3://shards/train/00000.tar: the S3 endpoint http://127.0.0.1:{port} did not answer'):
            DaliDataLoaders.from_shards('s3://shards/train/00000.tar', valid='s3://shards/valid/', cache_dir=tmp_path, **KW)
        # the bound is the client's (`S3_TIMEOUTS`: 3 s to connect, 10 s to answer, 3 tries in all), checked, not timed: the
        # wait on a loaded machine is no test's business (CONTRIBUTING: no timing in a test)
        cfg = storage.s3_client().meta.config
        assert (cfg.connect_timeout, cfg.read_timeout, cfg.retries) == (3, 10, {'total_max_attempts': 3, 'mode': 'standard'}), vars(cfg)

@pytest.mark.parametrize('keep_local', [None, False])
def test_local_and_object_shards_together(s3, tmp_path, keep_local):
    "Shards on the disk and in the store in one loader: each read where it is"
    tars = [f'{i:05d}.tar' for i in range(4)]
    mixed = DaliDataLoaders.from_shards([str(s3.local/'train'/t) if i % 2 == 0 else f's3://shards/train/{t}' for i,t in enumerate(tars)],
                                        valid='s3://shards/valid/', cache_dir=tmp_path/'m', py_workers=2, keep_local=keep_local, **KW)
    loc = DaliDataLoaders.from_shards([s3.local/'train'/t for t in tars], valid=s3.local/'valid',
                                      cache_dir=tmp_path/'l', py_workers=2, **KW)
    assert same(batches(mixed.train), batches(loc.train)) and same(batches(mixed.valid), batches(loc.valid))

def test_patterns_name_every_part(s3):
    from fastai_dali.shards import shard_paths
    with pytest.raises(FileNotFoundError, match=r"s3://shards/valdi/\*.tar: no such object or shards"): shard_paths('s3://shards/{train,valdi}/*.tar')
    with pytest.raises(FileNotFoundError, match=r"s3://shards/valid/00009.tar: no such object or shards"): shard_paths('s3://shards/valid/{00000,00009}.tar')
    with pytest.raises(ValueError, match='braces inside braces'): shard_paths('s3://shards/train/{00000,{00001,00002}}.tar')
    assert shard_paths('s3://shards/{train,valid}') == [f's3://shards/train/{i:05d}.tar' for i in range(4)] + ['s3://shards/valid/00000.tar']

def test_damaged_copy_fetched_again(s3, tmp_path):
    kw = dict(valid='s3://shards/valid/', cache_dir=tmp_path, py_workers=0, **KW)
    DaliDataLoaders.from_shards('s3://shards/train/', **kw)
    c = sorted((tmp_path/'s3').glob('*.tar'))[0]; whole = c.read_bytes()
    c.write_bytes(whole[:len(whole)//2])   # (cut short: a disk filled up, a copy interrupted by another program)
    DaliDataLoaders.from_shards('s3://shards/train/', **kw)
    assert c.read_bytes() == whole

def test_nothing_left_behind_when_writing_fails(s3, tmp_path):
    "`write_shards` to the store: an image that cannot be read raises, and no temporary shard stays on the disk"
    import shutil
    src = tmp_path/'photos'; shutil.copytree(s3.folder, src)
    victim = sorted((src/'train').rglob('*.jpg'))[0]; victim.unlink(); victim.symlink_to(tmp_path/'gone.jpg')   # (listed, unreadable)
    before = set(Path(tempfile.gettempdir()).glob('fastai_dali_shard_*'))
    s3_client().create_bucket(Bucket='failing')
    with pytest.raises(OSError): write_shards(src, 's3://failing/x', per_shard=12, progress=False, procs=1)
    assert set(Path(tempfile.gettempdir()).glob('fastai_dali_shard_*')) == before

def test_cache_without_locks_still_reads(s3, tmp_path, monkeypatch):
    "A cache on a disk that refuses locks (`flock`: ENOLCK, as NFS without its lock service): each shard read without the lock, the same batches"
    import errno, fcntl
    loc = DaliDataLoaders.from_shards(s3.local/'train', valid=s3.local/'valid', cache_dir=tmp_path/'local', py_workers=0, **KW)
    def refuse(f, op): raise OSError(errno.ENOLCK, 'No locks available')
    monkeypatch.setattr(fcntl, 'flock', refuse)
    rem = DaliDataLoaders.from_shards('s3://shards/train/', valid='s3://shards/valid/', cache_dir=tmp_path/'s3', py_workers=0, **KW)
    assert len(sorted((tmp_path/'s3'/'s3').glob('*.tar'))) == 5 and same(batches(rem.train), batches(loc.train))
