"How `fastai_dali.bench.traces` reads a torch.profiler trace (for the GPU scripts): the loader's kernels that wait behind the graph, the graph stream between replays, two traces side by side"
import fastai_dali.bench.traces as sgl

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
                     loader_kernels_late_after_graph=0.5, loader_kernels_late_by_name={'ycbcr': 1.0},
                     loader_event_syncs=1.5, loader_event_sync_ms=4.845)

def test_stream_split_finds_the_graph_stream():
    r = sgl.stream_split(_trace(), batches=2)
    assert list(r['per_stream']) == ['7', '175'] and r['per_stream']['7']['ms'] == 9.0
    assert r['loader_kernels_late'] == 1.0 and r['device_syncs'] == 0

def _replays():
    """Three replays (launched at 0, 10000, 25000 us; each graph's kernels 100 us after its launch, 9000 us long), the
    fit's thread waiting in DALI's `share_outputs` before the second (400 us) and the third (12000 us: a stall), one copy
    of the graph's stream between the first two replays and one after the last"""
    ev = []
    for i,t0 in enumerate((0, 10000, 25000)):
        ev.append(dict(cat='cuda_runtime', ph='X', name='cudaGraphLaunch', tid=1, ts=t0, dur=50, args=dict(correlation=100+i)))
        for k in range(9): ev.append(dict(cat='kernel', ph='X', name='conv', ts=t0 + 100 + 1000*k, dur=1000, args=dict(stream=7, correlation=100+i)))
    for ts,dur in ((9500, 400), (12000, 12000)):
        ev.append(dict(cat='python_function', ph='X', name='nvidia/dali/pipeline.py(1426): share_outputs', tid=1, ts=ts, dur=dur))
    for ts in (9300, 35000): ev.append(dict(cat='gpu_memcpy', ph='X', name='Memcpy DtoD', ts=ts, dur=100, args=dict(stream=7, correlation=7)))
    # the loader's thread (2): three copies and a launch in the stall (19100-25100), its kernels on stream 175 in it and before
    for ts,name,dur in ((20000, 'cudaMemcpyAsync', 50), (20050, 'cudaLaunchKernel', 10), (20100, 'cudaMemcpyAsync', 50), (20300, 'cudaMemcpyAsync', 50)):
        ev.append(dict(cat='cuda_runtime', ph='X', name=name, tid=2, ts=ts, dur=dur, args=dict(correlation=ts)))
    for ts in (5000, 21000): ev.append(dict(cat='kernel', ph='X', name='ycbcr', ts=ts, dur=1000, args=dict(stream=175, correlation=ts+1)))
    return ev

def test_between_replays():
    r = sgl.between_replays(_replays(), batches=3)
    # gaps 1000 and 6000 us; after the batch reached the host 200 (9900 to 10100) and 1100 (24000 to 25100); the waits
    # 400 and 12000; from the batch to the launch's end 150 and 1050; the copy between the replays, not the one after
    assert {k: v for k,v in r.items() if k != 'host_batch_to_launch_top'} == dict(
        gap_ms=3.5, gap_after_batch_on_host_ms=0.65, host_wait_ms=6.2, host_batch_to_launch_ms=0.6,
        graph_stream_work_between_ms=0.05, launch_to_first_kernel_median_ms=0.1, graph_launch_call_ms=0.05,
        stalls=dict(batches=1, of=2, share_of_gaps=0.86, gap_ms=6.0, host_wait_ms=12.0, launch_to_first_kernel_ms=0.1,
                    # in the stall's 6000 us the other stream's kernel 1000, the loader's thread's calls 160; elsewhere
                    # (28100 us of the span 0-34100) the other kernel, none of its calls; its copies 100 and 200 us apart
                    other_streams_busy=0.17, other_streams_busy_elsewhere=0.04, loader_thread_in_cuda_calls=0.03,
                    loader_thread_in_cuda_calls_elsewhere=0.0, loader_thread_copy_to_copy_median_us=150.0),
        python_calls_a_batch=1)
    assert r['host_batch_to_launch_top'] == {'cudaGraphLaunch': 0.05}
    assert sgl.between_replays(_trace(), batches=2) == {}   # (kernels not tied to the launches)

def test_trace_diff_kernels():
    td = sgl
    # Triton's numbered kernels and template arguments differ from one compilation to the next: one name for each
    assert [td.kernel_name(n) for n in ('triton_poi_fused_add_relu_12', 'void at::native::reduce_kernel<512, 1>(float*)')] == \
           ['triton_poi_fused_add_relu', 'void at::native::reduce_kernel<…>']
    inside,outside,n = td.graph_kernels(_replays())   # (the graph's 27 convolutions; outside it two copies, the loader's two kernels)
    assert (n, dict(inside), dict(outside)) == (3, {'conv': [27, 27000]}, {'Memcpy DtoD': [2, 200], 'ycbcr': [2, 2000]})
    rows = td.kernel_diff(inside, {'conv': [30, 36000]}, 3, 3, 5)   # (a B whose convolutions take a third longer)
    assert rows == [('conv', 9.0, 10.0, 9000.0, 12000.0, 3000.0)]
