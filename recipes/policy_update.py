"""One policy-gradient update: a batch of rollouts -> `epochs` x `minibatches` optimizer steps of
the clipped, importance-weighted policy loss (recipes/losses.py), plus the algorithm's own term
(PPO's value loss) and the KL to the initial policy."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from recipes import corrections as C
from recipes import losses as L
from recipes import routing_replay as RR
from recipes.batch import Batch, build_batch, completion_logits, token_logprobs
from recipes.exact_policy import straight_through
from recipes.ranks import my_rows, same_permutation
from recipes.run import Run


def update(run: Run, rollouts: list, rewards: torch.Tensor) -> dict:
    """One batch of rollouts -> `epochs` x `minibatches` optimizer steps. Returns metrics."""
    args, device = run.args, run.accelerator.device
    batch = build_batch(rollouts, run.tokenizer.pad_token_id or 0).to(device)
    batch.replay = bool(getattr(args, "routing_replay", False))
    routing = {}
    batch.rollouts = rollouts  # --on-policy exact scores them (recipes/exact_policy.py)
    old = _before_update(run, batch, rewards.to(device), routing)
    stats = {"clip_ratio": [], "kl": [], "loss": [], "value_loss": []}
    if len(rollouts) // args.minibatches < run.accelerator.num_processes:
        raise ValueError(f"{len(rollouts)} rollouts in {args.minibatches} minibatches leave a rank of "
                         f"{run.accelerator.num_processes} without rows")
    own = torch.zeros(len(rollouts), dtype=torch.bool, device=device)  # the rows this rank trains on
    for epoch in range(args.epochs):
        perm = same_permutation(len(rollouts), args.seed * 1_000_003 + run.version * 101 + epoch, device)
        for idx in perm.chunk(args.minibatches):
            idx = my_rows(idx, run.accelerator)
            own[idx] = True
            _minibatch_step(run, batch, old, idx, stats)
    mask = batch.mask * own.unsqueeze(1)
    log_r = C.log_ratios(old.logp, batch.engine_logp, mask)
    diff = log_r.abs()
    is_ratio = torch.exp(log_r)
    n_tok = mask.sum().clamp(min=1)
    mean = {k: sum(v) / len(v) for k, v in stats.items() if v}
    # share of tokens the run's correction truncated or dropped (0 without one)
    cut = C.correct(args.is_mode, log_r, mask, args.is_cap, args.is_floor).cut if correcting(args) else None
    return {
        **mean,
        **routing,
        "entropy": old.entropy,
        "sampling/sampling_logp_difference/mean": (diff.sum() / n_tok).item(),
        "sampling/sampling_logp_difference/max": diff.max().item(),
        "sampling/importance_sampling_ratio/min": is_ratio[mask.bool()].min().item(),
        "sampling/importance_sampling_ratio/mean": L.masked_mean(is_ratio, mask).item(),
        "sampling/importance_sampling_ratio/max": is_ratio[mask.bool()].max().item(),
        "sampling/importance_sampling_ratio/capped": 0.0 if cut is None else cut.sum().item() / n_tok.item(),
        **{f"mismatch/{k}": v for k, v in C.mismatch(log_r, mask).items()},
        **{f"mismatch/cut/{k}": v for k, v in C.cut_shares(log_r, mask).items()},
    }


def correcting(args) -> bool:
    """Whether the loss carries a correction's weights (--is-mode, not switched off by --is-cap 0)."""
    return args.is_mode != "none" and (args.is_cap is None or args.is_cap > 0)


def _before_update(run: Run, batch: Batch, rewards: torch.Tensor, routing: dict) -> SimpleNamespace:
    """What the update needs from the policy as it was: logprobs, values, entropy (unless the
    algorithm takes them from the training forward), the reference's logprobs, advantages; with a
    mixture of experts' routes, `routing["routing/mismatch"]`: the share of tokens the policy would
    route otherwise than the engine did in some layer (what --routing-replay removes)."""
    args = run.args
    old = SimpleNamespace(logp=None, values=None, entropy=None, ref_logp=None, adv=None, returns=None)
    with torch.no_grad():
        if run.algo.single_pass:  # filled, row by row, by the training forward
            old.logp = torch.zeros_like(batch.engine_logp)
            if batch.routes is not None:
                routing["routing/mismatch"] = _mismatch(run.module, batch)
        else:
            with RR.observe(run.module) if batch.routes is not None else contextlib.nullcontext() as seen:
                logits, old.values = completion_logits(run.module, batch, args.temperature)
            if batch.routes is not None:
                routing["routing/mismatch"] = _mismatch(run.module, batch, seen)
            old.logp = _logprobs(run, batch, logits, range(len(batch.rollouts)))
            old.entropy = L.masked_mean(L.entropy_from_logits(logits), batch.mask).item()
            del logits
        if run.ref is not None:
            old.ref_logp = token_logprobs(completion_logits(run.ref, batch, args.temperature)[0], batch.targets)
        old.adv, old.returns = run.algo.advantages(rewards, batch.mask, old.values)
    return old


def _logprobs(run: Run, batch: Batch, logits: torch.Tensor, rows) -> torch.Tensor:
    """The completion tokens' logprobs from the trainer's logits; with --on-policy exact, the engine's
    bits for them (`rows` of the step's rollouts) with the logits' gradient."""
    logp = token_logprobs(logits, batch.targets)
    if run.exact is None:
        return logp
    exact = run.exact.logprobs(run.policy(), batch.rollouts, list(rows), logp.shape[1])
    return straight_through(logp, exact) if torch.is_grad_enabled() else exact.to(logp.device)


def _mismatch(model, batch: Batch, seen: list | None = None) -> float:
    """routing_mismatch of the policy's own routes (observed in a forward, else one made for it)."""
    own = RR.own_routing(model, batch.input_ids) if seen is None else RR.stacked(seen, *batch.input_ids.shape)
    return RR.routing_mismatch(own, batch.routes, batch.route_mask)


def _minibatch_step(run: Run, batch: Batch, old: SimpleNamespace, idx: torch.Tensor, stats: dict) -> None:
    args = run.args
    mb = batch.select(idx)
    m = mb.mask
    logits, values = completion_logits(run.module, mb, args.temperature)
    logp = _logprobs(run, mb, logits, idx.tolist())
    if run.algo.single_pass:  # one minibatch step per row: its pre-update logprobs are these
        old.logp[idx] = logp.detach()
        with torch.no_grad():
            old.entropy = L.masked_mean(L.entropy_from_logits(logits), m).item()
    del logits
    # The clip is around the trainer's policy before this update (the proximal policy); truncated
    # importance weights correct for the engine having sampled from another policy: its own
    # numerics in sync mode, the previous step's weights with --async (AReaL's decoupled PPO).
    # Without a correction and with --async, the ratio is taken against the sampling policy instead.
    behaviour = batch.engine_logp if args.async_ and not correcting(args) else old.logp
    is_w = None
    if correcting(args):  # whole rows: a sequence mode's ratio is over the sequence
        log_r = C.log_ratios(old.logp[idx], batch.engine_logp[idx], m)
        is_w = C.correct(args.is_mode, log_r, m, args.is_cap, args.is_floor).weights
    pg, clipped = L.clipped_policy_loss(logp, behaviour[idx], old.adv[idx], m, args.clip_low, args.clip_high, is_w)
    loss = L.aggregate(pg, m, args.loss_agg, args.max_tokens)
    kl = torch.zeros((), device=logp.device)
    if old.ref_logp is not None:
        kl = L.masked_mean(L.k3_kl(logp, old.ref_logp[idx]), m)
        loss = loss + args.beta * kl
    extra = run.algo.extra_loss(values, None if old.values is None else old.values[idx],
                                None if old.returns is None else old.returns[idx], m)
    if extra is not None:
        loss = loss + args.vf_coef * extra
        stats["value_loss"].append(extra.item())
    run.optimizer.zero_grad(set_to_none=True)
    run.accelerator.backward(loss)
    run.accelerator.clip_grad_norm_(run.module.parameters(), 1.0)
    run.optimizer.step()
    stats["clip_ratio"].append(L.masked_mean(clipped, m).item())
    stats["kl"].append(kl.item())
    stats["loss"].append(loss.item())
