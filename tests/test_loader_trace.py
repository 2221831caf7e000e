"How `scripts/step_graph_loader.py` reads a torch.profiler trace: the loader's kernels that wait behind the graph"
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location('step_graph_loader', Path(__file__).parents[1]/'scripts'/'step_graph_loader.py')
sgl = importlib.util.module_from_spec(spec); spec.loader.exec_module(sgl)

def _trace():
    """Two batches: the graph (stream 7) runs 0-9000 us and 10000-19000 us; the decoder (stream 175, its own thread) has a
    kernel that runs at once, one launched at 1000 us that starts only as the first graph run ends, and waits on both"""
    ev, c = [], iter(range(100))
    def launch(tid, ts, stream, name, start, dur):
        k = next(c)
        ev.append(dict(cat='cuda_runtime', ph='X', name='cudaLaunchKernel', tid=tid, ts=ts, dur=5, args=dict(correlation=k)))
        ev.append(dict(cat='kernel', ph='X', name=name, ts=start, dur=dur, args=dict(stream=stream, correlation=k)))
    for t0 in (0, 10000):
        ev.append(dict(cat='cuda_runtime', ph='X', name='cudaGraphLaunch', tid=1, ts=t0, dur=50, args=dict(correlation=next(c))))
        for i in range(9): ev.append(dict(cat='kernel', ph='X', name='conv', ts=t0 + 1000*i, dur=1000, args=dict(stream=7)))
        ev.append(dict(cat='cuda_runtime', ph='X', name='cudaEventSynchronize', tid=1, ts=t0 + 60, dur=900))   # (the fit's own)
    launch(2, 100, 175, 'ycbcr', 120, 40)          # (runs beside the graph: 20 us from launch to start)
    launch(2, 1000, 175, 'ycbcr', 9100, 40)        # (waits 8.1 ms: it starts 100 us after the graph's run ends)
    launch(2, 10500, 175, 'ycbcr', 12000, 40)      # (waits 1.5 ms, in the middle of the second run)
    for ts,dur in ((130, 30), (1010, 8130), (10510, 1530)):
        ev.append(dict(cat='cuda_runtime', ph='X', name='cudaEventSynchronize', tid=2, ts=ts, dur=dur))
    return ev

def test_loader_waits():
    r = sgl.loader_waits(_trace(), batches=2, graph_stream=7)
    assert r == dict(loader_kernels=1.5, loader_kernels_late=1.0, loader_kernels_late_wait_ms=4.8,
                     loader_kernels_late_after_graph=0.5, loader_event_syncs=1.5, loader_event_sync_ms=4.845)

def test_stream_split_finds_the_graph_stream():
    r = sgl.stream_split(_trace(), batches=2)
    assert list(r['per_stream']) == ['7', '175'] and r['per_stream']['7']['ms'] == 9.0
    assert r['loader_kernels_late'] == 1.0 and r['device_syncs'] == 0
