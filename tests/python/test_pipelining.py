"""An AttnRes model split into torch.distributed.pipelining stages on 2 gloo
ranks, with boundaries inside blocks (a stage starting with a partial block
sum): ScheduleGPipe and Schedule1F1B over 2 stages, ScheduleInterleaved1F1B,
ScheduleLoopedBFS and ScheduleInterleavedZeroBubble over 4 (2 per rank); Full
and Block. The loss and every gradient equal the
unsplit model's (float64). The stages are attnres.pipelining.StreamStage: the
stream crosses a boundary as its tensors and is rebuilt with
DepthStream.unflatten. With a StreamCache (cross-stage caching) the
interleaved stages receive only the sources their rank does not hold: the
same loss and gradients, and the tensors each hop sends (counted at the
stage's send ops, forward and backward) are the expected, fewer ones. Also
the StreamStage's own checks."""
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
SCHEDULES = {"ScheduleGPipe": 2, "Schedule1F1B": 2, "ScheduleInterleaved1F1B": 4, "ScheduleLoopedBFS": 4,
             "ScheduleInterleavedZeroBubble": 4}


class Sublayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.res = attnres.AttnResResidual(D)
        self.proj = torch.nn.Linear(D, D)

    def forward(self, stream):
        stream = stream.clone()
        stream.append(torch.tanh(self.proj(self.res(stream))))
        return stream


def make_layers(seed=0, sublayers=SUBLAYERS):
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList(Sublayer() for _ in range(sublayers)).double()
    final = attnres.AttnResResidual(D, dtype=torch.float64)
    with torch.no_grad():
        for r in [*(l.res for l in layers), final]:
            r.query.normal_(0, 0.5)
            r.norm_weight.uniform_(0.5, 1.5)
    return layers, final


def loss_fn(out, target):
    return (out - target).pow(2).sum()


def unsplit_loss_and_grads(block_size, sublayers=SUBLAYERS):
    """The unsplit model's loss on data() and its gradients, by the stages'
    global names (layers.i..., final...)."""
    layers, final = make_layers(sublayers=sublayers)
    x, target = data()
    stream = attnres.DepthStream(x, block_size=block_size)
    for layer in layers:
        stream = layer(stream)
    loss = loss_fn(final(stream), target)
    loss.backward()
    grads = {f"layers.{n}": p.grad for n, p in layers.named_parameters()}
    grads.update({f"final.{n}": p.grad for n, p in final.named_parameters()})
    return loss.item(), grads


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


def sources_at(num_outputs, block_size):
    """The number of tensors of a stream after num_outputs outputs."""
    if block_size is None:
        return 1 + num_outputs
    return 1 + num_outputs // block_size + (num_outputs % block_size > 0)


def expected_hops(cuts, block_size, cached, ranks=2):
    """Tensors sent into each stage 1 .. C-1 (forward; backward the same)."""
    hops = []
    for j in range(1, len(cuts) - 1):
        n = sources_at(cuts[j], block_size)
        if cached and j >= ranks:  # less the completed sources the rank holds
            held = cuts[j - ranks + 1]
            n -= 1 + (held if block_size is None else held // block_size)
        hops.append(n)
    return hops


def count_sends(stage, sent):
    """Counts the tensors and elements the stage's send ops carry:
    sent[(stage_index, "fwd" | "bwd")] = [(tensors, elements) per op batch]."""
    for kind in ("fwd", "bwd"):
        get_ops = getattr(stage, f"get_{kind}_send_ops")

        def counted(chunk_id, get_ops=get_ops, kind=kind):
            ops = get_ops(chunk_id)
            sent.setdefault((stage.stage_index, kind), []).append(
                (len(ops), sum(op.tensor.numel() for op in ops)))
            return ops

        setattr(stage, f"get_{kind}_send_ops", counted)


def _worker(rank, port, schedule_name, block_size, out_path, cached=False):
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        layers, final = make_layers()
        cuts = CUTS[SCHEDULES[schedule_name]]
        n_stages = len(cuts) - 1
        mine = range(rank, n_stages, 2)  # stage i on rank i % 2 (the interleaved layout)
        cache = attnres.pipelining.StreamCache(cuts, num_ranks=2) if cached else None
        modules = {i: attnres.pipelining.StreamStage(
            layers[cuts[i]:cuts[i + 1]], outputs_before=cuts[i], block_size=block_size,
            head=final if cuts[i + 1] == SUBLAYERS else None, cache=cache) for i in mine}
        stage_class = (attnres.pipelining.StreamPipelineStage if cached
                       else pipelining.PipelineStage)
        stages = [stage_class(modules[i], i, n_stages, torch.device("cpu")) for i in mine]
        sent = {}
        for stage in stages:
            count_sends(stage, sent)
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
        torch.save({"grads": grads, "loss": sum(l.item() for l in losses), "sent": sent},
                   f"{out_path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


SKIP = distributed_skip_reason("torch.distributed.pipelining", "ScheduleInterleaved1F1B")


def run_and_compare(schedule_name, block_size, tmp_path, cached=False):
    """Runs the schedule on 2 ranks, checks the loss and every gradient
    against the unsplit model; returns {(stage, "fwd" | "bwd"): [(tensors,
    elements) per microbatch]} of the sends."""
    out_path = tmp_path / "stage"
    mp.spawn(_worker, args=(free_port(), schedule_name, block_size, str(out_path), cached),
             nprocs=2)
    ranks = [torch.load(f"{out_path}.{r}") for r in range(2)]

    loss, want = unsplit_loss_and_grads(block_size)
    assert ranks[1]["loss"] == pytest.approx(loss, rel=1e-12)
    got = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}\n{m}")
    return {**ranks[0]["sent"], **ranks[1]["sent"]}


def check_hops(sent, cuts, block_size, cached):
    """Each hop's sends, forward and backward, for every microbatch: the
    expected number of tensors, each a microbatch's [BATCH / M, T, D]."""
    per_tensor = BATCH // MICROBATCHES * T * D
    for j, n in enumerate(expected_hops(cuts, block_size, cached), start=1):
        # Stage j - 1 sends j's inputs forward; stage j sends their gradients back.
        for key in ((j - 1, "fwd"), (j, "bwd")):
            per_mb = [s for s in sent[key] if s[0]]  # a last stage's batches send nothing
            assert per_mb == [(n, n * per_tensor)] * MICROBATCHES, (key, sent[key])


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "block"])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_pipeline_stages_split_inside_blocks_match_the_unsplit_model(schedule_name, block_size,
                                                                      tmp_path):
    sent = run_and_compare(schedule_name, block_size, tmp_path)
    check_hops(sent, CUTS[SCHEDULES[schedule_name]], block_size, cached=False)


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "block"])
def test_cached_interleaved_stages_match_the_unsplit_model_and_send_less(block_size, tmp_path):
    """ScheduleInterleaved1F1B, 4 stages on 2 ranks, each rank's stages
    sharing a StreamCache: stage i + 2 takes the completed sources of stage
    i's output from its rank's cache, so the hops into stages 2 and 3 carry
    fewer tensors (Full: 2 and 1 of 5 and 6; Block S = 3: 2 and 1 of 3 and 3)."""
    cuts = CUTS[4]
    sent = run_and_compare("ScheduleInterleaved1F1B", block_size, tmp_path, cached=True)
    check_hops(sent, cuts, block_size, cached=True)
    naive, cached = (expected_hops(cuts, block_size, c) for c in (False, True))
    assert cached == ([3, 2, 1] if block_size is None else [2, 2, 1])
    assert naive == ([3, 5, 6] if block_size is None else [2, 3, 3])


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


def run_chained(cuts, ranks, block_size, microbatches=2):
    """The stages of one cached pipeline in one process, each rank's
    sharing a StreamCache, run stage by stage per microbatch as a schedule
    would (received tensors are fresh leaves; backward in reverse stage
    order). Returns the summed loss, the gradients and the tensors received
    per stage."""
    layers, final = make_layers()
    x, target = data()
    n = len(cuts) - 1
    caches = [attnres.pipelining.StreamCache(cuts, ranks) for _ in range(ranks)]
    stages = [attnres.pipelining.StreamStage(
        layers[cuts[i]:cuts[i + 1]], outputs_before=cuts[i], block_size=block_size,
        head=final if i == n - 1 else None, cache=caches[i % ranks]) for i in range(n)]
    total, received = 0.0, [0] * n
    for m, (xm, tm) in enumerate(zip(x.chunk(microbatches), target.chunk(microbatches))):
        inputs, outputs = [(xm,)], []
        for i in range(n):
            if i:
                inputs.append(tuple(t.detach().requires_grad_() for t in outputs[-1]))
                received[i] += len(inputs[-1])
            with caches[i % ranks].microbatch(m):
                outputs.append(stages[i](*inputs[-1]))
        loss = loss_fn(outputs[-1], tm)
        total += loss.item()
        loss.backward()
        for i in range(n - 2, -1, -1):
            pairs = [(o, t.grad) for o, t in zip(outputs[i], inputs[i + 1]) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    grads = {f"layers.{k}": p.grad for k, p in layers.named_parameters()}
    grads.update({f"final.{k}": p.grad for k, p in final.named_parameters()})
    return total, grads, received


@pytest.mark.parametrize("block_size", [None, 3], ids=["full", "block"])
@pytest.mark.parametrize("cuts,ranks", [([0, 1, 2, 3, 4, 5, 7], 3), ([0, 1, 2, 3, 4, 5, 6, 7], 2)],
                         ids=["P3V2", "P2V3.5"])
def test_cached_stages_chained_by_hand(cuts, ranks, block_size):
    """Other layouts than the distributed test's (3 ranks; 7 stages on 2
    ranks, one rank with a stage more), in one process: the unsplit model's
    loss and gradients, and the expected tensors per hop."""
    total, grads, received = run_chained(cuts, ranks, block_size)
    loss, want = unsplit_loss_and_grads(block_size)
    assert total == pytest.approx(loss, rel=1e-12)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}\n{m}")
    assert received[1:] == [2 * h for h in expected_hops(cuts, block_size, True, ranks)]
    assert sum(received) < 2 * sum(expected_hops(cuts, block_size, False, ranks))


def test_stream_cache_checks():
    Cache = attnres.pipelining.StreamCache
    with pytest.raises(ValueError, match="strictly increasing"):
        Cache([0, 2, 2, 7], 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        Cache([1, 2, 7], 2)
    with pytest.raises(ValueError, match="num_ranks must be an int >= 2"):
        Cache([0, 2, 7], 1)
    layers, final = make_layers()
    x, _ = data()
    cache = Cache([0, 2, 4, 7], 2)
    with pytest.raises(ValueError, match="not a stage boundary"):
        attnres.pipelining.StreamStage(layers[1:2], outputs_before=1, cache=cache)
    first = attnres.pipelining.StreamStage(layers[:2], outputs_before=0, cache=cache)
    with pytest.raises(RuntimeError, match="without a microbatch"):
        first(x)
    with torch.no_grad():  # shape inference: the None slot, taken before it is refilled
        first(x)
        with pytest.raises(RuntimeError, match="ran twice outside a microbatch"):
            first(x)
    cache.clear()
    third = attnres.pipelining.StreamStage(layers[4:], outputs_before=4, head=final, cache=cache)
    with cache.microbatch(0), pytest.raises(RuntimeError, match="no sources of stage 0"):
        third(x)
    wrong = attnres.pipelining.StreamStage(layers[:3], outputs_before=0, cache=cache)
    with cache.microbatch(0), pytest.raises(ValueError, match="cache's boundaries end the stage at 2"):
        wrong(x)


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
@pytest.mark.parametrize("options", [[], ["--virtual-stages", "2", "--stream-cache"]],
                         ids=["1F1B", "interleaved-cached"])
def test_the_pipeline_example_reproduces_the_unsplit_loss(options):
    """examples/pipeline/train_pp.py under torchrun (2 CPU ranks): the first
    pipelined step's loss is the unsplit model's on the same batch (also
    with 2 stages per rank sharing a StreamCache)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "pipeline" / "train_pp.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(example), "--steps", "2", *options],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    unsplit = re.search(r"unsplit model, first batch: loss (\S+)", run.stdout)
    first = re.search(r"step +1: pipelined loss (\S+)", run.stdout)
    assert unsplit and first, run.stdout
    assert float(first.group(1)) == pytest.approx(float(unsplit.group(1)), rel=1e-5)
