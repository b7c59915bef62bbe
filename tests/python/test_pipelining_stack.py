"""Pipeline stages combined with the rest of the training stack, on gloo CPU
ranks: 4 ranks with 2 virtual stages each (ScheduleInterleaved1F1B over 8
stages; also with cross-stage caching, a StreamCache per rank), activation
checkpointing inside the stages with each stage's module compiled, and FSDP2
sharding every stage over 2 data-parallel ranks (a 2 x 2 mesh). Loss and every
gradient equal the unsplit model's (float64)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnres

from helpers import distributed_skip_reason, free_port
import test_pipelining
from test_pipelining import MICROBATCHES, data, global_grads, loss_fn

SKIP = distributed_skip_reason("torch.distributed.pipelining", "ScheduleInterleaved1F1B")
SUBLAYERS = 11
# Outputs before each stage's first read: 8 stages, several starting inside a
# block of S = 3 (1, 4, 5, 7, 8, 10) and one holding a single sublayer.
CUTS_8 = [0, 1, 3, 4, 5, 7, 8, 10, SUBLAYERS]
CUTS_2 = [0, 5, SUBLAYERS]


class Checkpointed(torch.nn.Module):
    """A layer recomputed in the backward (attnres.checkpoint, non-reentrant)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, stream):
        return attnres.checkpoint(self.layer, stream)


def make_layers(seed=0):
    return test_pipelining.make_layers(seed, sublayers=SUBLAYERS)


def _run(pp_rank, pp_size, cuts, block_size, x, target, *, group=None, wrap=None,
         schedule_name="ScheduleInterleaved1F1B", microbatches=MICROBATCHES, cached=False):
    """One pipelined step; the stage modules this rank holds and its losses."""
    import torch.distributed.pipelining as pipelining

    layers, final = make_layers()
    n_stages = len(cuts) - 1
    mine = range(pp_rank, n_stages, pp_size)
    cache = attnres.pipelining.StreamCache(cuts, pp_size) if cached else None
    modules = {i: attnres.pipelining.StreamStage(
        layers[cuts[i]:cuts[i + 1]], outputs_before=cuts[i], block_size=block_size,
        head=final if cuts[i + 1] == SUBLAYERS else None, cache=cache) for i in mine}
    run = {i: wrap(m) if wrap else m for i, m in modules.items()}
    stage_class = attnres.pipelining.StreamPipelineStage if cached else pipelining.PipelineStage
    stages = [stage_class(run[i], i, n_stages, torch.device("cpu"), group=group) for i in mine]
    schedule_class = getattr(pipelining, schedule_name)
    schedule = schedule_class(stages if len(stages) > 1 else stages[0], microbatches,
                              loss_fn=loss_fn, scale_grads=False)
    losses = []
    if pp_rank == 0:
        schedule.step(x)
    elif pp_rank == pp_size - 1:
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    return modules, cuts, losses


def _save(modules, cuts, losses, path, full_grad=lambda g: g):
    grads = {}
    for i, m in modules.items():
        for p in m.parameters():
            p.grad = full_grad(p.grad)
        grads.update(global_grads(m, cuts[i]))
    torch.save({"grads": grads, "loss": sum(l.item() for l in losses)}, path)


def _worker(rank, world, port, case, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x, target = data()
        if case == "interleaved-4x2":
            for block_size in (None, 3):
                _save(*_run(rank, world, CUTS_8, block_size, x, target),
                      f"{out_path}.{block_size}.{rank}")
                _save(*_run(rank, world, CUTS_8, block_size, x, target, cached=True),
                      f"{out_path}.cached.{block_size}.{rank}")
        elif case == "checkpoint-compile":
            def wrap(stage):
                stage.layers = torch.nn.ModuleList(Checkpointed(l) for l in stage.layers)
                return torch.compile(stage, backend="aot_eager", fullgraph=True)  # inductor passes too (~1 min more)
            for block_size in (None, 3):
                modules, cuts, losses = _run(rank, world, CUTS_2, block_size, x, target, wrap=wrap,
                                             schedule_name="Schedule1F1B")
                # the checkpointed layers' parameters keep their names under .layer
                for m in modules.values():
                    m.layers = torch.nn.ModuleList(c.layer for c in m.layers)
                _save(modules, cuts, losses, f"{out_path}.{block_size}.{rank}")
        elif case == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
            pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
            half = x.shape[0] // 2  # each data-parallel replica takes half the batch
            mine = slice(dp_rank * half, (dp_rank + 1) * half)

            def wrap(stage):
                for layer in stage.layers:
                    fully_shard(layer, mesh=mesh["dp"])
                return fully_shard(stage, mesh=mesh["dp"])

            for block_size in (None, 3):
                modules, cuts, losses = _run(pp_rank, 2, CUTS_2, block_size, x[mine], target[mine],
                                             group=mesh["pp"].get_group(), wrap=wrap,
                                             schedule_name="Schedule1F1B", microbatches=2)
                losses = [l.detach() for l in losses]
                total = torch.tensor(sum(l.item() for l in losses), dtype=torch.float64)
                dist.all_reduce(total, group=mesh["dp"].get_group())
                losses = [total]
                # FSDP2 averages over the 2 replicas: the sum of halves / 2.
                _save(modules, cuts, losses, f"{out_path}.{block_size}.{rank}",
                      full_grad=lambda g: g.full_tensor() * 2)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check(out_path, ranks, block_size, last_ranks):
    got_ranks = [torch.load(f"{out_path}.{block_size}.{r}") for r in ranks]
    loss, want = test_pipelining.unsplit_loss_and_grads(block_size, SUBLAYERS)
    for r in last_ranks:
        assert got_ranks[r]["loss"] == pytest.approx(loss, rel=1e-12)
    got = {}
    for g in got_ranks:
        got.update(g["grads"])
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}\n{m}")


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_four_ranks_with_two_virtual_stages_each(tmp_path):
    out_path = tmp_path / "stage"
    mp.spawn(_worker, args=(4, free_port(), "interleaved-4x2", str(out_path)), nprocs=4)
    for block_size in (None, 3):
        _check(out_path, range(4), block_size, last_ranks=[3])
        _check(f"{out_path}.cached", range(4), block_size, last_ranks=[3])


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_checkpointed_layers_in_compiled_stages(tmp_path):
    out_path = tmp_path / "stage"
    mp.spawn(_worker, args=(2, free_port(), "checkpoint-compile", str(out_path)), nprocs=2)
    for block_size in (None, 3):
        _check(out_path, range(2), block_size, last_ranks=[1])


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_fsdp2_shards_each_stage_over_two_ranks(tmp_path):
    out_path = tmp_path / "stage"
    mp.spawn(_worker, args=(4, free_port(), "fsdp2", str(out_path)), nprocs=4)
    for block_size in (None, 3):
        # ranks (pp, dp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
        _check(out_path, range(4), block_size, last_ranks=[2, 3])
