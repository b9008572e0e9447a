"""moonep inside PyTorch's training tools: each patched model against the same unpatched model, under the
same tool (DDP, accumulation, FSDP2, clipping, checkpoints, autocast), on every rank."""
import contextlib
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import moonep
from tests.harness.mp import SkipCase
from training_models import (HF_KINDS, KINDS, assert_close_dicts, batch, blocks, full_grads, full_params, loss_of,
                             mean_over_ranks, patched, rel, route_as, twins, unpatched)

SkipCase = getattr(sys.modules.get("__main__"), "SkipCase", SkipCase)  # noqa: F811  (mprun's own class)

FP32_TOL = 2e-5   # fp32 round-off of a different summation order, after 3 AdamW steps
BF16_TOL = 3e-2   # bf16 round-off (2^-8 relative per rounding, a few roundings deep)


def _two_ranks_suffice(case):
    """On CPU ranks, run ``case`` below 4 ranks only: at 4 (the 2-core CI runs 4 ranks on 2 cores) it adds a
    minute and no path that 2 ranks do not take.  Cases without it (a (2, 2) mesh, resharding 4 <-> 2, a
    global norm, ranks that disagree) still run at 4 CPU ranks, and CUDA ranks
    (tests/gpu/test_mp_training_gpu.py) run every case at 4."""
    def run(rt):
        if rt.world_size >= 4 and rt.device.type == "cpu":
            raise SkipCase("CPU ranks: runs at 2 ranks (4 adds no path; CUDA runs it at 4)")
        return case(rt)
    run.__name__, run.__doc__ = case.__name__, case.__doc__
    return run


def _hf_or_skip():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SkipCase("transformers is not installed (pip install -e .[hf])")


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train(rt, model, opt, steps, *, start=0, clip=None, global_batch=False, world=None):
    """``steps`` optimizer steps; returns each step's loss, averaged over the ranks."""
    losses = []
    for step in range(start, start + steps):
        ids = batch(step, rt.rank, world or rt.world_size, global_batch=global_batch, device=rt.device)
        opt.zero_grad()
        loss = loss_of(model, ids)
        loss.backward()
        if clip is not None:
            clip(model)
        opt.step()
        losses.append(mean_over_ranks(rt, loss))
    return losses


def _kinds():
    _hf_or_skip()
    return KINDS


# ------------------------------------------------------------------------------------------ DDP
@_two_ranks_suffice
def case_ddp_trains_as_the_unpatched_model(rt):
    """DistributedDataParallel(patched) == DDP(unpatched): 3 AdamW steps, a different batch per rank, nothing
    moonep-specific between backward() and step().  float64: the same losses and parameters to 1e-9; float32
    (the experts' default grouped_mm implementation): the same losses to fp32 round-off, the parameters to
    what AdamW makes of it (it divides a near-zero gradient by its own magnitude)."""
    for kind in _kinds():
        for dtype, tol, ptol in ((torch.float64, 1e-9, 1e-9), (torch.float32, FP32_TOL, 3e-3)):
            ref, mine = twins(kind, rt, dtype=dtype)
            dref, dmine = DDP(ref), DDP(mine)
            lr = _train(rt, dref, _adamw(dref), 3)
            lm = _train(rt, dmine, _adamw(dmine), 3)
            assert max(abs(a - b) / abs(b) for a, b in zip(lm, lr)) <= tol, (kind, dtype, lm, lr)
            want = {k: v.detach().double() for k, v in ref.named_parameters()}
            assert_close_dicts(full_params(dmine), want, ptol, f"{kind} {dtype} parameters after 3 DDP steps")


@_two_ranks_suffice
def case_foreach_optimizers_step_expert_dtensors_with_plain_parameters(rt):
    """torch's foreach optimizer kernels (AdamW's default on CUDA) refuse lists mixing DTensors and plain
    tensors; moonep steps such an optimizer under implicit replication.  With and without foreach, with an LR
    scheduler, the model's parameters (expert shards and plain ones) come out bitwise as the same optimizer
    leaves plain copies of the same tensors (on CUDA the foreach kernels and the per-tensor loop themselves
    differ in the last bit), and DTensor's implicit replication is off again afterwards."""
    from torch.distributed.tensor import DTensor

    _hf_or_skip()
    model = DDP(patched("mixtral", rt))
    loss_of(model, batch(0, rt.rank, device=rt.device)).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    assert any(isinstance(p, DTensor) for p in params) and not all(isinstance(p, DTensor) for p in params)
    plain = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731  (a shard's local tensor)
    local = lambda t: plain(t).detach().clone()  # noqa: E731
    start = [(local(p), local(p.grad)) for p in params]

    def two_steps(ps, foreach):
        opt = torch.optim.AdamW(ps, lr=1e-2, foreach=foreach)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        for _ in range(2):
            opt.step()
            sched.step()

    for foreach in (False, True):
        copies = []
        with torch.no_grad():
            for p, (p0, g0) in zip(params, start):
                plain(p).copy_(p0)
                p.grad = (DTensor.from_local(g0.clone(), p.device_mesh, p.placements, shape=p.shape,
                                             stride=p.stride()) if isinstance(p, DTensor) else g0.clone())
                copies.append(torch.nn.Parameter(p0.clone()))
                copies[-1].grad = g0.clone()
        two_steps(params, foreach)
        two_steps(copies, foreach)
        assert not DTensor._op_dispatcher._allow_implicit_replication
        differ = [i for i, (p, c) in enumerate(zip(params, copies)) if not torch.equal(local(p), c.detach())]
        assert not differ, (foreach, differ)


@_two_ranks_suffice
def case_gradient_accumulation_matches(rt):
    """1, 2 and 4 micro-batches under DDP.no_sync() give the unpatched model's gradients (of the whole batch
    under DDP); so does sync_grads after every micro-batch without a wrapper (safe at any point)."""
    for kind in _kinds():
        ids = torch.cat([batch(0, rt.rank, device=rt.device), batch(1, rt.rank, device=rt.device)])
        ref = DDP(unpatched(kind, device=rt.device))
        loss_of(ref, ids).backward()
        want = full_grads(ref)
        for micro in (1, 2, 4):
            model = DDP(patched(kind, rt))
            for i, chunk in enumerate(ids.chunk(micro)):
                ctx = model.no_sync() if i < micro - 1 else contextlib.nullcontext()
                with ctx:
                    (loss_of(model, chunk) / micro).backward()
            assert_close_dicts(full_grads(model), want, FP32_TOL, f"{kind} gradients, {micro} micro-batch(es)")
        mine = patched(kind, rt)  # no wrapper: sync_grads after each micro-batch
        for chunk in ids.chunk(4):
            (loss_of(mine, chunk) / 4).backward()
            moonep.training.sync_grads(mine)
        assert_close_dicts(full_grads(mine), want, FP32_TOL, f"{kind}, sync_grads after every micro-batch")


# ------------------------------------------------------------------------------------------ FSDP2
def _fully_shard(model, patched_model: bool, mp):
    """The README's recipe: moonep's experts first (patched models), then every block, then the root."""
    from torch.distributed.fsdp import fully_shard

    kw = {} if mp is None else dict(mp_policy=mp)
    if patched_model:
        moonep.training.fully_shard_experts(model, **kw)
    for block in blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


@_two_ranks_suffice
def case_fsdp2_trains_as_the_unpatched_model(rt):
    """fully_shard per block and at the root (after fully_shard_experts): the unpatched model's losses and
    gradients under FSDP2; with MixedPrecisionPolicy(bf16 params, fp32 reduce) within bf16 round-off.  (The
    experts' eager implementation: torch's CPU grouped_mm refuses the strides of FSDP2's unsharded weights.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for kind in _kinds():
        for mp, tol in ((None, FP32_TOL), (MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32), BF16_TOL)):
            ref, mine = twins(kind, rt, eager=True)
            ref, mine = _fully_shard(ref, False, mp), _fully_shard(mine, True, mp)
            # bf16 scores can round a top-k tie either way: the same routing in both (route_as)
            routed = route_as(ref, mine) if kind == "latent" and mp is not None else None
            grads, losses = [], []
            for model in (ref, mine):
                opt = _adamw(model)
                losses.append(_train(rt, model, opt, 1))
                grads.append(full_grads(model))
                losses[-1] += _train(rt, model, opt, 2, start=1)
            what = f"{kind} FSDP2 {'bf16' if mp else 'fp32'}"
            if routed is not None:  # every routing replayed; a flip now and then, not a different router
                assert not routed["pending"] and routed["tokens"] > 0, (what, routed)
                assert routed["flips"] <= max(2, routed["tokens"] // 10), (what, routed)
                what += f" ({routed['flips']} of {routed['tokens']} routings held to the reference's)"
            assert_close_dicts(grads[1], grads[0], tol, f"{what} gradients")
            assert max(abs(a - b) / abs(b) for a, b in zip(*losses)) <= tol, (what, losses)


def case_fsdp2_on_a_dp_by_ep_mesh(rt):
    """A (dp=2, ep=2) mesh: experts sharded over "ep" and data parallel over "dp" (fully_shard_experts with
    mesh["dp"]), every other parameter over all 4 ranks: the unpatched model's gradients and losses under
    FSDP2 over the 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    _hf_or_skip()
    if rt.world_size != 4:
        raise SkipCase("a (2, 2) mesh: runs at 4 ranks")
    mesh = init_device_mesh(rt.device.type, (2, 2), mesh_dim_names=("dp", "ep"))
    for kind in ("mixtral", "latent"):
        ref = _fully_shard(unpatched(kind, eager=True, device=rt.device), False, None)
        # (the transformers model is patched on the host, as built, and moved by the FSDP2 calls)
        mine = patched(kind, mesh["ep"], eager=True, device=rt.device if kind == "latent" else "cpu")
        moonep.training.fully_shard_experts(mine, mesh=mesh["dp"])
        mine = _fully_shard(mine, False, None)
        grads, losses = [], []
        for model in (ref, mine):
            opt = _adamw(model)
            losses.append(_train(rt, model, opt, 1))
            grads.append(full_grads(model))
            losses[-1] += _train(rt, model, opt, 2, start=1)
        assert_close_dicts(grads[1], grads[0], FP32_TOL, f"{kind} (dp, ep) mesh gradients")
        assert max(abs(a - b) / abs(b) for a, b in zip(*losses)) <= FP32_TOL, (kind, losses)


@_two_ranks_suffice
def case_fsdp2_refuses_sharding_experts_over_their_own_ranks(rt):
    """fully_shard_experts over a mesh that holds other expert-parallel ranks: ValueError naming mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    _hf_or_skip()
    if rt.world_size == 1:
        raise SkipCase("one rank: every mesh is this rank")
    mine = patched("mixtral", rt)
    world = init_device_mesh(rt.device.type, (rt.world_size,))
    try:
        moonep.training.fully_shard_experts(mine, mesh=world)
    except ValueError as e:
        assert "mesh: expected the data-parallel ranks" in str(e), e
    else:
        raise AssertionError("fully_shard_experts took a mesh over the expert-parallel ranks")


# ------------------------------------------------------------------------------------------ clipping
def case_clip_grad_norm_is_global(rt):
    """moonep.training.clip_grad_norm_ under DDP: the unpatched model's global norm (torch's clip), the same
    on every rank; torch's own clip refuses the patched model rather than returning a per-rank norm."""
    for kind in _kinds():
        ref, mine = twins(kind, rt)
        dref, dmine = DDP(ref), DDP(mine)
        ids = batch(0, rt.rank, device=rt.device)
        loss_of(dref, ids).backward()
        loss_of(dmine, ids).backward()
        want = torch.nn.utils.clip_grad_norm_(dref.parameters(), 0.05)
        got = moonep.training.clip_grad_norm_(dmine, 0.05)
        every = [None] * rt.world_size
        dist.all_gather_object(every, float(got), group=rt.cpu_group)
        assert len(set(every)) == 1, (kind, every)
        assert rel(got.double(), want.double()) <= FP32_TOL, (kind, float(got), float(want))
        assert_close_dicts(full_grads(dmine), full_grads(dref), FP32_TOL, f"{kind} clipped gradients")
        if kind != "latent" and rt.world_size > 1:  # torch's clip cannot add up sharded experts: it raises
            try:
                torch.nn.utils.clip_grad_norm_(dmine.parameters(), 0.05)
            except RuntimeError as e:
                assert "DTensor" in str(e), e
            else:
                raise AssertionError("torch.nn.utils.clip_grad_norm_ took a patched model")


@_two_ranks_suffice
def case_replicated_parameters_stay_identical(rt):
    """20 clipped DDP steps: every replicated parameter stays bitwise equal on every rank."""
    from moonep.training.params import fingerprint

    _hf_or_skip()
    for kind in ("mixtral", "latent"):
        dmine = DDP(patched(kind, rt))
        _train(rt, dmine, _adamw(dmine), 20, clip=lambda m: moonep.training.clip_grad_norm_(m, 0.05))
        prints = [fingerprint(p).tolist() for p in moonep.training.replicated_parameters(dmine.module)]
        every = [None] * rt.world_size
        dist.all_gather_object(every, prints, group=rt.cpu_group)
        assert all(e == every[0] for e in every), kind


@_two_ranks_suffice
def case_full_tensor_on_the_host_matches_dtensors(rt):
    """The host gather moonep uses for DTensors of GPU tensors over gloo groups (ranks sharing a GPU: DTensor's
    own collectives would hand gloo device memory) gives full_tensor()'s values: expert shards on the 1-D
    mesh, and FSDP2's 2-D shards of them."""
    from torch.distributed.fsdp import fully_shard

    from moonep.training.sharding import _via_host

    _hf_or_skip()
    if rt.device.type != "cpu":
        raise SkipCase("compares with DTensor's own gather, which gloo runs on CPU tensors only")
    mine = patched("mixtral", rt)
    shards = moonep.training.expert_parameters(mine)
    want = [p.full_tensor() for p in shards]
    assert all(torch.equal(_via_host(p), w) for p, w in zip(shards, want))
    moonep.training.fully_shard_experts(mine)
    fully_shard(mine)
    assert all(torch.equal(_via_host(p), p.full_tensor()) for p in moonep.training.expert_parameters(mine))


# ------------------------------------------------------------------------------------------ checkpoints
def _shared_dir(rt) -> str:
    box = [tempfile.mkdtemp(prefix="moonep-ckpt-") if rt.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=rt.cpu_group)
    return box[0]


def _dcp_run(rt, kind, path, *, load: bool, save: bool, start: int):
    """Train 3 steps from ``start`` over ``rt`` (DDP; the global batch split over the ranks), loading the
    model and optimizer from ``path`` first (``load``) and saving them after (``save``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = DDP(patched(kind, rt, seed=0 if not load else 9), process_group=rt.group)
    opt = _adamw(model)
    if load:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path, process_group=rt.group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = _train(rt, model, opt, 3, start=start, global_batch=True)
    if save:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=rt.group)
    return losses, model, opt


def case_dcp_reshards_between_4_and_2_ranks(rt):
    """torch.distributed.checkpoint of model and optimizer saved at 4 ranks and loaded at 2 (and the reverse):
    the next 3 steps' losses equal an uninterrupted run's (the same global batches at either size)."""
    _hf_or_skip()
    if rt.world_size != 4:
        raise SkipCase("saves at 4 ranks and loads at 2 (and the reverse): runs at 4 ranks")
    pair = dist.new_group([0, 1])
    rt2 = moonep.init(pair) if rt.rank < 2 else None
    for kind in ("mixtral", "latent"):
        # 4 -> 2: the uninterrupted run is the 4-rank one, 6 steps
        path = _shared_dir(rt)
        first, model, opt = _dcp_run(rt, kind, path, load=False, save=True, start=0)
        want = _train(rt, model, opt, 3, start=3, global_batch=True)
        if rt2 is not None:
            got, _, _ = _dcp_run(rt2, kind, path, load=True, save=False, start=3)
            assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= FP32_TOL, (kind, "4->2", got, want)
        rt.barrier()
        # 2 -> 4: the uninterrupted run is the 2-rank one
        path = _shared_dir(rt)
        want = None
        if rt2 is not None:
            _, model, opt = _dcp_run(rt2, kind, path, load=False, save=True, start=0)
            want = _train(rt2, model, opt, 3, start=3, global_batch=True, world=2)
        box = [want]
        dist.broadcast_object_list(box, src=0, group=rt.cpu_group)
        got, _, _ = _dcp_run(rt, kind, path, load=True, save=False, start=3)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, box[0])) <= FP32_TOL, (kind, "2->4", got, box[0])
        rt.barrier()


@_two_ranks_suffice
def case_full_checkpoint_loads_into_the_unpatched_model(rt):
    """full_state_dict (and torch's get_model_state_dict(full_state_dict=True)) of a patched, trained model
    loads into the unpatched transformers model with strict=True and gives its logits; save_pretrained on
    every rank writes the full model that from_pretrained of the unpatched class loads."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _hf_or_skip()
    for kind in HF_KINDS:
        mine = patched(kind, rt)
        _train(rt, mine, _adamw(mine), 1, clip=moonep.training.sync_grads)
        mine.eval()
        ids = batch(7, 0, device=rt.device)
        with torch.no_grad():
            logits = mine(input_ids=ids).logits
        fulls = [moonep.training.full_state_dict(mine)]
        if rt.device.type == "cpu" or rt.backend == "nccl":  # torch's gather hands gloo GPU memory
            fulls.append(get_model_state_dict(mine, options=StateDictOptions(full_state_dict=True)))
        for full in fulls:
            ref = unpatched(kind, seed=5, device=rt.device).eval()
            ref.load_state_dict(full, strict=True)
            with torch.no_grad():
                assert rel(ref(input_ids=ids).logits.double(), logits.double()) <= 1e-5, kind
        path = _shared_dir(rt)
        mine.save_pretrained(path)
        rt.barrier()
        ref = type(unpatched(kind)).from_pretrained(path).to(rt.device).eval()
        with torch.no_grad():
            assert rel(ref(input_ids=ids).logits.double(), logits.double()) <= 1e-5, kind
        rt.barrier()
        try:
            mine.save_pretrained(path, state_dict={})
        except ValueError as e:
            assert "state_dict" in str(e)
        else:
            raise AssertionError("save_pretrained took a state_dict for a patched model")


# ------------------------------------------------------------------------------------------ mixed precision
@_two_ranks_suffice
def case_autocast_matches_the_unpatched_model(rt):
    """Under torch.autocast(bfloat16) patched experts compute in bf16 where the unpatched ones do (eager
    implementation: F.linear autocasts), GPT-OSS included: logits and gradients within bf16 round-off.  bf16
    activations into fp32 experts behave as the unpatched module: its grouped_mm implementation computes in
    the weights' dtype and returns bf16; its eager implementation refuses the mix."""
    from moonep import experts as ex_mod, ops as ops_mod

    for kind in [k for k in _kinds() if k != "latent"]:
        ref, mine = twins(kind, rt, eager=True)
        ids = batch(3, rt.rank, device=rt.device)
        dev = rt.device.type
        seen, real = [], ex_mod._run
        # (the expert GEMM op's body runs the one in moonep.ops)
        ex_mod._run = ops_mod._run = lambda impl, g, lp, a, *args: seen.append(a.dtype) or real(impl, g, lp, a, *args)
        try:
            with torch.autocast(dev, dtype=torch.bfloat16):
                lm = loss_of(mine, ids)
        finally:
            ex_mod._run = ops_mod._run = real
        assert seen and set(seen) == {torch.bfloat16}, (kind, set(seen))
        with torch.autocast(dev, dtype=torch.bfloat16):
            lr = loss_of(ref, ids)
        assert abs(float(lm.detach()) - float(lr.detach())) <= BF16_TOL * abs(float(lr.detach())), kind
        lr.backward()
        lm.backward()
        from moonep.training.grads import all_reduce_grads
        all_reduce_grads(list(ref.parameters()), rt, average=True)
        moonep.training.sync_grads(mine)
        got, want = full_grads(mine), full_grads(ref)
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        scale = max(float(v.abs().max()) for v in want.values())
        assert worst <= 5 * BF16_TOL * scale, (kind, worst, scale)
    # bf16 activations into fp32 experts, on one experts module, as the unpatched module does it
    for eager in (False, True):
        ref, mine = twins("mixtral", rt, eager=eager)
        ex_ref, ex_mine = ref.model.layers[0].mlp.experts, mine.model.layers[0].mlp.experts
        g = torch.Generator().manual_seed(rt.rank)
        x = torch.randn(5, ref.config.hidden_size, generator=g).bfloat16().to(rt.device)
        idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)]).to(rt.device)
        w = torch.rand(5, 2, generator=g).to(rt.device)
        if eager:
            for ex in (ex_ref, ex_mine):
                try:
                    ex(x, idx, w)
                except (RuntimeError, ValueError) as e:
                    assert "dtype" in str(e), e
                else:
                    raise AssertionError("the eager implementation took bf16 activations into fp32 weights")
        else:
            a, b = ex_ref(x, idx, w), ex_mine(x, idx, w)
            assert a.dtype == b.dtype == torch.bfloat16 and rel(b.double(), a.double()) <= BF16_TOL


@_two_ranks_suffice
def case_latent_stack_under_autocast_matches_local(rt):
    """A LatentMoE stack under bf16 autocast: experts in bf16, the same loss as the stack without expert
    parallelism under the same autocast (within bf16 round-off)."""
    ref, mine = twins("latent", rt)
    ids = batch(4, rt.rank, device=rt.device)
    with torch.autocast(rt.device.type, dtype=torch.bfloat16):
        lr, lm = loss_of(ref, ids), loss_of(mine, ids)
    assert abs(float(lm) - float(lr)) <= BF16_TOL * abs(float(lr)), (float(lm), float(lr))
    assert any(key[2] == torch.bfloat16 for layer in mine.layers for key in layer._ep._cache)


# ------------------------------------------------------------------------------------------ consistency
def case_ranks_that_differ_are_refused_at_patch_time(rt):
    """Models built from different seeds: patch_hf_moe and prepare refuse them on every rank naming the first
    differing parameter; broadcast_from=0 copies rank 0's instead."""
    _hf_or_skip()
    if rt.world_size == 1:
        raise SkipCase("one rank cannot disagree with itself")
    from moonep.integrations import patch_hf_moe

    try:
        patch_hf_moe(unpatched("mixtral", seed=rt.rank, device=rt.device), rt)
    except ValueError as e:
        assert "model.embed_tokens.weight: expected the same value on every rank" in str(e), e
    else:
        raise AssertionError("patch_hf_moe took models that differ across ranks")
    mine = patch_hf_moe(unpatched("mixtral", seed=rt.rank, device=rt.device), rt, broadcast_from=0)
    ref = unpatched("mixtral", seed=0, device=rt.device).eval()
    ids = batch(2, rt.rank, device=rt.device)
    with torch.no_grad():
        assert rel(mine.eval()(input_ids=ids).logits.double(), ref(input_ids=ids).logits.double()) <= 1e-5
    stack = patched("latent", rt)
    with torch.no_grad():
        stack.embed.weight.add_(rt.rank)
    for kw in ({}, dict(broadcast_from=0)):
        try:
            moonep.training.prepare(stack, **kw)
        except ValueError as e:
            assert not kw and "embed.weight: expected the same value on every rank" in str(e), e
        else:
            assert kw, "prepare took a stack whose embedding differs across ranks"


# ------------------------------------------------------------------------------------------ generation
def case_generate_ranks_that_stop_apart_raise_together(rt):
    """generate() where the ranks stop at different steps: a MoonepError on every rank, naming the op, saying
    that the ranks left at different steps and to pass synced_gpus=True; with synced_gpus=True it works."""
    _hf_or_skip()
    if rt.world_size == 1:
        raise SkipCase("one rank always stops with itself")
    from moonep.integrations import patch_hf_moe

    ids = batch(5, rt.rank, device=rt.device)[:1]
    steps = 2 + 2 * (rt.rank % 2)  # odd ranks decode longer
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    # fixed buffers (the next call is a dispatch), buffers sized per call on the torch transport (the next
    # call is the sizing collective, on the same gloo group as the headers: seen at once too), and the default:
    # buffers sized per call, the instances on the launcher's transport (MPI under mpiexec) while the sizing
    # runs on the gloo group (was: both ranks waited out the timeout, and the group was left unusable)
    for mine in (patched("mixtral", rt).eval(),
                 patch_hf_moe(unpatched("mixtral", device=rt.device), rt, transport="torch").eval(),
                 patch_hf_moe(unpatched("mixtral", device=rt.device), rt).eval()):
        with torch.no_grad():
            t0 = time.perf_counter()
            try:
                mine.generate(ids, **kw)
            except moonep.MoonepError as e:
                msg = str(e)
                assert "left the collective at different steps" in msg and "synced_gpus=True" in msg, msg
                assert "sync #" in msg or "the end of generate()" in msg, msg
                assert "dispatch #" in msg or "sizing" in msg, msg
                assert time.perf_counter() - t0 < 10, f"raised after {time.perf_counter() - t0:.1f}s, not at once"
            else:
                raise AssertionError("generate() returned although the ranks stopped at different steps")
            out = mine.generate(ids, synced_gpus=True, **kw)
        assert out.shape[1] == ids.shape[1] + steps, out.shape


# ------------------------------------------------------------------------------------------ refusals
@_two_ranks_suffice
def case_wrappers_refuse_what_they_cannot_do_right(rt):
    """DDP of an unprepared module holding moonep layers, and fully_shard of a block whose experts did not
    get fully_shard_experts: refused at wrap time (expert shards are DTensors), never silently wrong."""
    from torch.distributed.fsdp import fully_shard

    from training_models import LatentLM

    stack = LatentLM(rt, device=rt.device)  # not prepared: DDP would broadcast rank 0's experts
    try:
        DDP(stack)
    except RuntimeError as e:
        assert "DTensor" in str(e), e
    else:
        raise AssertionError("DDP wrapped a module whose expert shards it would overwrite")
    try:
        fully_shard(LatentLM(rt, device=rt.device).layers[0])
    except (RuntimeError, ValueError, TypeError) as e:  # torch's words: overlapping or unnamed meshes
        assert "mesh" in str(e) or "Invariant" in str(e), e
    else:
        if rt.world_size > 1:
            raise AssertionError("fully_shard sharded the experts over the expert-parallel ranks")


# ------------------------------------------------------------------------------------------ recomputation
@_two_ranks_suffice
def case_activation_checkpointing_matches(rt):
    """Activation checkpointing (transformers' gradient_checkpointing_enable; torch.utils.checkpoint around
    each LatentMoE block): the unpatched model's gradients under DDP."""
    from torch.utils.checkpoint import checkpoint

    _hf_or_skip()
    for kind in ("mixtral", "latent"):
        ref, mine = twins(kind, rt)
        for m in (ref, mine):
            if kind == "latent":
                for layer in m.layers:
                    layer.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(layer.forward)
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        grads = []
        for model in (DDP(ref), DDP(mine)):
            loss_of(model, batch(6, rt.rank, device=rt.device)).backward()
            grads.append(full_grads(model))
        assert_close_dicts(grads[1], grads[0], FP32_TOL, f"{kind} gradients with activation checkpointing")
