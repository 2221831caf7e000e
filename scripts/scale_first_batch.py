"""Time to the first training batch and peak host memory of `ImageDataLoaders.from_folder` and
`DaliDataLoaders.from_folder` on an ImageNet-shaped folder of many small JPEGs, each loader in a fresh process.

    python scripts/scale_first_batch.py [--n 200000] [--classes 1000] [--root /tmp/scale_200000] [--device cpu]
        [--workers N] [--bs 256] [--repeats 1] [--trace DIR] [--shards N] [--mixed]

`--shards N`: also write the folder as WebDataset shards of N samples (`write_shards`, timed, in the machine's processes,
into ROOT_shards, index files removed) and add the rows `DaliDataLoaders.from_shards`, cold (it writes each shard's index
beside it) then warm (the next open, in a new process, reads them).
`--mixed`: also the row of a `DataBlock` whose `get_x` gives each file's bytes (`read_file_bytes`; DALI's Python worker
processes call it), labelled and split as `from_folder` is (`parent_label`, `GrandparentSplitter`), through
`dali_dataloaders`.

`--trace DIR`: each loader's process also writes `DIR/<loader>_profile.txt` (cProfile of the build and the first batch,
by cumulative then own time: its times are the profiler's, slower) and `DIR/<loader>_rss.txt` (the process's RSS every
5 ms, the highest at each line its main thread was on, in the order reached: where the memory comes from).

The folder (`train/` and `valid/`, one folder a class, 64 x 48 px JPEGs made with PIL from crops of scikit-image's
astronaut, ~1 validation image for 26 training ones) is written once, in parallel, and reused. Each row runs
`python scripts/scale_first_batch.py --one KIND ...` in a new process: imports (not counted), the loaders' build, the
first training batch; peak RSS of that process (and of its children: fastai's workers). Ratios are to
ImageDataLoaders in the same run. The rows are `fastai_dali.bench.scale`'s; `fastai-dali bench --sections scale` runs
them in the bench (with `get_image_files` alone and a second open of the folder), this script with a trace per loader.
"""

import argparse, os, time, tempfile
from fastai_dali.bench.scale import make_scale_folder, scale_rows, scale_markdown, scale_process


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--n', type=int, default=200_000); p.add_argument('--classes', type=int, default=1000)
    p.add_argument('--root'); p.add_argument('--device', default='cpu'); p.add_argument('--workers', type=int, default=os.cpu_count())
    p.add_argument('--bs', type=int, default=256); p.add_argument('--repeats', type=int, default=1); p.add_argument('--one')
    p.add_argument('--trace', help='a folder for each loader\'s profile and RSS trace (the times are then the profiler\'s)')
    p.add_argument('--shards', type=int, help='samples a shard: add the from_shards rows (shards written once, timed)')
    p.add_argument('--mixed', action='store_true', help="add the row of a get_x giving each file's bytes")
    a = p.parse_args()
    root = a.root or os.path.join(tempfile.gettempdir(), f'scale_{a.n}')
    kw = dict(device=a.device, workers=a.workers, bs=a.bs, trace=a.trace)
    if a.one: return scale_process(a.one, root, **kw)
    t = time.perf_counter(); make_scale_folder(root, a.n, a.classes); print(f'folder {root}: {time.perf_counter()-t:.1f} s')
    kinds = ['ImageDataLoaders', 'DaliDataLoaders'] + (['mixed'] if a.mixed else []) + (['from_shards (indexing)', 'from_shards (indexed)'] if a.shards else [])
    rows = scale_rows(root, kinds, repeats=a.repeats, shards=a.shards, **kw)
    print('\n' + scale_markdown(rows))


if __name__ == '__main__': main()
