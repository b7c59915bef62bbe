"""fp32 N=16 [4096, 1024] forward+backward with the CPU gradient cache on (its default 1 GiB
limit) and off (limit 0: every backward's source gradients come from malloc, which glibc
faults in from the OS again after the previous step freed them), alternating call by call in
one process under glibc's default settings; prints the median time and minor page faults per
call of each, and the paired ratio (docs/design.md §6, issue 8).
Usage: fresh_buffers.py [rounds]."""
import platform
import resource
import statistics
import sys
import time

import torch

import attnres

torch.manual_seed(0)
N, T, D = 16, 4096, 1024
srcs = [torch.randn(T, D).requires_grad_() for _ in range(N)]
query = (torch.randn(D) * 0.1).requires_grad_()
dh = torch.randn(T, D)


def forward_backward():
    h = attnres.depth_attention(srcs, query)
    return torch.autograd.grad(h, srcs + [query], dh)


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


modes = {"cache on": 1 << 30, "cache off": 0}
times = {m: [] for m in modes}
minor = {m: [] for m in modes}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
      f"torch {torch.__version__}; fp32 N={N} [{T}, {D}] forward+backward, {rounds} rounds")
for _ in range(rounds):
    for mode, limit in modes.items():
        attnres.set_cpu_gradient_cache_limit(limit)
        forward_backward()  # untimed: frees its gradients as the previous step would
        f0, t0 = faults(), time.perf_counter()
        grads = forward_backward()
        t1, f1 = time.perf_counter(), faults()
        del grads
        times[mode].append((t1 - t0) * 1e3)
        minor[mode].append(f1 - f0)
for mode in modes:
    print(f"{mode:9s}: median {statistics.median(times[mode]):7.1f} ms (min {min(times[mode]):.1f}, "
          f"max {max(times[mode]):.1f}), minor faults per call {statistics.median(minor[mode]):.0f}")
ratios = [on / off for on, off in zip(times["cache on"], times["cache off"])]
print(f"cache on / cache off, paired per round: median {statistics.median(ratios):.3f}")
