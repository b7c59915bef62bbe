"""An AttnRes model split into torch.distributed.pipelining stages on 2 gloo
ranks, with boundaries inside blocks (a stage starting with a partial block
sum): ScheduleGPipe and Schedule1F1B over 2 stages, ScheduleInterleaved1F1B
over 4 (2 per rank); Full and Block. The loss and every gradient equal the
unsplit model's (float64). The stages are attnres.pipelining.StreamStage: the
stream crosses a boundary as its tensors and is rebuilt with
DepthStream.unflatten. Also the StreamStage's own checks."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnres

from helpers import distributed_skip_reason, free_port

D, SUBLAYERS = 16, 7
BATCH, T, MICROBATCHES = 4, 6, 4
# Stage boundaries (outputs before each stage's first read). With S = 3, 4
# and 5 fall inside blocks; so does 2.
CUTS = {2: [0, 4, SUBLAYERS], 4: [0, 2, 4, 5, SUBLAYERS]}
SCHEDULES = {"ScheduleGPipe": 2, "Schedule1F1B": 2, "ScheduleInterleaved1F1B": 4}


class Sublayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.res = attnres.AttnResResidual(D)
        self.proj = torch.nn.Linear(D, D)

    def forward(self, stream):
        stream = stream.clone()
        stream.append(torch.tanh(self.proj(self.res(stream))))
        return stream


def make_layers(seed=0):
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList(Sublayer() for _ in range(SUBLAYERS)).double()
    final = attnres.AttnResResidual(D, dtype=torch.float64)
    with torch.no_grad():
        for r in [*(l.res for l in layers), final]:
            r.query.normal_(0, 0.5)
            r.norm_weight.uniform_(0.5, 1.5)
    return layers, final


def loss_fn(out, target):
    return (out - target).pow(2).sum()


def data():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, T, D, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, T, D, generator=gen, dtype=torch.float64))


def global_grads(stage, begin):
    """The stage's gradients under the unsplit model's parameter names."""
    grads = {}
    for name, p in stage.named_parameters():
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            name = f"layers.{begin + int(index)}.{rest}"
        grads[name.replace("head.", "final.")] = p.grad.clone()
    return grads


def _worker(rank, port, schedule_name, block_size, out_path):
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        layers, final = make_layers()
        cuts = CUTS[SCHEDULES[schedule_name]]
        n_stages = len(cuts) - 1
        mine = range(rank, n_stages, 2)  # stage i on rank i % 2 (the interleaved layout)
        modules = {i: attnres.pipelining.StreamStage(
            layers[cuts[i]:cuts[i + 1]], outputs_before=cuts[i], block_size=block_size,
            head=final if cuts[i + 1] == SUBLAYERS else None) for i in mine}
        stages = [pipelining.PipelineStage(modules[i], i, n_stages, torch.device("cpu"))
                  for i in mine]
        schedule_class = getattr(pipelining, schedule_name)
        # Summed microbatch losses, unscaled gradients: the unsplit model's sum.
        schedule = schedule_class(stages if n_stages > 2 else stages[0], MICROBATCHES,
                                  loss_fn=loss_fn, scale_grads=False)
        x, target = data()
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=losses)
        grads = {}
        for i in mine:
            grads.update(global_grads(modules[i], cuts[i]))
        torch.save({"grads": grads, "loss": sum(l.item() for l in losses)}, f"{out_path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


SKIP = distributed_skip_reason("torch.distributed.pipelining", "ScheduleInterleaved1F1B")


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "block"])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_pipeline_stages_split_inside_blocks_match_the_unsplit_model(schedule_name, block_size,
                                                                      tmp_path):
    out_path = tmp_path / "stage"
    mp.spawn(_worker, args=(free_port(), schedule_name, block_size, str(out_path)), nprocs=2)
    ranks = [torch.load(f"{out_path}.{r}") for r in range(2)]

    layers, final = make_layers()
    x, target = data()
    stream = attnres.DepthStream(x, block_size=block_size)
    for layer in layers:
        stream = layer(stream)
    loss = loss_fn(final(stream), target)
    loss.backward()
    assert ranks[1]["loss"] == pytest.approx(loss.item(), rel=1e-12)
    want = {f"layers.{n}": p.grad for n, p in layers.named_parameters()}
    want.update({f"final.{n}": p.grad for n, p in final.named_parameters()})
    got = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}\n{m}")


def test_stream_stage_alone():
    """The stages in one process, chained by hand, are the unsplit model."""
    layers, final = make_layers()
    x, _ = data()
    cuts = CUTS[4]
    stages = [attnres.pipelining.StreamStage(layers[a:b], outputs_before=a, block_size=3,
                                             head=final if b == SUBLAYERS else None)
              for a, b in zip(cuts, cuts[1:])]
    out = (x,)
    for stage in stages:
        out = stage(*out) if isinstance(out, tuple) else out
    stream = attnres.DepthStream(x, block_size=3)
    for layer in layers:
        stream = layer(stream)
    torch.testing.assert_close(out, final(stream), rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="outputs_before must be an int >= 0"):
        attnres.pipelining.StreamStage(layers, outputs_before=-1)
    with pytest.raises(TypeError, match="must return the DepthStream"):
        attnres.pipelining.StreamStage([torch.nn.Identity(), final], outputs_before=0)(x)


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_the_pipeline_example_reproduces_the_unsplit_loss():
    """examples/pipeline/train_pp.py under torchrun (2 CPU ranks): the first
    pipelined step's loss is the unsplit model's on the same batch."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "pipeline" / "train_pp.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(example), "--steps", "2"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    unsplit = re.search(r"unsplit model, first batch: loss (\S+)", run.stdout)
    first = re.search(r"step +1: pipelined loss (\S+)", run.stdout)
    assert unsplit and first, run.stdout
    assert float(first.group(1)) == pytest.approx(float(unsplit.group(1)), rel=1e-5)
