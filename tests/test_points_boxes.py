"""Points and boxes: `PointBlock` and `BBoxBlock` targets come out of `DaliDataLoaders` as fastai's own loaders give them.

Three kinds of checks. (1) Deterministic splits against fastai's `dataloaders` on the same items: the validation split,
every `Resize` method, crops, odd image sizes, points and boxes partly or wholly outside the image, boxes of different
counts (`bb_pad`). (2) Random steps against fastai's own transforms given the same draws (the DALI graph's draws preset
through `DaliGraph.preset`, fastai's set on the transform). (3) Where fastai's coordinates do not follow its image
(`FlipItem`, `DihedralItem`, `CropPad`, `RandomResizedCrop`'s validation crop, `RandomResizedCropGPU`): a drawn marker's
centre, found in each output image, against the point DaliDL gives for it. Tolerances: float32 arithmetic (1e-4 in
[-1, 1]) for (1) and (2); for (3), 1 output pixel, what locating a 7-pixel disc after resampling allows (measured
0.1-0.4 px). Draws are seeded. Also: which targets and transforms DaliDL refuses, `dali_report`'s target rows,
`show_batch`.
"""
import hashlib, warnings
import numpy as np, pytest, torch
from pathlib import Path
from PIL import Image, ImageDraw
from fastai.vision.all import (DataBlock, ImageBlock, PointBlock, BBoxBlock, BBoxLblBlock, CategoryBlock, MultiCategoryBlock,
    RegressionBlock, MaskBlock, GrandparentSplitter, get_image_files, parent_label, Resize, RandomResizedCrop, RandomCrop,
    CropPad, FlipItem, DihedralItem, PointScaler, TensorPoint, TensorBBox, PILImage, Transform, aug_transforms, Flip,
    Rotate, Zoom, Warp, setup_aug_tfms, RandomResizedCropGPU, set_seed, Normalize, imagenet_stats)
from fastai_dali.all import *
from fastai_dali.targets import move_points
from conftest import DEVICE, plain

SIZES = [(37, 53), (61, 45), (50, 50), (29, 71), (80, 33), (44, 44)]   # (w, h): odd sizes and aspect ratios

def marker_xy(i, w, h):
    "The centre of item `i`'s marker, well inside its image"
    r = np.random.default_rng(i)
    return float(r.uniform(8, w-8)), float(r.uniform(8, h-8))

def write_folder(root, n=12):
    "train/valid/a/NNN.png: noise-free grey images of SIZES, each with a white disc (radius 3) at `marker_xy`"
    for split in ('train', 'valid'):
        for i in range(n):
            w,h = SIZES[i % len(SIZES)]
            im = Image.new('RGB', (w, h), (40, 40, 40))
            x,y = marker_xy(i, w, h)
            ImageDraw.Draw(im).ellipse([x-3.5, y-3.5, x+3.5, y+3.5], fill=(255, 255, 255))
            f = Path(root)/split/'a'/f'{i:03d}.png'; f.parent.mkdir(parents=True, exist_ok=True); im.save(f)
    return root

@pytest.fixture(scope='module')
def root(tmp_path_factory): return write_folder(tmp_path_factory.mktemp('points'))

def _i(f): return int(Path(f).stem)
def _wh(f): return SIZES[_i(f) % len(SIZES)]

def marker(f):
    "The marker's centre: one point"
    return [list(marker_xy(_i(f), *_wh(f)))]

def points(f):
    "The marker's centre, two corners and points outside the image"
    (w,h),(x,y) = _wh(f),marker_xy(_i(f), *_wh(f))
    return [[x, y], [0., 0.], [w, h], [-5., h/2], [w+7, -3.]]

def boxes(f):
    "1-4 boxes: inside, partly outside, wholly outside (dropped by bb_pad), flat (dropped)"
    (w,h),i = _wh(f),_i(f)
    bs = [[3., 4., w/2, h-5], [w-10, -6., w+8, 12.], [-20., -20., -2., -3.], [5., 9., 20., 9.]]
    return bs[:1 + i % 4]
def box_labels(f): return ['cat', 'dog', 'fish', 'dog'][:1 + _i(f) % 4]

def point_block(item_tfms, batch_tfms=None, get_y=points):
    return DataBlock(blocks=(ImageBlock, PointBlock), get_items=get_image_files, splitter=GrandparentSplitter(),
                     get_y=get_y, item_tfms=item_tfms, batch_tfms=batch_tfms)

def box_block(item_tfms, batch_tfms=None):
    return DataBlock(blocks=(ImageBlock, BBoxBlock, BBoxLblBlock), get_items=get_image_files, splitter=GrandparentSplitter(),
                     get_y=[boxes, box_labels], item_tfms=item_tfms, batch_tfms=batch_tfms, n_inp=1)

def both(db, root, bs=6):
    "fastai's and DaliDL's validation batches of `db`"
    set_seed(0)
    a = db.dataloaders(root, bs=bs, device='cpu', num_workers=0)
    b = db.dali_dataloaders(root, bs=bs, device=DEVICE)
    return [list(map(plain, x)) for x in (a.valid.one_batch(), b.valid.one_batch())]

# --- (1) deterministic: the validation split, against fastai -----------------------------------------------------

VALID_TFMS = {
    'crop': [Resize(32)], 'crop-wide': [Resize((48, 24))], 'squish': [Resize((40, 24), method='squish')],
    'pad-zeros': [Resize(36, method='pad', pad_mode='zeros')], 'pad-border': [Resize(36, method='pad', pad_mode='border')],
    'pad-reflection': [Resize(36, method='pad', pad_mode='reflection')],
    'randomcrop': [RandomCrop(27)],       # smaller than every image (fastai's odd padding differs from DALI's: 01b)
    'aug': [Resize(32)],                  # + aug_transforms below: nothing on the validation split
}

@pytest.mark.parametrize('name', list(VALID_TFMS))
def test_valid_points_equal_fastai(root, name):
    bt = aug_transforms(size=24) if name == 'aug' else None
    (xa,pa),(xb,pb) = both(point_block(VALID_TFMS[name], bt), root)
    assert xa.shape == xb.shape and pa.shape == pb.shape == (6, 5, 2)
    torch.testing.assert_close(pb, pa, atol=1e-4, rtol=0)

@pytest.mark.parametrize('name', ['crop', 'squish', 'pad-zeros', 'randomcrop', 'aug'])
def test_valid_boxes_equal_fastai(root, name):
    """Boxes moved, clipped, the empty ones dropped with their labels, padded to the batch's longest (labels with 0)"""
    bt = aug_transforms(size=24) if name == 'aug' else None
    (_,ba,la),(_,bb,lb) = both(box_block(VALID_TFMS[name], bt), root)
    assert ba.shape == bb.shape and la.shape == lb.shape, (ba.shape, bb.shape)
    assert (lb == 0).any() and (la != 0).any()   # the control: padding and labels both present in this batch
    torch.testing.assert_close(bb, ba, atol=1e-4, rtol=0); assert torch.equal(lb, la)

def test_python_source_points_equal_fastai(root):
    """A `get_x` giving bytes (DALI's Python source) moves the points as DALI's reader does"""
    db = DataBlock(blocks=(ImageBlock, PointBlock), get_items=get_image_files, splitter=GrandparentSplitter(),
                   get_x=lambda f: Path(f).read_bytes(), get_y=points, item_tfms=Resize(32))
    a = point_block(Resize(32)).dataloaders(root, bs=6, device='cpu', num_workers=0).valid.one_batch()
    b = db.dali_dataloaders(root, bs=6, device=DEVICE, py_workers=0).valid.one_batch()
    torch.testing.assert_close(plain(b[1]), plain(a[1]), atol=1e-4, rtol=0)

def test_y_first(root):
    def yx(f): return [[y, x] for x,y in points(f)]
    db = DataBlock(blocks=(ImageBlock, PointBlock), get_items=get_image_files, splitter=GrandparentSplitter(), get_y=yx,
                   item_tfms=[Resize(32)])
    db.item_tfms = [t if not isinstance(t, PointScaler) else PointScaler(y_first=True) for t in db.item_tfms]
    (_,pa),(_,pb) = both(db, root)
    torch.testing.assert_close(pb, pa, atol=1e-4, rtol=0)
    (_,px),_ = both(point_block(Resize(32)), root)
    torch.testing.assert_close(pb, px, atol=1e-4, rtol=0)   # (y, x) given: (x, y) out, as fastai

# --- (2) random steps, with fastai's draws ------------------------------------------------------------------------

def dali_item_maps(item_tfms, shapes, presets, train=True, batch_tfms=()):
    "Each sample's item map (and a fused warp's homography) from the DALI graph of `item_tfms` on blank images of `shapes` (h, w), with `presets(g, nodes)` giving the draws"
    from nvidia.dali import pipeline_def, fn
    from fastai_dali.pipeline import DaliPlan
    imgs = [np.zeros((h, w, 3), np.uint8) for h,w in shapes]
    plan = DaliPlan(item_tfms, batch_tfms, points=True)
    graphs = []
    @pipeline_def(batch_size=len(imgs), num_threads=1, device_id=None, seed=0)
    def pipe():
        g = plan.graph(train, gpu=False, decoded=None)
        presets(g)
        plan(fn.external_source(lambda: imgs, batch=True, layout='HWC'), g)
        graphs.append(g)
        return tuple(g.point_outputs.values())
    p = pipe(); p.build()
    g,n = graphs[0],len(imgs)
    d = {k: np.stack([np.array(o[i]) for i in range(n)]) for k,o in zip(g.point_outputs, p.run())}
    return [g.host.item(d, n)] + ([] if g.host.warp is None else [g.host.warp(d, n)])

def moved(p, gi, gb=None):
    "Points `p` (B,n,2) moved by the maps `gi` (and `gb`) as `TargetPlan.batch` moves them (on the host, in numpy), as a tensor"
    return torch.from_numpy(move_points(np.asarray(p, np.float32), gi, gb))

def const(vals, dtype=np.float32):
    "A DALI node of per-sample values `vals` (arrays)"
    from nvidia.dali import fn
    return fn.external_source(lambda: [np.asarray(v, dtype=dtype) for v in vals], batch=True)

def fastai_points(pts, w, h, steps):
    "fastai's points: `PointScaler` by the image size, then `steps(p)` (the transforms' encodes with draws set)"
    img = PILImage.create(np.zeros((h, w, 3), np.uint8))
    _,p = PointScaler()((img, TensorPoint.create(pts)))
    return plain(steps(p))

SHAPES = [(53, 37), (45, 61), (50, 50), (71, 29)]
PTS = lambda h, w: [[w*0.3, h*0.6], [0., 0.], [w, h], [-4., 3.], [w+5., h*0.5]]

@pytest.mark.parametrize('exact', [False, True])
def test_resize_crop_train_draws(exact):
    """`Resize` on the training split: the window at fastai's `int(pct*(W-cw))` for the same pcts"""
    t = Resize((30, 20))
    u = np.array([[0.13, 0.91], [0.5, 0.0], [0.999, 0.37], [0.62, 0.5]], np.float32)   # (y, x) draws
    def presets(g): g.preset(t, 'y', const(u[:, 0])); g.preset(t, 'x', const(u[:, 1]))
    item_tfms = [PointScaler(), t]
    (gi,) = dali_item_maps(item_tfms, SHAPES, presets) if not exact else _exact(item_tfms, presets)
    for k,(h,w) in enumerate(SHAPES):
        t.pcts = (float(u[k, 1]), float(u[k, 0]))
        exp = fastai_points(PTS(h, w), w, h, lambda p: t.encodes(p))
        got = moved([PTS(h, w)], gi[k:k+1])[0]
        torch.testing.assert_close(got, exp, atol=1e-4, rtol=0)

def _exact(item_tfms, presets):
    from fastai_dali import pipeline as P
    orig = P.DaliPlan.graph
    def graph(self, *a, **kw):
        g = orig(self, *a, **kw); g.exact_resize_crop = True; return g
    P.DaliPlan.graph = graph
    try: return dali_item_maps(item_tfms, SHAPES, presets)
    finally: P.DaliPlan.graph = orig

def test_random_crop_train_draws():
    t = RandomCrop(24)
    u = np.array([[0.13, 0.91], [0.5, 0.0], [0.999, 0.37], [0.62, 0.5]], np.float32)
    def presets(g): g.preset(t, 'y', const(u[:, 0])); g.preset(t, 'x', const(u[:, 1]))
    (gi,) = dali_item_maps([PointScaler(), t], SHAPES, presets)
    for k,(h,w) in enumerate(SHAPES):
        # DALI's window sits at round(u*(W-w)): the same window given to fastai's crop
        t.orig_sz,t.tl = (w, h),(int(np.floor(u[k,1]*(w-24)+0.5)), int(np.floor(u[k,0]*(h-24)+0.5)))
        exp = fastai_points(PTS(h, w), w, h, lambda p: t.encodes(p))
        torch.testing.assert_close(moved([PTS(h, w)], gi[k:k+1])[0], exp, atol=1e-4, rtol=0)

def test_random_resized_crop_train_draws():
    t = RandomResizedCrop((28, 20))
    wins = [((5, 2), (30, 20)), ((0, 0), (45, 61)), ((10, 12), (17, 33)), ((1, 3), (60, 20))]   # (y, x), (h, w)
    def presets(g): g.preset(t, 'window', (const([a for a,_ in wins], np.int32), const([s for _,s in wins], np.int32)))
    (gi,) = dali_item_maps([PointScaler(), t], SHAPES, presets)
    for k,(h,w) in enumerate(SHAPES):
        (ay,ax),(sh,sw) = wins[k]
        t.orig_sz,t.final_size,t.tl,t.cp_size = (w, h),t.size,(ax, ay),(sw, sh)
        exp = fastai_points(PTS(h, w), w, h, lambda p: t.encodes(p))
        torch.testing.assert_close(moved([PTS(h, w)], gi[k:k+1])[0], exp, atol=1e-4, rtol=0)

def test_affine_train_draws():
    """flip, rotate, zoom and warp of `aug_transforms` moved as fastai moves points (`TensorPoint.affine_coord`)"""
    from fastai.vision.all import TensorImage, IntToFloatTensor
    from fastai_dali.augment import AffineParams
    ang,zs,cx,cy,wx,wy = [-25.,10.,0.,25.],[1.05,1.,1.3,1.1],[.2,.9,.5,0.],[.7,.1,.5,1.],[.3,-.2,0.,.15],[-.05,.3,.1,0.]
    fa = setup_aug_tfms([Flip(p=1., draw=[1,0,1,0]), Rotate(max_deg=25, p=1., draw=ang),
                         Zoom(max_zoom=1.3, p=1., draw=zs, draw_x=cx, draw_y=cy), Warp(0.3, p=1., draw_x=wx, draw_y=wy)])[0]
    t = setup_aug_tfms([Flip(), Rotate(max_deg=25), Zoom(max_zoom=1.3), Warp(0.3)])[0]
    u = np.stack([[0.,1,0,1], [0]*4, (np.array(ang)/25+1)/2, [0]*4, (np.array(zs)-1)/0.3, cx, cy,
                  [0]*4, (np.array(wx)/0.3+1)/2, [0]*4, (np.array(wy)/0.3+1)/2], 1)
    H,W = 30, 40
    mats = AffineParams(t)(list(u), [np.array([H, W, 3])]*4)
    def presets(g):  # the draws, and the warp's matrices of them (the host makes the points' maps of the same draws)
        g.preset(t, 'affine draws', const(u)); g.preset(t, 'affine', const(mats))
    gi,gb = dali_item_maps([Resize((H, W), method='squish'), PointScaler()], [(H, W)]*4, presets, batch_tfms=[IntToFloatTensor(), t])
    pts = torch.tensor([[[8., 6.], [20., 15.], [39., 1.], [-3., 33.]]]*4)
    x = TensorImage(torch.zeros(4, 3, H, W))
    _,exp = fa((x, TensorPoint(pts*2/torch.tensor([W, H]) - 1)), split_idx=0)
    torch.testing.assert_close(moved(pts, gi, gb.reshape(-1, 3, 3)), plain(exp), atol=1e-4, rtol=0)

# --- (3) where fastai's points do not follow its image: they follow the image's marker ----------------------------

def marker_centres(x):
    "Centre (x, y) in pixels (edges at 0 and W) of the bright disc in each image of batch `x` (B,C,H,W)"
    v = x.float().mean(1)
    v = (v - v.amin((1, 2), keepdim=True)).clamp(min=0)
    v = torch.where(v > v.amax((1, 2), keepdim=True)*0.5, v, torch.zeros_like(v))
    ys,xs = torch.meshgrid(torch.arange(v.shape[1]) + 0.5, torch.arange(v.shape[2]) + 0.5, indexing='ij')
    s = v.sum((1, 2))
    return torch.stack([(v*xs).sum((1, 2))/s, (v*ys).sum((1, 2))/s], -1)

FOLLOW = {
    'flipitem': ([Resize(40, method='squish'), FlipItem(p=1.)], None, 'train'),
    'dihedralitem': ([Resize(40, method='squish'), DihedralItem(p=1.)], None, 'train'),
    'croppad': ([CropPad(48), Resize(40, method='squish')], None, 'valid'),
    'croppad-border': ([CropPad(47, pad_mode='border'), Resize(40, method='squish')], None, 'valid'),
    'rrc-valid': ([RandomResizedCrop(32)], None, 'valid'),
    'rrc-train': ([RandomResizedCrop(32, min_scale=0.6)], None, 'train'),
    'aug': ([Resize(40, method='squish')], aug_transforms(max_warp=0, max_rotate=15, max_zoom=1.2, p_affine=1.), 'train'),
    'rrc-gpu': ([Resize(40, method='squish')], [RandomResizedCropGPU(32, min_scale=0.5)], 'train'),
}

@pytest.mark.parametrize('name', list(FOLLOW))
def test_points_follow_the_marker(root, name):
    item_tfms,batch_tfms,split = FOLLOW[name]
    set_seed(1)
    dls = point_block(item_tfms, batch_tfms, get_y=marker).dali_dataloaders(root, bs=6, device=DEVICE, seed=3)
    n = 0
    for x,p in getattr(dls, split):
        x,p = plain(x),plain(p)
        inside = (p[:, 0].abs() < 0.75).all(1)   # the marker whole in the image (a crop or a warp may cut it)
        pix = (p[:, 0] + 1)*torch.tensor([x.shape[3], x.shape[2]])/2
        d = (pix - marker_centres(x))[inside].abs().max().item()
        assert d < 1.0, f'{name}: the point is {d:.2f} px from its marker'
        n += int(inside.sum())
    assert n >= 4

def test_flip_item_boxes_follow_the_image(root):
    """fastai flips the raw pixels of boxes (order 0, before PointScaler): they leave the image and bb_pad drops them"""
    dls = box_block([Resize(40, method='squish'), FlipItem(p=1.)]).dali_dataloaders(root, bs=6, device=DEVICE, shuffle=False)
    x,b,l = map(plain, dls.train.one_batch())
    keep = l > 0
    assert keep.sum() >= 6 and (b[keep][:, 2] > b[keep][:, 0]).all()   # ordered boxes, none dropped for a flip
    dls2 = box_block([Resize(40, method='squish')]).dali_dataloaders(root, bs=6, device=DEVICE, shuffle=False)
    _,b2,l2 = map(plain, dls2.train.one_batch())
    _,b1,l1 = map(plain, dls.train.one_batch())
    assert torch.equal(l1, l2)
    torch.testing.assert_close(b1[..., [2, 1, 0, 3]]*torch.tensor([-1., 1, -1, 1])*(l1[..., None] > 0), b2*(l2[..., None] > 0), atol=1e-4, rtol=0)

# --- what DaliDL refuses, and the targets of every vision block ---------------------------------------------------

def test_every_vision_target_block(root, tmp_path):
    """Labels, multi-labels and floats equal fastai's; points and boxes above; masks in test_segmentation; an image target refused"""
    def cls3(f): return 'abc'[_i(f) % 3]
    for blocks,get_y in [((ImageBlock, CategoryBlock), cls3), ((ImageBlock, MultiCategoryBlock), lambda f: list({cls3(f), 'd'})),
                         ((ImageBlock, RegressionBlock), lambda f: float(_i(f))/7)]:
        db = DataBlock(blocks=blocks, get_items=get_image_files, splitter=GrandparentSplitter(), get_y=get_y,
                       item_tfms=Resize(32), batch_tfms=aug_transforms())
        (_,ya),(_,yb) = both(db, root)
        assert torch.equal(yb, ya)
    db = DataBlock(blocks=(ImageBlock, ImageBlock), get_items=get_image_files, splitter=GrandparentSplitter(), item_tfms=Resize(32))
    with pytest.raises(NotImplementedError, match='a target that is an image'): db.dali_dataloaders(root, bs=4, device=DEVICE)

def test_refusals(root):
    class Nudge(Transform):
        order = 2
        def encodes(self, x:PILImage|TensorPoint): return x
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with pytest.raises(NotImplementedError, match=r'TensorPoint targets \(PointBlock\).*Nudge changes them in fastai'):
            point_block([Resize(32), Nudge()]).dali_dataloaders(root, bs=4, device=DEVICE)
    db = DataBlock(blocks=(ImageBlock, BBoxBlock), get_items=get_image_files, splitter=GrandparentSplitter(), get_y=boxes, item_tfms=Resize(32))
    with pytest.raises(TypeError, match='clip_remove_empty'): db.dataloaders(root, bs=4)   # fastai's own fail with its TypeError
    with pytest.raises(NotImplementedError, match='bb_pad pads'): db.dali_dataloaders(root, bs=4, device=DEVICE)
    with pytest.raises(NotImplementedError, match='runs no before_batch'):
        point_block(Resize(32)).dali_dataloaders(root, bs=4, device=DEVICE, before_batch=lambda b: b)

def test_report_and_show_batch(root):
    import matplotlib; matplotlib.use('Agg')
    dls = box_block(Resize(32), aug_transforms()).dali_dataloaders(root, bs=4, device=DEVICE)
    r = dls.train.dali_report()
    t = r[r.stage == 'target']
    assert list(t['transform']) == ['TensorBBox', 'TensorMultiCategory', 'bb_pad'] and set(t['how']) == {'native'}
    assert 'homography' in t['detail'].iloc[0]
    assert r[r['transform'] == 'PointScaler']['how'].tolist() == ['native']
    dls.show_batch(max_n=4)
    point_block(Resize(32)).dali_dataloaders(root, bs=4, device=DEVICE).show_batch(max_n=4)

def test_decoded_like_fastai(root):
    """`show_batch` draws what `decode_batch` gives: the points and boxes in pixels of the shown image, as fastai's"""
    for db in (point_block(Resize(32)), box_block(Resize(32))):
        set_seed(0)
        a = db.dataloaders(root, bs=6, device='cpu', num_workers=0)
        b = db.dali_dataloaders(root, bs=6, device=DEVICE)
        da,dd = a.valid.decode_batch(a.valid.one_batch()),b.valid.decode_batch(b.valid.one_batch())
        assert len(da) == len(dd) == 6
        for (_,*ya),(_,*yd) in zip(da, dd):
            for u,v in zip(ya, yd):
                if isinstance(u, torch.Tensor): torch.testing.assert_close(plain(v), plain(u), atol=1e-3, rtol=0)
                else: assert list(map(str, v)) == list(map(str, u)) or torch.allclose(plain(v[0]), plain(u[0]), atol=1e-3)

class Halve(Transform):
    "A user's item transform fastai runs on the image only (no `encodes` for points): it keeps them where they are in [-1, 1]"
    order = 5
    def encodes(self, x:PILImage): return x.resize((x.size[0]//2, x.size[1]//2))

def test_untranslated_step_keeps_points_in_place(root):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # (Halve runs in Python: DaliDL warns)
        (xa,pa),(xb,pb) = both(point_block([Resize(32), Halve()]), root)
    assert xb.shape[-2:] == (16, 16)
    torch.testing.assert_close(pb, pa, atol=1e-4, rtol=0)
