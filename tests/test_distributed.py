"""Several processes: `DaliDataLoaders` under fastai's `distrib_ctx`, on DALI's CPU backend with gloo, as CI can run
them (2 cores). `distributed_worker.py` holds the checks each rank runs; here they are launched as users launch them."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from conftest import DEVICE, make_id_folder

HERE = Path(__file__).parent
pytest.importorskip('accelerate', reason="fastai's distributed training needs accelerate (the dev extra installs it)")
# Every process here runs on the CPU (gloo, DALI's CPU backend, `ACCELERATE_USE_CPU=1`) whatever the machine has: on a
# GPU machine these would repeat what CI checks on every commit, inside a GPU suite that must fit 8 minutes. Several
# GPUs are checked by `fastai-dali bench-gpus` (nbs/07b_bench_gpus.ipynb), on a machine that has them.
pytestmark = pytest.mark.skipif(DEVICE != 'cpu', reason='CPU processes only (gloo): CI runs these; several GPUs: fastai-dali bench-gpus')

def launch(cmd, tmp_path, timeout=600):
    root,out = make_id_folder(tmp_path/'ids', n_train=13, n_valid=11),tmp_path/'out'
    out.mkdir()
    env = {**os.environ, 'ACCELERATE_USE_CPU': '1', 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    r = subprocess.run([*cmd, str(HERE/'distributed_worker.py'), str(root), str(out)], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=tmp_path)
    if r.returncode != 0:  # the whole of each rank's error (an assertion's repr would be cut short)
        pytest.fail(f"exit {r.returncode}\n--- stdout:\n{r.stdout[-3000:]}\n--- stderr:\n{r.stderr[-8000:]}", pytrace=False)
    return [json.loads((out/f'rank{i}.json').read_text()) for i in range(2)]

def test_torchrun_two_processes(tmp_path):
    res = launch([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2'], tmp_path)
    assert [r['rank'] for r in res] == [0, 1] and all(r['loaders'] == 13*4 and r['train_epochs'] == 2 for r in res)
    assert all('disagree' in r['mismatch_error'] for r in res) and all(r['targets_checked'] == 11 for r in res)
    assert all(r['callback_losses'] > 0 for r in res)

def test_accelerate_launch(tmp_path):
    # `--cpu` would start one process only; `--multi_gpu` with ACCELERATE_USE_CPU=1 starts two, on gloo
    res = launch([sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
                  '--mixed_precision', 'no', '--dynamo_backend', 'no'], tmp_path)
    assert [r['rank'] for r in res] == [0, 1] and all(r['loaders'] == 13*4 for r in res)

def test_two_nodes(tmp_path):
    "Two launchers of one process each, as on two machines: RANK and LOCAL_RANK differ"
    import socket
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    root,out = make_id_folder(tmp_path/'ids', n_train=13, n_valid=11),tmp_path/'out'
    out.mkdir()
    env = {**os.environ, 'ACCELERATE_USE_CPU': '1', 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    cmd = lambda node: [sys.executable, '-m', 'torch.distributed.run', '--nnodes', '2', '--node_rank', str(node),
                        '--nproc_per_node', '1', '--master_addr', '127.0.0.1', '--master_port', str(port),
                        str(HERE/'distributed_worker.py'), str(root), str(out)]
    ps = [subprocess.Popen(cmd(node), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
          for node in (0, 1)]
    outs = [p.communicate(timeout=600) for p in ps]
    assert [p.returncode for p in ps] == [0, 0], [o[1][-4000:] for o in outs]
    res = [json.loads((out/f'rank{i}.json').read_text()) for i in range(2)]
    assert [(r['rank'], r['local_rank']) for r in res] == [(0, 0), (1, 0)] and all(r['loaders'] == 13*4 for r in res)

def test_bench_gpus_command(tmp_path):
    "`fastai-dali bench-gpus --device cpu`: 1 and 2 CPU processes, both trained on DALI's batches, every item id exact"
    from fastai_dali.bench.gpus import run_bench_gpus
    from fastai_dali.samples import make_image_folder
    path = make_image_folder(tmp_path/'photos', n_train=16, n_valid=8, classes=('astronaut', 'coffee', 'rocket'))
    res = run_bench_gpus(path, gpus=2, device='cpu', bs=8, size=64, arch='resnet18', epochs=1, batches=2, out=tmp_path/'out')
    s = res['summary']['per_process']
    assert sorted(s) == [1, 2] and s[1]['exact'] and s[2]['exact']
    assert [d[:2] for d in s[2]['devices']] == [(0, 'cpu'), (1, 'cpu')]
    assert all(s[k]['fit img/s, DaliDataLoaders'] > 0 and 0 <= s[k]['accuracy, DaliDataLoaders'] <= 1 for k in (1, 2))
    assert (tmp_path/'out'/'bench_gpus.md').read_text().startswith('### resnet18')
