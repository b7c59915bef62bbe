"""fp32 N=16 [4096, 1024] forward+backward with the source gradients faulted in fresh
(malloc_trim before the call) vs recycled (heap kept), alternating in one process; prints
times and minor faults per call (docs/design.md §6, issue 8). Usage: fresh_buffers.py [rounds]."""
import ctypes, time, resource, statistics, sys, torch, attnres
libc = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
libc.mallopt(M_MMAP_THRESHOLD, 1 << 30); libc.mallopt(M_TRIM_THRESHOLD, 1 << 40)
torch.manual_seed(0)
N, T, D = 16, 4096, 1024
srcg = [torch.randn(T, D).requires_grad_() for _ in range(N)]
qg = (torch.randn(D) * 0.1).requires_grad_()
dh = torch.randn(T, D)
def fb():
    h = attnres.depth_attention(srcg, qg)
    return torch.autograd.grad(h, srcg + [qg], dh)
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2): fb()
res = {"fresh": [], "reused": []}; fl = {"fresh": [], "reused": []}
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 12):
    for mode in ("fresh", "reused"):
        if mode == "fresh": libc.malloc_trim(0)
        f0 = faults(); t0 = time.perf_counter(); r = fb(); t1 = time.perf_counter()
        fl[mode].append(faults() - f0); del r
        res[mode].append((t1 - t0) * 1e3)
for m in res:
    print(m, f"median {statistics.median(res[m]):.1f} ms min {min(res[m]):.1f} max {max(res[m]):.1f} faults {statistics.median(fl[m])}")
d = [a - b for a, b in zip(res["fresh"], res["reused"])]
print(f"paired diff median {statistics.median(d):.1f} ms -> {statistics.median(d)*1e3/256:.0f} us/MiB")
