"""The training script of the tutorial "Training on several GPUs" (nbs/14_several_gpus.ipynb) learns: run as the
tutorial runs it in one process, on the same generated folder, with its defaults (resnet18 from scratch, 64 px, bs 16,
`fit_one_cycle` for 5 epochs, seed 42), it must end well above chance on `DaliDataLoaders` and on fastai's
`ImageDataLoaders`, and the two must be close. An earlier script (`fit(5, 1e-3)`, bs 64, 224 px) ended at chance,
0.25 to 0.40 on 4 classes, on both loaders. On the 2-core CPU machine (one torch thread, as the tutorial's commands
have with OMP_NUM_THREADS=1): accuracy 0.975 (DALI) and 0.925 (fastai), and over seeds 0 to 3, 0.900 to 0.975 (DALI),
0.875 to 0.975 (fastai); about 25 s for both."""
import importlib.util, json
from pathlib import Path
import pytest, torch

pytest.importorskip('accelerate', reason="the script imports fastai.distributed, which needs accelerate (the dev extra)")
NB = Path(__file__).parent.parent/'nbs'/'14_several_gpus.ipynb'
CHANCE = 0.25  # 4 classes

def tutorial_script():
    "The source of the script that the tutorial writes to `train.py`"
    for c in json.loads(NB.read_text())['cells']:
        s = ''.join(c['source'])
        if c['cell_type'] == 'code' and "script.write_text('''" in s:
            return s.split("script.write_text('''", 1)[1].split("'''.lstrip())", 1)[0].lstrip()
    raise AssertionError(f"no `script.write_text('''...''')` cell in {NB}")

def test_tutorial_script_learns(tmp_path):
    from fastai_dali.samples import make_image_folder
    script = tmp_path/'train.py'
    script.write_text(tutorial_script())
    spec = importlib.util.spec_from_file_location('several_gpus_train', script)
    train = importlib.util.module_from_spec(spec); spec.loader.exec_module(train)
    path = make_image_folder(tmp_path/'photos')  # as the tutorial: 4 classes, 40 training and 10 validation JPEGs each
    threads = torch.get_num_threads(); torch.set_num_threads(1)
    try:
        acc = {loader: train.main(path, loader=loader) for loader in ('fastai', 'dali')}
        control = train.main(path, loader='dali', lr=0.)   # (a run that cannot learn: the bound below must fail it)
    finally: torch.set_num_threads(threads)
    assert control < 3*CHANCE, f"a run that learns nothing passes the bound: {control}"
    # fastai's loaders on the same settings are the reference: the settings must learn with them (3 x chance), and
    # DaliDataLoaders must learn as well, up to the spread of seeds (0.1 apart at most over seeds 0 to 3 and 42)
    assert acc['fastai'] >= 3*CHANCE, f"the tutorial's settings do not learn on ImageDataLoaders: {acc}"
    assert acc['dali'] >= 3*CHANCE and acc['dali'] >= acc['fastai'] - 0.15, f"DaliDataLoaders learn less than fastai's: {acc}"
