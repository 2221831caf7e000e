"""Bad input catalogue: every kind of input file is decoded exactly as fastai's `PILImage.create`
decodes it, or rejected with an error that names the file; never a hang, never a wrong label.

Each case writes one file (generated with PIL/numpy from scikit-image photos, under pytest's tmp dir) into the
valid set of a small 2-class folder (the decoded formats all into one folder, each file compared), then compares the
`DaliDataLoaders` valid batches with fastai's own `ImageDataLoaders` on the same folder and transforms.

Measured |DALI - fastai| on the case image, 0..255 units, DALI 2.4 CPU backend vs fastai 2.8.7 / Pillow 13:

    decode only (Resize to the image's own 60x80, squish: no resampling)
        png, bmp, tiff, tiff (LZW), webp (lossy and lossless), gif, grey / CMYK / progressive JPEG, RGBA / palette /
        LA PNG, 16-bit grey and RGB PNG, spaces and non-ASCII name, symlink      max 0    mean 0      (bit-exact)
        same cases loaded as PILImageBW ('L')                                      max 0    mean 0
    resized (Resize(32), squish: DALI's antialiased resize vs PIL's, as in test_parity.py)
        8000x6000 JPEG                                                            max 9    mean 0.148
        1x1 JPEG and PNG                                                          max 0    mean 0
    EXIF orientation 6 JPEG: needs `adjust_orientation=False` in 02_pipeline (see `test_exif_orientation_ignored`);
        with it: max 0 (decode only), max 6 / mean 0.16 (Resize(32) pad), before it: max 161, mean 10.

On the H200 (`FASTAI_DALI_TEST_DEVICE=cuda`: 'mixed' decoder, nvJPEG / hardware JPEG decoder, DALI 2.4.0 cuda130,
fastai 2.8.12; `FASTAI_DALI_DIFF_LOG` records these, docs/results/bad_input/):
    non-JPEG cases (PNG, BMP, TIFF, WebP, GIF, 16-bit PNG, ...), grey and CMYK JPEG, 1x1        max 0    mean 0
    colour JPEGs (progressive, non-ASCII name, symlink, EXIF-rotated), decode only             max 7    mean <= 0.061
    PILImageBW                                                                                 max 1    mean <= 0.494
    8000x6000 JPEG, Resize(32)                                                                 max 9    mean 0.163
    EXIF-rotated, Resize(32) pad                                                               max 6    mean 0.160
    get_x -> bytes, a whole batch of 7 small JPEGs (+ GIF, 16-bit PNGs), decode only           max 20   mean 0.268

Tolerances: `DECODE_TOL` (exact on the CPU, a little above the measured on the GPU), `BATCH_TOL` for the whole-batch
comparison, `RESIZED_TOL` (a little above the measured, and within test_parity.py's squish tolerances).
"""
import os, shutil, struct, zlib, warnings, zipfile
from pathlib import Path

import numpy as np, pytest, torch
from PIL import Image
from fastai.vision.all import (ImageDataLoaders, DataBlock, ImageBlock, CategoryBlock, Resize, PILImage, PILImageBW,
                                FuncSplitter, get_image_files, parent_label)
from fastai_dali.data import DaliDataLoaders
from fastai_dali.formats import dali_decodes
from fastai_dali.errors import DaliReadError, unreadable_images

from conftest import photos
from conftest import DEVICE, run_with_timeout, epoch, plain

DECODE_TOL = {'cpu': (0., 0.), 'cuda': (10., 0.1)}[DEVICE.split(':')[0]]    # (max, mean) |d| in 0..255 levels
BATCH_TOL = {'cpu': (0., 0.), 'cuda': (24., 0.45)}[DEVICE.split(':')[0]]    # GPU: test_parity.py's squish bound
# PILImageBW: DALI's RGB->grey conversion rounds differently from PIL's convert('L') (ITU-R 601-2, integer
# arithmetic): measured max 1 level, mean <= 0.494 on colour images (0 for JPEGs, whose grey is libjpeg's Y)
DECODE_TOL_L = (max(DECODE_TOL[0], 1.), max(DECODE_TOL[1], 0.5))
RESIZED_TOL = (16., 0.3)                                                        # measured max 9, mean 0.148

# ------------------------------------------------------------------------------------------------ the catalogue
H,W = 60,80

def photo(k=0, h=H, w=W):
    p = photos()[k % 3]
    return np.ascontiguousarray(p[50:50+h, 60:60+w])

def png16(arr, fn):
    "A 16-bit PNG (grey HxW or RGB HxWx3 uint16), written by hand (PIL cannot write 16-bit RGB)"
    h,w = arr.shape[:2]
    raw = b''.join(b'\0' + arr[y].astype('>u2').tobytes() for y in range(h))
    chunk = lambda t,d: struct.pack('>I', len(d)) + t + d + struct.pack('>I', zlib.crc32(t+d) & 0xffffffff)
    Path(fn).write_bytes(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 16, 0 if arr.ndim == 2 else 2, 0, 0, 0))
                         + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))

def _rgba(a):
    return np.dstack([a, np.tile(np.linspace(0, 255, a.shape[1]).astype(np.uint8), (a.shape[0], 1))])

def _exif(im, f):
    ex = Image.Exif(); ex[0x0112] = 6  # orientation: rotate 90 degrees to display
    im.save(f, quality=90, exif=ex)

WRITERS = {  # case -> (file name, writer(im, path, a good JPEG of the folder))
    'png':            ('img.png',   lambda im,f,g: im.save(f)),
    'bmp':            ('img.bmp',   lambda im,f,g: im.save(f)),
    'tiff':           ('img.tif',   lambda im,f,g: im.save(f)),
    'tiff_lzw':       ('lzw.tiff',  lambda im,f,g: im.save(f, compression='tiff_lzw')),
    'webp':           ('img.webp',  lambda im,f,g: im.save(f, quality=90)),
    'webp_lossless':  ('ll.webp',   lambda im,f,g: im.save(f, lossless=True)),
    'gif':            ('img.gif',   lambda im,f,g: im.save(f)),
    'gray_jpeg':      ('gray.jpg',  lambda im,f,g: im.convert('L').save(f, quality=90)),
    'cmyk_jpeg':      ('cmyk.jpg',  lambda im,f,g: im.convert('CMYK').save(f, quality=90)),
    'progressive':    ('prog.jpg',  lambda im,f,g: im.save(f, quality=90, progressive=True)),
    'rgba_png':       ('rgba.png',  lambda im,f,g: Image.fromarray(_rgba(np.asarray(im))).save(f)),
    'palette_png':    ('pal.png',   lambda im,f,g: im.quantize(64).save(f)),
    'la_png':         ('la.png',    lambda im,f,g: im.convert('LA').save(f)),
    'png16_gray':     ('g16.png',   lambda im,f,g: png16(np.asarray(im)[..., 0].astype(np.uint16)*257 + 100, f)),
    'png16_rgb':      ('rgb16.png', lambda im,f,g: png16(np.asarray(im).astype(np.uint16)*257 + np.uint16(100), f)),
    'unicode_name':   ('na me é ü 日本 (1).jpg', lambda im,f,g: im.save(f, quality=90)),
    'symlink':        ('link.jpg',  lambda im,f,g: os.symlink(Path(g).resolve(), f)),
    'exif_rotated':   ('exif.jpg',  lambda im,f,g: _exif(im, f)),
    'large':          ('large.jpg', lambda im,f,g: Image.fromarray(photo(1, 400, 400)).resize((8000, 6000)).save(f, quality=85)),
    'one_pixel':      ('one.jpg',   lambda im,f,g: im.crop((0, 0, 1, 1)).save(f)),
    'one_pixel_png':  ('one.png',   lambda im,f,g: im.crop((0, 0, 1, 1)).save(f)),
    # bad files
    'zero':           ('zero.jpg',  lambda im,f,g: f.write_bytes(b'')),
    'truncated':      ('trunc.jpg', lambda im,f,g: f.write_bytes(Path(g).read_bytes()[:Path(g).stat().st_size*2//3])),
    'text':           ('text.jpg',  lambda im,f,g: f.write_text('this is not a JPEG\n')),
    'zero_png':       ('zero.png',  lambda im,f,g: f.write_bytes(b'')),
    'text_png':       ('text.png',  lambda im,f,g: f.write_text('this is not a PNG\n')),
    'gif_named_jpg':  ('gif.jpg',   lambda im,f,g: im.save(f, format='GIF')),
}

def write_case(case, folder, good):
    name,write = WRITERS[case]
    f = Path(folder)/name
    write(Image.fromarray(photo()), f, good)
    return f

def make_folder(root, cases=(), where='valid/b'):
    "`root/{train,valid}/{a,b}/` with 2 good JPEGs each, plus one file per case in `root/where`"
    root = Path(root)
    for split in ('train', 'valid'):
        for k,c in enumerate('ab'):
            (root/split/c).mkdir(parents=True, exist_ok=True)
            for i in range(2): Image.fromarray(photo(k+i)).save(root/split/c/f'{c}{i}.jpg', quality=90)
    return root, [write_case(c, root/where, root/'train'/'a'/'a0.jpg') for c in cases]

def both(root, **kwargs):
    dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=16, **kwargs)
    fd = ImageDataLoaders.from_folder(root, device='cpu', num_workers=0, bs=16, **kwargs)
    return dd, fd

def levels(a, b):
    "|a - b| in 0..255 levels (both sides are 0..1 floats: a level is exact up to float32 rounding of /255)"
    return ((a*255).round() - (b*255).round()).abs()

def log_diff(mx, mean, f=None):
    "Appends the measured |d| (of file `f`) to $FASTAI_DALI_DIFF_LOG (JSON lines): how the tolerances above were measured"
    if os.environ.get('FASTAI_DALI_DIFF_LOG'):
        import json
        rec = dict(test=os.environ.get('PYTEST_CURRENT_TEST', '?'), device=DEVICE, max=mx, mean=mean)
        if f is not None: rec['file'] = Path(f).name
        with open(os.environ['FASTAI_DALI_DIFF_LOG'], 'a') as fh: fh.write(json.dumps(rec) + '\n')
    return mx, mean

def cases_diff(dd, fd, files):
    "{file: (max, mean) |d|} on the images of `files`, 0..255 units, after checking items and labels are fastai's"
    assert list(dd.valid.items) == list(fd.valid.items)
    cat = lambda batches: [torch.cat(o) for o in zip(*batches)]
    dx,dy = cat(run_with_timeout(lambda: epoch(dd.valid)))
    fx,fy = cat(epoch(fd.valid))
    assert torch.equal(dy, fy)
    d,items = levels(dx, fx),list(dd.valid.items)
    at = lambda f: d[items.index(f)]
    return {f: log_diff(at(f).max().item(), at(f).mean().item(), f) for f in files}

def case_diff(dd, fd, f):
    "(max, mean) |d| on the image of file `f`, 0..255 units, after checking items and labels are fastai's"
    return cases_diff(dd, fd, [f])[f]

# ------------------------------------------------------------------------------------------------ decoded as fastai
DECODED = ['png', 'bmp', 'tiff', 'tiff_lzw', 'webp', 'webp_lossless', 'gif', 'gray_jpeg', 'cmyk_jpeg', 'progressive',
           'rgba_png', 'palette_png', 'la_png', 'png16_gray', 'png16_rgb', 'unicode_name', 'symlink']

@pytest.mark.parametrize('img_cls', [PILImage, PILImageBW], ids=['RGB', 'L'])
def test_decoded_as_fastai(tmp_path, img_cls):
    "Every case in one folder, as a user's folder mixes them (and one loader instead of 17): each file as fastai decodes it"
    root,files = make_folder(tmp_path, DECODED)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # GIF and 16-bit PNG: "decoded by PIL" (checked below)
        dd,fd = both(root, item_tfms=Resize((H,W), method='squish'), img_cls=img_cls)
        by_file = cases_diff(dd, fd, files)
        diffs = {c: by_file[f] for c,f in zip(DECODED, files)}
    tol = DECODE_TOL if img_cls is PILImage else DECODE_TOL_L
    assert {c: d for c,d in diffs.items() if d[0] > tol[0] or d[1] > tol[1]} == {}, (tol, diffs)

@pytest.mark.parametrize('case', ['large', 'one_pixel', 'one_pixel_png'])
def test_sizes_as_fastai(tmp_path, case):
    root,(f,) = make_folder(tmp_path, [case])
    dd,fd = both(root, item_tfms=Resize(32, method='squish'))
    mx,mean = case_diff(dd, fd, f)
    assert mx <= RESIZED_TOL[0] and mean <= RESIZED_TOL[1], (case, mx, mean)

@pytest.mark.parametrize('case', ['gif', 'png16_gray', 'png16_rgb'])
def test_pil_decodes_what_dali_cannot(tmp_path, case):
    "Files DALI cannot decode as fastai does are named in a warning, and DALI reads PIL's decoding as a PNG"
    root,(f,) = make_folder(tmp_path, [case])
    with open(f, 'rb') as fh: assert not dali_decodes(fh.read(32), lambda: Image.open(f))
    with pytest.warns(UserWarning, match='decoded by PIL') as w:
        dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=16, item_tfms=Resize((H,W), method='squish'))
    assert any(str(f) in str(o.message) for o in w)
    assert f in list(dd.valid.items)  # the user's file, not the PNG, is the item

@pytest.mark.parametrize('method,tol', [('squish', DECODE_TOL), ('pad', RESIZED_TOL)])
def test_exif_orientation_ignored(tmp_path, method, tol):
    "fastai's `PILImage.create` does not apply the EXIF orientation (no `ImageOps.exif_transpose`): neither may DALI"
    root,(f,) = make_folder(tmp_path, ['exif_rotated'])
    size = (H,W) if method == 'squish' else 32
    dd,fd = both(root, item_tfms=Resize(size, method=method))
    mx,mean = case_diff(dd, fd, f)
    assert mx <= tol[0] and mean <= tol[1], (mx, mean)

# ------------------------------------------------------------------------------------------------ rejected, named
# nvJPEG on the GPU decodes a truncated JPEG without an error (grey rows): the loader checks every JPEG's end-of-image
# marker before DALI reads it, so the GPU names the file as the CPU backend and fastai do
@pytest.mark.parametrize('case,why', [('zero', 'empty'), ('truncated', 'truncated'), ('text', 'cannot identify'),
                                      ('gif_named_jpg', 'GIF')])
def test_bad_jpeg_named_in_error(tmp_path, case, why):
    "A bad `.jpg` fails when DALI reaches it, with an error naming the file and saying why; again on the next try"
    root,(f,) = make_folder(tmp_path, [case])
    dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=2, item_tfms=Resize(32))
    for _ in range(2):
        with pytest.raises(DaliReadError) as ei: run_with_timeout(lambda: epoch(dd.valid))
        assert str(f) in str(ei.value) and why in str(ei.value) and "on_error='skip'" in str(ei.value), str(ei.value)
    assert len(run_with_timeout(lambda: epoch(dd.train))) == len(dd.train)  # the train set is fine

@pytest.mark.parametrize('case', ['zero_png', 'text_png'])
def test_bad_non_jpeg_fails_fast(tmp_path, case):
    "A bad file that is not named like a JPEG is checked when the loaders are built: the error names it at once"
    root,(f,) = make_folder(tmp_path, [case])
    with pytest.raises(DaliReadError, match='cannot identify') as ei:
        DaliDataLoaders.from_folder(root, device=DEVICE, bs=2, item_tfms=Resize(32))
    assert str(f) in str(ei.value)

# ------------------------------------------------------------------------------------------------ on_error='skip'
BAD = ['zero', 'truncated', 'text', 'zero_png', 'text_png']

def test_skip_unreadable(tmp_path):
    "`on_error='skip'`: unreadable files are listed and left out; vocab, items, labels, pixels: fastai's without them"
    root,bad = make_folder(tmp_path/'data', BAD)
    # a class whose only training image is unreadable: it is not in the vocab, as with fastai on the cleaned folder
    (root/'train'/'c').mkdir(); write_case('text', root/'train'/'c', None)
    bad.append(root/'train'/'c'/'text.jpg')
    clean = tmp_path/'clean'; shutil.copytree(root, clean, symlinks=True)
    for f in bad: (clean/f.relative_to(root)).unlink()
    with pytest.warns(UserWarning, match=r"on_error='skip': left out 6 of") as w:
        dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=3, item_tfms=Resize(32, method='squish'), on_error='skip')
    msg = '\n'.join(str(o.message) for o in w)
    assert all(str(f) in msg for f in bad), msg
    assert sorted(map(str, bad)) == sorted(str(f) for f,_ in dd.skipped)
    fd = ImageDataLoaders.from_folder(clean, device='cpu', num_workers=0, bs=3, item_tfms=Resize(32, method='squish'))
    assert list(dd.vocab) == list(fd.vocab) == ['a', 'b']
    rel = lambda items: [Path(o).relative_to(root) for o in items]
    assert rel(dd.valid.items) == [Path(o).relative_to(clean) for o in fd.valid.items]
    assert sorted(rel(dd.train.items)) == sorted(Path(o).relative_to(clean) for o in fd.train.items)
    dv,fv = run_with_timeout(lambda: epoch(dd.valid)), epoch(fd.valid)
    assert torch.equal(torch.cat([b[1] for b in dv]), torch.cat([b[1] for b in fv]))
    assert ((torch.cat([b[0] for b in dv]) - torch.cat([b[0] for b in fv])).abs()*255).max() <= RESIZED_TOL[0]
    assert len(run_with_timeout(lambda: epoch(dd.train))) == len(dd.train)

def test_skip_from_df(tmp_path):
    "`on_error='skip'` with DataFrame items (from_df): the rows of unreadable files are left out, labels stay aligned"
    import pandas as pd
    root,bad = make_folder(tmp_path, ['truncated', 'zero_png'])
    files = get_image_files(root)
    df = pd.DataFrame({'fname': [str(f.relative_to(root)) for f in files], 'label': [parent_label(f) for f in files],
                       'is_valid': [f.parent.parent.name == 'valid' for f in files]})
    with pytest.warns(UserWarning, match='left out 2'):
        dd = DaliDataLoaders.from_df(df, root, fn_col='fname', label_col='label', valid_col='is_valid', bs=4,
                                     item_tfms=Resize(32), device=DEVICE, on_error='skip')
    kept = df[~df.fname.isin([str(f.relative_to(root)) for f in bad])]
    fd = ImageDataLoaders.from_df(kept, root, fn_col='fname', label_col='label', valid_col='is_valid', bs=4,
                                  item_tfms=Resize(32), device='cpu', num_workers=0)
    assert list(dd.vocab) == list(fd.vocab)
    ys = lambda dl: torch.cat([plain(b[1]) for b in dl])
    assert torch.equal(run_with_timeout(lambda: ys(dd.valid)), ys(fd.valid))
    assert len(dd.valid_ds) == len(fd.valid_ds) == 4

def test_skip_nothing_to_skip(tmp_path):
    root,_ = make_folder(tmp_path, ['png', 'gif'])
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)
        warnings.filterwarnings('ignore', message='.*decoded by PIL')
        dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=4, item_tfms=Resize(32), on_error='skip')
    assert dd.skipped == [] and len(dd.valid_ds) == 6

def test_on_error_checked(tmp_path):
    root,_ = make_folder(tmp_path)
    with pytest.raises(ValueError, match="on_error='ignore'"):
        DaliDataLoaders.from_folder(root, device=DEVICE, bs=4, on_error='ignore')

def test_unreadable_images(tmp_path):
    root,bad = make_folder(tmp_path, BAD + ['gif', 'png16_gray', 'cmyk_jpeg'])
    files = get_image_files(root)
    found = {files[i]: why for i,why in unreadable_images(files)}
    assert set(found) == set(bad[:len(BAD)]), found
    assert 'truncated' in found[bad[1]]

# ------------------------------------------------------------------------------------------------ bytes from get_x
def test_get_x_bytes_pil_fallback(tmp_path):
    "A `get_x` returning the bytes of a GIF or a 16-bit PNG: decoded as fastai does (by PIL, then DALI reads a PNG)"
    root,cases = make_folder(tmp_path/'data', ['gif', 'png16_gray', 'png16_rgb', 'cmyk_jpeg'])
    zpath = tmp_path/'images.zip'
    with zipfile.ZipFile(zpath, 'w') as z:
        for f in get_image_files(root): z.write(f, f.relative_to(root).as_posix())
    get_x = lambda n: zipfile.ZipFile(zpath).read(n)
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=lambda p: sorted(zipfile.ZipFile(p).namelist()),
                       get_x=get_x, get_y=lambda n: n.split('/')[1], splitter=FuncSplitter(lambda n: n.startswith('valid')),
                       item_tfms=Resize((H,W), method='squish'))
    dd = dblock.dali_dataloaders(zpath, bs=16, device=DEVICE, py_workers=0)
    fd = dblock.dataloaders(zpath, bs=16, device='cpu', num_workers=0)
    (dx,dy), = run_with_timeout(lambda: epoch(dd.valid))
    (fx,fy), = epoch(fd.valid)
    assert torch.equal(dy, fy)
    d = levels(dx, fx); log_diff(d.max().item(), d.mean().item())
    assert d.max() <= BATCH_TOL[0] and d.mean() <= BATCH_TOL[1], (d.max(), d.mean())

def test_bad_first_train_image_named(tmp_path):
    "fastai decodes the first training image while setting up: when it is bad, the error names it (PIL's does not)"
    root,_ = make_folder(tmp_path)
    train = get_image_files(root/'train')
    for f in train: f.write_bytes(f.read_bytes()[:f.stat().st_size//2])
    with pytest.raises(DaliReadError, match='truncated') as ei:
        DaliDataLoaders.from_folder(root, device=DEVICE, bs=2, item_tfms=Resize(32))
    assert any(str(f) in str(ei.value) for f in train), str(ei.value)

# ------------------------------------------------------------------------------------------------ review regressions
def test_converted_file_not_blamed(tmp_path):
    "A GIF (read by DALI as a PIL-made PNG) next to a broken `.jpg`: the error names the broken file, not the GIF"
    root,(gif,txt) = make_folder(tmp_path, ['gif', 'text'])
    with pytest.warns(UserWarning, match='decoded by PIL'):
        dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=16, item_tfms=Resize(32))
    with pytest.raises(DaliReadError) as ei: run_with_timeout(lambda: epoch(dd.valid))
    assert str(txt) in str(ei.value) and str(gif) not in str(ei.value), str(ei.value)

def test_same_file_converted_twice_at_once(monkeypatch):
    "Repeated items that need PIL (e.g. an oversampled DataFrame): converted by several threads at once, no error, one file, in the process's one folder (which the threads make: once)"
    import tempfile
    from fastai_dali import dirs
    from fastai_dali.items import dali_files
    d = Path(tempfile.mkdtemp()); f = d/'a.gif'; Image.fromarray(photo()).save(f)
    for _ in range(5):
        monkeypatch.setattr(dirs, '_process_dirs', {})   # (as in a new process: whatever the tests before made)
        with pytest.warns(UserWarning, match='decoded by PIL'): out = dali_files([f]*16, num_threads=8)
        assert len(set(out)) == 1 and Path(out[0]).suffix == '.png' and Path(out[0]).exists()

def test_skip_keeps_index_split(tmp_path):
    "`on_error='skip'` with an index splitter: every kept item stays on the side the splitter put it"
    from fastai.vision.all import IndexSplitter
    root,(bad,) = make_folder(tmp_path, ['text'], where='train/a')
    files = sorted(get_image_files(root), key=str)
    valid_idx = [i for i,f in enumerate(files) if f.parent.name == 'b'][:3]
    blk = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=lambda _: files, get_y=parent_label,
                    splitter=IndexSplitter(valid_idx), item_tfms=Resize(32))
    assert files.index(bad) < max(valid_idx)  # dropping it would shift the valid indices onto other items
    with pytest.warns(UserWarning, match='left out 1'): dd = blk.dali_dataloaders(root, bs=2, device=DEVICE, on_error='skip')
    assert list(dd.valid.items) == [files[i] for i in valid_idx]
    assert sorted(dd.train.items, key=str) == [f for i,f in enumerate(files) if i not in valid_idx and f != bad]

def test_truncated_jpeg_bytes_named(tmp_path):
    "A truncated JPEG returned by a `get_x` (bytes, the Python-source path) is named too, on every backend"
    from fastai.vision.all import DataBlock, ImageBlock, CategoryBlock, GrandparentSplitter, parent_label
    root,(f,) = make_folder(tmp_path, ['truncated'])
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_image_files, get_x=lambda o: Path(o).read_bytes(),
                       get_y=parent_label, splitter=GrandparentSplitter(), item_tfms=Resize(32))
    dd = DaliDataLoaders.from_dblock(dblock, root, device=DEVICE, bs=2, py_workers=0)
    with pytest.raises(DaliReadError, match='truncated') as ei: run_with_timeout(lambda: epoch(dd.valid))
    assert f.name in str(ei.value), str(ei.value)

def test_truncated_found_after_show_batch_unique(tmp_path):
    "The truncated-JPEG check covers every file of the dataset, whatever order the loader reads (one item, shown bs times)"
    import itertools
    root,(f,) = make_folder(tmp_path, ['truncated'])
    dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=2, item_tfms=Resize(32))
    good = next(i for i,o in enumerate(dd.valid.items) if Path(o) != f)  # a good image, shown bs times
    old = dd.valid.get_idxs; dd.valid.get_idxs = lambda: itertools.repeat(good)
    try:
        with pytest.raises(DaliReadError, match='truncated'): run_with_timeout(dd.valid.one_batch)
    finally: dd.valid.get_idxs = old
    with pytest.raises(DaliReadError, match='truncated') as ei: run_with_timeout(lambda: epoch(dd.valid))
    assert str(f) in str(ei.value)

@pytest.mark.parametrize('where', ['in the batch', 'elsewhere'])
def test_truncated_found_batch_by_batch(tmp_path, monkeypatch, where):
    "A large data set is checked batch by batch (`JpegEndsCheck` with `by_batch`): a batch holding a truncated JPEG is never given, and the error names it, whichever batch meets it; the next epoch says it again"
    import itertools
    monkeypatch.setattr('fastai_dali.feed.BACKGROUND_MIN', 0)   # (every data set counts as large)
    root,(f,) = make_folder(tmp_path, ['truncated'])
    dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=2, item_tfms=Resize(32))
    if where == 'in the batch':
        bad = next(i for i,o in enumerate(dd.valid.items) if Path(o) == f)
        old = dd.valid.get_idxs; dd.valid.get_idxs = lambda: itertools.repeat(bad)
        try:
            with pytest.raises(DaliReadError, match='truncated') as ei: run_with_timeout(dd.valid.one_batch)
        finally: dd.valid.get_idxs = old
        assert str(f) in str(ei.value)
    for _ in range(2):  # a whole epoch, twice: named each time, no hang
        with pytest.raises(DaliReadError, match='truncated') as ei: run_with_timeout(lambda: epoch(dd.valid))
        assert str(f) in str(ei.value)
    assert len(run_with_timeout(lambda: epoch(dd.train))) == len(dd.train)  # the train set is fine

def test_large_data_set_checked_from_the_bytes_read(tmp_path, monkeypatch):
    "A large data set's complete JPEGs are never read again on the host: the pipeline gives each file's first and last bytes with its batch, and only a suspect (a JPEG not ending with its marker: here one with data after it, which fastai loads) is read again, in every epoch; no check of the whole data set runs"
    from fastai_dali import errors
    monkeypatch.setattr('fastai_dali.feed.BACKGROUND_MIN', 0)   # (every data set counts as large)
    read,whole = [],[]
    real = errors._truncated_in
    monkeypatch.setattr(errors, '_truncated_in', lambda fs, idxs: read.append([Path(fs[i]).name for i in idxs]) or real(fs, idxs))
    monkeypatch.setattr(errors, 'truncated_jpegs', lambda *a, **k: whole.append(1) or [])
    root,_ = make_folder(tmp_path)
    ok = (root/'valid'/'b'/'b0.jpg').read_bytes()
    (root/'valid'/'b'/'extra.jpg').write_bytes(ok + b'MORE DATA')   # (PIL reads it: fastai keeps it)
    dd = DaliDataLoaders.from_folder(root, device=DEVICE, bs=2, item_tfms=Resize(32))
    for _ in range(2):
        assert len(run_with_timeout(lambda: epoch(dd.valid))) == len(dd.valid)
        assert len(run_with_timeout(lambda: epoch(dd.train))) == len(dd.train)
    assert sorted(n for r in read for n in r) == ['extra.jpg', 'extra.jpg'] and whole == [], (read, whole)
    # a training set that is no multiple of the batch size: the last batch read, none of it kept (drop_last), nothing checked
    d3 = DaliDataLoaders.from_folder(root, device=DEVICE, bs=3, item_tfms=Resize(32))
    assert len(run_with_timeout(lambda: epoch(d3.train))) == len(d3.train) == 1
