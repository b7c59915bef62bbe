"""Command line: `python -m attnres {info,demo} ...`."""
from __future__ import annotations

import argparse
import platform
import sys

import torch


def info(_args) -> int:
    import attnres
    from .demo import cpu_name as demo_cpu_name

    def has_kernel(key: str) -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key("attnres::depth_attention_fwd", key)

    cuda_ok = torch.cuda.is_available()
    rows = [
        ("attnres", attnres.__version__),
        ("torch", torch.__version__),
        ("torch CUDA build", torch.version.cuda or "none (CPU-only torch)"),
        ("python", platform.python_version()),
        ("CPU kernel", "yes" if has_kernel("CPU") else "no"),
        ("CUDA kernels compiled", "yes" if has_kernel("CUDA") else "no"),
        ("CUDA device", torch.cuda.get_device_name() if cuda_ok else "none visible"),
        ("CPU", demo_cpu_name()),
        ("torch threads", str(torch.get_num_threads())),
        ("default device", "cuda" if cuda_ok else "cpu"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def main(argv=None) -> int:
    from . import demo

    parser = argparse.ArgumentParser(prog="python -m attnres", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p_info = commands.add_parser("info", help="versions, compiled kernels, device")
    p_info.set_defaults(func=info)

    p_demo = commands.add_parser(
        "demo",
        help="train standard / Full / Block AttnRes GPTs over paired seeds on Python source; "
        "table, depth profile and plots",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(p_demo)
    p_demo.set_defaults(func=demo.run)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
