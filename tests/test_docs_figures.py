"""The figures the Speed page quotes in its prose are the recorded ones: each, read from its JSON under docs/results and
written as the page writes it (img/s rounded, with thousands separators), appears in the page's text. A consistency
check between two files of the repository, not a measurement: nothing here depends on the machine that runs it."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT/'docs'/'results'

DALI = "DaliDataLoaders, a Learner's defaults (DaliFastPathCallback) + StepGraphCallback"
LIMIT = 'plain loop, synthetic, compiled graphs (the limit)'
# (the JSON under docs/results, the keys to the figure): the img/s the page quotes, by section
QUOTED = {
    'throughput/cpu2_bench.json': [('throughput', k, 'img_s') for k in (
        'raw DALI (hand-written: decode, resize, crop, normalize)', 'DaliDataLoaders train', 'DaliDataLoaders valid',
        'ImageDataLoaders train (2 workers)', 'DaliDataLoaders train + aug_transforms()',
        'ImageDataLoaders train + aug_transforms() (2 workers)')],
    'throughput/h200_bench.json': [('throughput', k, 'img_s') for k in (
        'raw DALI (hand-written: decode, resize, crop, normalize)', 'DaliDataLoaders train', 'ImageDataLoaders train (4 workers)',
        'ImageDataLoaders train (8 workers)', 'ImageDataLoaders train (16 workers)', 'DaliDataLoaders train + aug_transforms()',
        'raw DALI aug (hand-written)', 'DaliDataLoaders train, get_x -> bytes (external_source)',
        'DaliDataLoaders train, hw_decoder_load=1.0')],
    'training/h100_user_script.json': [('calls', 'D', f'rows{q}', 0, 'median_ips') for q in (8, 32)],   # the work queues' gain
    'training/h200_fit_limit.json': [('graphs_without_compile', a, k, 'median') for a in ('resnet18', 'resnet50')
                                     for k in (LIMIT, DALI, DALI + ', RandomResizedCrop + aug_transforms()')],
}

def page_text(nb):
    "The markdown of notebook `nb`, as one string"
    cells = json.loads((ROOT/'nbs'/nb).read_text(encoding='utf-8'))['cells']
    return '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')

def figure(res, keys):
    for k in keys: res = res[k]
    return res

@pytest.mark.parametrize('fn', sorted(QUOTED))
def test_speed_page_quotes_the_recorded_figures(fn):
    text,res = page_text('13_speed.ipynb'),json.loads((RESULTS/fn).read_text())
    missing = [(keys, f'{round(figure(res, keys)):,}') for keys in QUOTED[fn] if f'{round(figure(res, keys)):,}' not in text]
    assert not missing, f'{fn}: figures the Speed page does not quote as recorded: {missing}'
