"""Where the first batch of a warm open goes: DALI's own start against ours.

    python scripts/first_batch_trace.py ROOT OUT [cuda|cpu]

ROOT: a folder with `train/` and `valid/` class folders (e.g. `make_scale_folder`). Each row runs in a new process
(one JSON line each, into OUT/first_batch_trace.jsonl):
- `torch CUDA`: torch's CUDA start alone (every row below pays it first, not timed there);
- `DALI, 256 files` / `DALI, every file`: a hand-written pipeline (file reader, decoder, resize, crop and normalize,
  the work of the loaders' `Resize(32)`) over 256 of the training files, then over all of them (a file list, as
  `DaliDataLoaders` gives its reader): built, then its first batch — DALI's own start, and how it grows with the list;
- `DaliDataLoaders.from_folder`: the open (the folder's index kept by the open before: `image_files`), then its first
  batch under cProfile (OUT/first_batch_profile.txt).
"""
import json, os, subprocess, sys, tempfile, time

def row(kind, root, out, device):
    T = time.perf_counter
    import torch
    if device == 'cuda': t = T(); torch.empty(1, device='cuda'); torch.cuda.synchronize(); cuda_s = T() - t
    else: cuda_s = 0.
    res = dict(kind=kind, torch_cuda_s=cuda_s)
    if kind == 'torch CUDA': return res
    if kind.startswith('DALI'):
        from nvidia.dali import pipeline_def, fn, types
        from fastai_dali.folders import image_files
        t = T(); items = image_files(root, ['train', 'valid']); res['items_s'] = T() - t
        names = [str(o) for o in (items[:256] if '256' in kind else items)]
        t = T()
        lst = tempfile.NamedTemporaryFile('w', suffix='.txt', delete=False)
        lst.write(''.join(f'{n} 0\n' for n in names)); lst.close(); res['file_list_s'] = T() - t
        @pipeline_def(batch_size=256, num_threads=16 if device == 'cuda' else 2, device_id=0 if device == 'cuda' else None)
        def pipe():
            j,y = fn.readers.file(file_list=lst.name, file_root='/', random_shuffle=True, name='Reader')
            x = fn.decoders.image(j, device='mixed' if device == 'cuda' else 'cpu')
            x = fn.resize(x, resize_shorter=32)
            return fn.crop_mirror_normalize(x, crop=(32, 32), dtype=types.FLOAT, output_layout='CHW',
                                            mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4]), y
        t = T(); p = pipe(); res['define_s'] = T() - t
        t = T(); p.build(); res['build_s'] = T() - t
        t = T(); p.run(); res['first_batch_s'] = T() - t
        t = T(); p.run(); res['second_batch_s'] = T() - t
        os.unlink(lst.name); return res
    import cProfile, pstats
    from fastai.vision.all import Resize, Normalize, imagenet_stats
    from fastai_dali.all import DaliDataLoaders
    t = T(); dls = DaliDataLoaders.from_folder(root, valid='valid', item_tfms=Resize(32), bs=256, device=device,
                                               batch_tfms=Normalize.from_stats(*imagenet_stats)); res['build_s'] = T() - t
    pr = cProfile.Profile(); pr.enable()
    t = T(); it = iter(dls.train); b = next(it)
    if device == 'cuda': torch.cuda.synchronize()
    res['first_batch_s'] = T() - t; pr.disable()
    t = T(); next(it); res['second_batch_s'] = T() - t
    with open(os.path.join(out, 'first_batch_profile.txt'), 'w') as f:
        f.write(f"# cProfile of the first training batch of a warm DaliDataLoaders.from_folder open ({root}, {device}): {res['first_batch_s']:.2f} s under the profiler\n")
        st = pstats.Stats(pr, stream=f); st.sort_stats('cumtime').print_stats(45); st.sort_stats('tottime').print_stats(25)
    return res

KINDS = ('torch CUDA', 'DALI, 256 files', 'DALI, every file', 'DaliDataLoaders.from_folder')

if __name__ == '__main__':
    root,out = sys.argv[1],sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else 'cuda'
    if len(sys.argv) > 4:   # (a row, in its own process)
        print(json.dumps(row(sys.argv[4], root, out, device)), flush=True); os._exit(0)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'first_batch_trace.jsonl'), 'w') as f:
        for k in KINDS:
            p = subprocess.run([sys.executable, __file__, root, out, device, k], capture_output=True, text=True)
            line = next((l for l in p.stdout.splitlines()[::-1] if l.startswith('{')), None)
            if line is None: print(f'{k}: failed\n{p.stderr[-2000:]}', flush=True); continue
            print(line, flush=True); f.write(line + '\n')
