"""`ResumeCallback` as users meet it: a training script killed (SIGKILL) mid-epoch, run again, goes on from its last
checkpoint and gives the batches and the weights of the run that was not interrupted (DALI's CPU backend: equal to the
bit), for a folder, a `get_x` giving bytes, and shards; a control whose loader restarts its epoch must differ."""
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from fastai_dali.samples import make_image_folder

SCRIPT = Path(__file__).with_name('resume_script.py')

@pytest.fixture(scope='module')
def root(tmp_path_factory):
    r = make_image_folder(tmp_path_factory.mktemp('resume')/'data', n_train=10, n_valid=3, min_size=40, max_size=70, seed=2)
    from fastai_dali.shards import write_shards
    write_shards(r, r/'shards', per_shard=12, progress=False)
    return r

def run(root, out, source, kill=None, **env):
    r = subprocess.run([sys.executable, str(SCRIPT), str(root), str(out), source] + ([kill] if kill else []),
                       capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    return r

def records(out): return [json.loads(l) for l in (out/'batches.jsonl').read_text().splitlines()]
def weights(out): return torch.load(out/'final.pth')
def same_weights(a, b): return all(torch.equal(a[k], b[k]) for k in a)

@pytest.mark.parametrize('source', ['folder', 'mixed', 'shards'])
def test_killed_and_resumed_as_uninterrupted(root, tmp_path, source):
    ref = run(root, tmp_path/'ref', source); assert ref.returncode == 0, ref.stderr[-3000:]
    a = records(tmp_path/'ref')
    killed = run(root, tmp_path/'run', source, kill='1,3')
    assert killed.returncode == -9, killed.stderr[-3000:]   # (SIGKILL: no `after_fit`, no cleanup)
    n_before = len(records(tmp_path/'run'))
    again = run(root, tmp_path/'run', source); assert again.returncode == 0, again.stderr[-3000:]
    b = records(tmp_path/'run')[n_before:]
    # it went on from the last checkpoint (every 3 batches: after batch 2 of epoch 1), not from the epoch's start
    assert b[0][:2] == [1, 3], b[0]
    assert b == a[len(a)-len(b):]                        # the same items, the same draws, from there on
    assert same_weights(weights(tmp_path/'run'), weights(tmp_path/'ref'))

@pytest.mark.parametrize('fit', ['fine_tune', 'own_cbs'])
def test_second_fit_resumed(root, tmp_path, fit):
    "Two fits (`fine_tune`; or two `fit_one_cycle`s, each given a new `ResumeCallback`): killed in the second, the script run again skips the first (its weights loaded) and goes on in the second"
    ref = run(root, tmp_path/'ref', 'folder', FIT=fit); assert ref.returncode == 0, ref.stderr[-3000:]
    a = records(tmp_path/'ref')
    killed = run(root, tmp_path/'run', 'folder', kill='1,3', FIT=fit); assert killed.returncode == -9, killed.stderr[-3000:]
    n_before = len(records(tmp_path/'run'))
    again = run(root, tmp_path/'run', 'folder', FIT=fit); assert again.returncode == 0, again.stderr[-3000:]
    b = records(tmp_path/'run')[n_before:]
    assert b[0][:2] == [1, 3] and len(a) == n_before - 1 + len(b) and b == a[len(a)-len(b):]
    assert same_weights(weights(tmp_path/'run'), weights(tmp_path/'ref'))

def test_control_restarting_the_epoch_differs(root, tmp_path):
    ref = run(root, tmp_path/'ref', 'folder'); assert ref.returncode == 0, ref.stderr[-3000:]
    run(root, tmp_path/'run', 'folder', kill='1,3')
    n_before = len(records(tmp_path/'run'))
    again = run(root, tmp_path/'run', 'folder', CONTROL='restart'); assert again.returncode == 0, again.stderr[-3000:]
    a,b = records(tmp_path/'ref'),records(tmp_path/'run')[n_before:]
    assert b != a[len(a)-len(b):]
    assert not same_weights(weights(tmp_path/'run'), weights(tmp_path/'ref'))

def run_ranks(root, out, kill=None, **env):
    "The script under torchrun on 2 CPU processes (gloo): its exit code"
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', str(SCRIPT), str(root), str(out), 'folder'] + ([kill] if kill else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, 'ACCELERATE_USE_CPU': '1', 'OMP_NUM_THREADS': '1', **env})

@pytest.fixture(scope='module')
def two_ranks_ref(root, tmp_path_factory):
    pytest.importorskip('accelerate')
    out = tmp_path_factory.mktemp('ranks_ref')
    ref = run_ranks(root, out); assert ref.returncode == 0, ref.stderr[-3000:]
    return out

@pytest.mark.parametrize('kill,at', [('1,3', [1, 3]), ('1,0', [1, 0])])   # (mid-epoch; right after an epoch's end)
def test_two_ranks_killed_and_resumed(root, two_ranks_ref, tmp_path, kill, at):
    "Under `distrib_ctx` on 2 CPU ranks: each rank goes on from its own checkpoint, with its batches as uninterrupted (every item once an epoch, as `test_distributed.py` checks of those)"
    killed = run_ranks(root, tmp_path/'run', kill=kill); assert killed.returncode != 0
    n_before = {r: len((tmp_path/'run'/f'batches.rank{r}.jsonl').read_text().splitlines()) for r in (0, 1)}
    again = run_ranks(root, tmp_path/'run'); assert again.returncode == 0, again.stderr[-3000:]
    for r in (0, 1):
        a = [json.loads(l) for l in (two_ranks_ref/f'batches.rank{r}.jsonl').read_text().splitlines()]
        b = [json.loads(l) for l in (tmp_path/'run'/f'batches.rank{r}.jsonl').read_text().splitlines()][n_before[r]:]
        assert b and b[0][:2] == at and b == a[len(a)-len(b):], (r, b[:2])
    assert same_weights(weights(tmp_path/'run'), weights(two_ranks_ref))
