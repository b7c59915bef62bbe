"""Adapters that run the published Triton AttnRes kernels on our problem.

Our problem: N source tensors [tokens, D] (a list, never stacked), a query
[D] and a key-norm gain [D]; h = sum_i softmax_i(scale * <q, gain * v_i *
rstd_i>) v_i with rstd_i = rsqrt(mean(v_i^2) + eps), scale = 1, eps = 1e-6.
Each adapter below only *calls* the peer's public function with our
arguments (no peer code is copied); where a peer needs one stacked tensor,
the adapter stacks, and that stacking (and its backward, which splits the
stacked gradient back into the N sources) is part of the timed call.

  fla        fla.ops.attnres.fused_attnres(query, residuals, rms_weight,
             output_rms_weight=None, rms_eps, scale=1.0, return_weights=False,
             checkpoint_level=1) from fla-core (flash-linear-attention),
             file fla/ops/attnres/fused.py. Takes the list of N sources as is
             (no stack: a table of N pointers, padded to a power of two >= 8);
             logits = <rms_norm(v, rms_weight, eps), query * scale>, softmax
             over the sources, o = sum p v: the same function as ours with
             rms_weight = gain. CUDA only (raises "Triton attnres requires CUDA
             tensors" otherwise); sources 16-byte aligned. Backward: its own
             Triton kernels (checkpoint_level=1, the default: the mixed
             output is recomputed in backward, not saved). Its kernels are
             autotuned (24 configs forward, 24 + 10 backward) per (next pow2
             of N, D, dtype), cached on disk by Triton.
  liger      liger_kernel.transformers.functional.liger_attn_res(V, w_query,
             w_norm, eps) (LigerAttnResFunction, file
             liger_kernel/ops/attn_res.py) from liger-kernel. Takes V stacked
             [N, ..., D] (a list would be stacked inside its autograd.Function
             forward, where autograd cannot return gradients to a list, so
             the adapter stacks: torch.stack(sources), timed). k =
             (v * rstd).to(w_norm.dtype) * w_norm, score = <w_query, k>,
             softmax, h = sum alpha v: ours with w_query = query, w_norm =
             gain (no scale argument: scale 1). Backward: its Triton kernel
             (dW_query, dW_norm by float atomics). One kernel per (next pow2
             of D, next pow2 of N >= 4); no autotuning.
  fla_gluon  (not run by default) FLA's opt-in Gluon backend,
             fla.ops.attnres.backends.gluon.AttnResGluonBackend().fused_attnres
             with the same arguments as fla, called directly rather than
             through FLA_ATTNRES_GLUON=1 dispatch so that fla and fla_gluon
             can run in one process; its own verifier decides support (CUDA,
             SM80+, D * itemsize >= 128 bytes).

What was checked without a GPU (tests/python/test_benchmarks.py): the fla
adapter's argument mapping against FLA's own pure-PyTorch reference
fla.ops.attnres.naive_attnres (same signature as fused_attnres), and the
liger adapter with Liger's Triton kernels under TRITON_INTERPRET=1 (the
Triton interpreter on CPU), both against attnres.depth_attention, forward
and backward, when the packages are importable. The fused FLA kernels refuse
CPU tensors and were not run.

  python benchmarks/peers.py --status              # what is installed / runnable here
  python benchmarks/peers.py --warmup --shapes bf16:9:65536:4096,...
      # one forward + backward of each peer per shape, untimed: fills Triton's
      # kernel and autotuning disk caches (gpu_check.sh runs this on the idle
      # GPU while the extension builds); never imports attnres.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

EPS = 1e-6


class PeerUnsupported(Exception):
    """The peer does not support this call (the row says why)."""


@dataclass(frozen=True)
class Peer:
    name: str
    distribution: str  # the pip distribution that ships it
    module: str  # what must import
    api: str  # the function called
    stacks: bool  # the adapter stacks the sources (timed as part of the call)

    def describe(self) -> str:
        how = ("sources stacked by the adapter with torch.stack, stacking and its backward timed"
               if self.stacks else "the list of sources passed as is (no stack)")
        return f"{self.api} ({self.distribution}); {how}"


PEERS: Dict[str, Peer] = {
    "fla": Peer("fla", "fla-core (flash-linear-attention)", "fla.ops.attnres",
                "fla.ops.attnres.fused_attnres", stacks=False),
    "liger": Peer("liger", "liger-kernel", "liger_kernel.transformers.functional",
                  "liger_kernel.transformers.functional.liger_attn_res", stacks=True),
    "fla_gluon": Peer("fla_gluon", "fla-core (flash-linear-attention)", "fla.ops.attnres.backends.gluon",
                      "fla.ops.attnres.backends.gluon.AttnResGluonBackend().fused_attnres", stacks=False),
}
DEFAULT_PEERS = ("fla", "liger")


def installed(name: str) -> bool:
    """Whether the peer's top-level package can be found (without importing it:
    importing fla takes seconds)."""
    top = PEERS[name].module.split(".")[0]
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def unavailable(name: str, device: str) -> Optional[str]:
    """Why the peer cannot run here, or None. Cheap: imports nothing."""
    peer = PEERS[name]
    if not installed(name):
        return f"not installed ({peer.distribution}; gpu_check.sh installs it from .whl/)"
    if not str(device).startswith("cuda"):
        return "not run on CPU: its Triton kernels need a CUDA GPU"
    return None


_LOADED: Dict[str, Callable] = {}


def load(name: str) -> Callable:
    """The adapter fn(sources, query, gain, eps=1e-6) -> h for the peer;
    raises ImportError (with the reason) when it cannot be imported."""
    if name in _LOADED:
        return _LOADED[name]
    if name == "fla":
        from fla.ops.attnres import fused_attnres

        def fn(sources, query, gain, eps=EPS):
            return fla_call(sources, query, gain, eps, impl=fused_attnres)
    elif name == "liger":
        from liger_kernel.transformers.functional import liger_attn_res

        def fn(sources, query, gain, eps=EPS):
            return liger_call(sources, query, gain, eps, impl=liger_attn_res)
    elif name == "fla_gluon":
        from fla.ops.attnres.backends.gluon import AttnResGluonBackend

        backend = AttnResGluonBackend()

        def fn(sources, query, gain, eps=EPS):
            sources = _as_list(sources)
            gain = _gain(query, gain)
            ok, why = backend.fused_attnres_verifier(query, sources, gain, rms_eps=eps)
            if not ok:
                raise PeerUnsupported(why or "rejected by its verifier")
            return backend.fused_attnres(query, sources, gain, rms_eps=eps)
    else:
        raise KeyError(f"unknown peer {name!r} ({', '.join(PEERS)})")
    fn.__name__ = f"peer_{name}"
    _LOADED[name] = fn
    return fn


def _as_list(sources):
    return list(sources.unbind(0)) if isinstance(sources, torch.Tensor) else list(sources)


def _gain(query, gain):
    # Both peers require a gain tensor; "no gain" is a gain of ones.
    return torch.ones_like(query) if gain is None else gain


def fla_call(sources, query, gain, eps=EPS, *, impl):
    """FLA: fused_attnres(query, residuals, rms_weight, rms_eps=eps) (scale 1,
    no output norm). ``impl`` is fused_attnres, or naive_attnres (FLA's
    PyTorch reference, same signature) for the CPU check of the mapping."""
    return impl(query, _as_list(sources), _gain(query, gain), rms_eps=eps)


def liger_call(sources, query, gain, eps=EPS, *, impl):
    """Liger: liger_attn_res(V [N, ..., D], w_query, w_norm, eps); V stacked
    here, inside the timed call."""
    n_elements = sources.numel() if isinstance(sources, torch.Tensor) else sum(s.numel() for s in sources)
    if n_elements >= 2**31:
        # Its kernels index V with i * n_tokens * D + tok * D in 32-bit
        # integers: on an H200 the bf16 N=9 x 65536 x 4096 call returned NaN
        # and its backward faulted, which leaves the process's CUDA context
        # unusable for every later call.
        raise PeerUnsupported(f"not run at >= 2^31 elements ({n_elements:.3g}): its Triton kernels "
                              "compute offsets in 32-bit integers (an illegal memory access)")
    v = sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))
    return impl(v, query, _gain(query, gain), eps)


# --------------------------------------------------------------------------- status / warm-up


def status_lines(device: str):
    lines = []
    for name, peer in PEERS.items():
        why = unavailable(name, device)
        version = ""
        if installed(name):
            try:
                from importlib.metadata import version as dist_version

                version = " " + dist_version({"fla": "fla-core", "fla_gluon": "fla-core",
                                              "liger": "liger-kernel"}[name])
            except Exception:
                pass
        lines.append(f"{name}{version}: {why or 'runnable'}; {peer.describe()}")
    return lines


def parse_shapes(text: str):
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    out = []
    for item in text.split(","):
        dt, n, t, d = item.strip().split(":")
        out.append((aliases.get(dt, dt), int(n), int(t), int(d)))
    return out


def warmup(names, shapes, device: str, deadline_s: float) -> int:
    """One forward + backward per peer and shape, untimed (compiles and
    autotunes; Triton keeps both on disk for the next process)."""
    t0 = time.monotonic()
    for dtype_name, N, T, D in shapes:
        for name in names:
            if time.monotonic() - t0 > deadline_s:
                print(f"warmup: deadline of {deadline_s:.0f} s reached", flush=True)
                return 0
            why = unavailable(name, device)
            if why:
                print(f"warmup {name}: {why}", flush=True)
                continue
            dtype = getattr(torch, dtype_name)
            t1 = time.monotonic()
            try:
                fn = load(name)
                free = torch.cuda.mem_get_info()[0]
                need = (3 if PEERS[name].stacks else 2) * (N + 1) * T * D * torch.tensor([], dtype=dtype).element_size()
                tt = T if need < 0.7 * free else max(256, int(T * 0.7 * free / need))
                srcs = [torch.randn(tt, D, device=device, dtype=dtype).requires_grad_(True) for _ in range(N)]
                q = (torch.randn(D, device=device) / math.sqrt(D)).requires_grad_(True)
                g = torch.ones(D, device=device).requires_grad_(True)
                h = fn(srcs, q, g)
                torch.autograd.grad(h, [*srcs, q, g], torch.randn_like(h))
                torch.cuda.synchronize()
                del srcs, h
                torch.cuda.empty_cache()
                print(f"warmup {name} {dtype_name} N={N} T={tt} D={D}: {time.monotonic() - t1:.1f} s", flush=True)
            except Exception as exc:  # the benchmark reports it properly
                print(f"warmup {name} {dtype_name} N={N} D={D}: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}"[:300], flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--status", action="store_true")
    ap.add_argument("--warmup", action="store_true")
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS))
    ap.add_argument("--shapes", default="bf16:9:65536:4096")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--deadline-s", type=float, default=180.0)
    args = ap.parse_args(argv)
    if args.warmup:
        return warmup(args.peers.split(","), parse_shapes(args.shapes), args.device, args.deadline_s)
    print("\n".join(status_lines(args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
