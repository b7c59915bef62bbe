"""The CPU gradient cache on (its default 1 GiB limit) and off (limit 0: every call's large
outputs come from malloc, which glibc faults in from the OS again after the previous call
freed them), alternating call by call in one process under glibc's default settings, for
two cases: fp32 N=16 [4096, 1024] forward+backward (the source gradients) and fp32 N=4
[4096, 4096] forward alone (its 64 MiB output h). Prints the median time and minor page
faults per call of each, and the paired ratio (docs/design.md §6, issue 8).
Usage: fresh_buffers.py [rounds]."""
import platform
import resource
import statistics
import sys
import time

import torch

import attnres

torch.manual_seed(0)


def make_case(n, t, d, backward):
    srcs = [torch.randn(t, d).requires_grad_() for _ in range(n)]
    query = (torch.randn(d) * 0.1).requires_grad_()
    dh = torch.randn(t, d)

    def call():
        h = attnres.depth_attention(srcs, query)
        return torch.autograd.grad(h, srcs + [query], dh) if backward else h

    return call


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


CASES = {
    "fp32 N=16 [4096, 1024] forward+backward": (16, 4096, 1024, True),
    "fp32 N=4 [4096, 4096] forward": (4, 4096, 4096, False),
}
modes = {"cache on": 1 << 30, "cache off": 0}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
      f"torch {torch.__version__}; {rounds} rounds per case")
for name, shape in CASES.items():
    call = make_case(*shape)
    times = {m: [] for m in modes}
    minor = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, limit in modes.items():
            attnres.set_cpu_gradient_cache_limit(limit)
            del_me = call()  # untimed: frees its outputs as the previous step would
            del del_me
            f0, t0 = faults(), time.perf_counter()
            out = call()
            t1, f1 = time.perf_counter(), faults()
            del out
            times[mode].append((t1 - t0) * 1e3)
            minor[mode].append(f1 - f0)
    print(name)
    for mode in modes:
        print(f"  {mode:9s}: median {statistics.median(times[mode]):7.1f} ms (min {min(times[mode]):.1f}, "
              f"max {max(times[mode]):.1f}), minor faults per call {statistics.median(minor[mode]):.0f}")
    ratios = [on / off for on, off in zip(times["cache on"], times["cache off"])]
    print(f"  cache on / cache off, paired per round: median {statistics.median(ratios):.3f}")
