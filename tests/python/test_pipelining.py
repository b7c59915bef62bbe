"""A Block AttnRes model split into two torch.distributed.pipelining stages
inside a block (the second stage starts with a partial block sum), ScheduleGPipe
on 2 gloo ranks: the loss and every gradient equal the unsplit model's (float64). The
stream crosses the stage boundary as its tensors and is rebuilt there with
DepthStream.unflatten (the documented flat form)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnres

from helpers import distributed_skip_reason, free_port

D, S, SUBLAYERS, SPLIT = 16, 3, 5, 4  # the split leaves one output in the open block
BATCH, T, MICROBATCHES = 4, 6, 2


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


class FirstStage(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        stream = attnres.DepthStream(x, block_size=S)
        for layer in self.layers:
            stream = layer(stream)
        return tuple(stream.tensors())


class LastStage(torch.nn.Module):
    # What the first stage's stream was: S, SPLIT outputs, no declared readers.
    SPEC = attnres.StreamSpec(block_size=S, num_outputs=SPLIT, block_reads="auto", readers=None)

    def __init__(self, layers, final):
        super().__init__()
        self.layers, self.final = layers, final

    def forward(self, *tensors):
        stream = attnres.DepthStream.unflatten(tensors, self.SPEC)
        for layer in self.layers:
            stream = layer(stream)
        return self.final(stream)


def loss_fn(out, target):
    return (out - target).pow(2).sum()


def data():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, T, D, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, T, D, generator=gen, dtype=torch.float64))


def _worker(rank, port, out_path):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        layers, final = make_layers()
        module = (FirstStage(layers[:SPLIT]) if rank == 0
                  else LastStage(layers[SPLIT:], final))
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        # Summed microbatch losses, unscaled gradients: the unsplit model's sum.
        schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
        x, target = data()
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=losses)
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        torch.save({"grads": grads, "loss": sum(l.item() for l in losses)}, f"{out_path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


SKIP = distributed_skip_reason("torch.distributed.pipelining", "ScheduleGPipe")


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_two_stage_gpipe_split_inside_a_block_matches_the_unsplit_model(tmp_path):
    out_path = tmp_path / "stage"
    mp.spawn(_worker, args=(free_port(), str(out_path)), nprocs=2)
    first, last = torch.load(f"{out_path}.0"), torch.load(f"{out_path}.1")

    layers, final = make_layers()
    x, target = data()
    stream = attnres.DepthStream(x, block_size=S)
    for layer in layers:
        stream = layer(stream)
    loss = loss_fn(final(stream), target)
    loss.backward()
    assert last["loss"] == pytest.approx(loss.item(), rel=1e-12)
    want = {f"layers.{i}.{n}": p.grad for i, l in enumerate(layers[:SPLIT])
            for n, p in l.named_parameters()}
    want_last = {f"layers.{i}.{n}": p.grad for i, l in enumerate(layers[SPLIT:])
                 for n, p in l.named_parameters()}
    want_last.update({f"final.{n}": p.grad for n, p in final.named_parameters()})
    for got, expected in ((first["grads"], want), (last["grads"], want_last)):
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{name}\n{m}")
