"""What an island tells others about itself: its progress record (published every few seconds), its
status line, and its end-of-run summary (``--summary-json``). Definitions of the figures:
docs/DESIGN.md, "What we measure"; times in seconds, traffic in bytes."""

from __future__ import annotations

import time
from collections import Counter

from p2p_diloco.island.model import model_flops_utilization
from p2p_diloco.net.records import IslandProgress, finite_or_none


def progress_record(island, state: str) -> IslandProgress:
    """The island's signed progress record (``island``: a running :class:`p2p_diloco.island.peer.Island`).

    :param state: ``loading``, ``training`` or ``stopping``
    """
    stats, sync, learner = island.learner.stats, island.sync_stats, island.learner
    speed = learner.tokens_per_second()
    reasons = island.quarantine.flagged_reasons()  # (one read: the names and their reasons agree)
    return IslandProgress(
        island=island.config.island, peer_id=island.peer_id, fingerprint=island.fingerprint,
        device=island.device_name, state=state, maddrs=island.maddrs, inner_step=stats.inner_steps,
        tokens=stats.tokens, tokens_per_second=float(speed),
        mfu=model_flops_utilization(speed, island.flops_per_token, island.peak_flops) if speed > 0 else None,
        loss=finite_or_none(stats.loss_ema), eval_loss=finite_or_none(stats.eval_loss),
        fragment_versions=island.store.versions, fragment_hashes=island.store.hashes,
        rounds_ok=sync.rounds_ok, rounds_failed=sync.rounds_failed, rounds_rejected=sync.rounds_rejected,
        flagged=list(reasons), flag_reasons=reasons, refused=island.refused_peers(), bytes_sent=sync.bytes_sent, bytes_received=sync.bytes_received,
        peak_bytes_per_step=sync.peak_bytes_per_step, utilization=float(stats.utilization),
        goodput=float(min(1.0, stats.inner_time / max(1e-9, time.time() - island.launched))),
        clock_offset=round(float(island.clock.offset), 4), reachability=island.reachability, started=float(stats.first_step_start), time=time.time(),
    )


def status_text(island, others: list) -> str:
    """The island's one-line status (shown on a TTY, logged elsewhere)."""
    stats, sync = island.learner.stats, island.sync_stats
    loss = f"{stats.loss_ema:.3f}" if stats.loss_ema is not None else "-"
    eval_loss = f"{stats.eval_loss:.3f}" if stats.eval_loss is not None else "-"
    return (f"{island.config.island}: step {stats.inner_steps} | {stats.tokens / 1e6:.2f}M tok | "
            f"{island.learner.tokens_per_second():,.0f} tok/s | loss {loss} | eval {eval_loss} | "
            f"v{island.store.versions} | rounds {sync.rounds_ok} ok/{sync.rounds_failed} failed | "
            f"util {stats.utilization:.3f} | {len(others)} other islands")


def make_summary(island, stop_reason: str) -> dict:
    """The island's end-of-run figures (what ``--summary-json`` holds)."""
    config, stats, sync = island.config, island.learner.stats, island.sync_stats
    outer_periods = stats.wall_time / config.outer.period if stats.wall_time else 0.0
    checkpointer = island.checkpointer
    return {
        "island": config.island,
        "run_id": config.run_id,
        "peer_id": island.peer_id,
        "fingerprint": island.fingerprint,
        "device": str(island.device),
        "ranks": island.ranks.world if island.ranks is not None else 1,
        "island_parallel": island.ranks.parallel if island.ranks is not None else None,
        "preset": config.model.preset,
        "parameters": island.parameters,
        "stop_reason": stop_reason,
        "wall_seconds": round(stats.wall_time, 3),
        "inner_steps": stats.inner_steps,
        "tokens": stats.tokens,
        # this process's tokens over its own time (a resumed island's checkpoint brought the rest)
        "tokens_per_second": round(stats.tokens_this_run / stats.wall_time, 2) if stats.wall_time else 0.0,
        "model_flops_per_token": island.flops_per_token,
        "mfu": model_flops_utilization(stats.tokens_this_run / stats.inner_time, island.flops_per_token,
                                       island.peak_flops) if stats.inner_time else None,  # over time in inner steps
        "inner_steps_per_outer_period": round(stats.inner_steps / outer_periods, 2) if outer_periods else None,
        "outer_rounds_ok": sync.rounds_ok,
        "outer_rounds_failed": sync.rounds_failed,
        "outer_rounds_skipped": sync.rounds_skipped,
        "outer_rounds_rejected": sync.rounds_rejected,
        "flagged_islands": island.quarantine.names(),
        "group_sizes": {str(k): v for k, v in sorted(Counter(sync.group_sizes).items())},
        "state_downloads": sync.reloads,
        "fragment_versions": island.store.versions,
        "loss_first": stats.loss_first,
        "loss_last": stats.loss,
        "eval_loss_first": stats.eval_loss_first,
        "eval_loss_last": stats.eval_loss,
        "compute_utilization": round(stats.utilization, 4),
        "bytes_sent": sync.bytes_sent,
        "bytes_received": sync.bytes_received,
        **bandwidth_figures(sync, stats.tokens, island.parameters, island.tokens_per_step),
        "elements_clipped": sync.clipped,
        "clock_offset": round(float(island.clock.offset), 4),
        "reachability": island.reachability,
        "resumed_from": str(island.resumed_from) if island.resumed_from else None,
        "checkpoint": checkpointer.last if checkpointer is not None else None,
    }


def bandwidth_figures(sync, tokens: int, parameters: int, tokens_per_step: int) -> dict:
    """Traffic per token, next to what data-parallel training of the same model would send.

    A ring all-reduce of fp32 gradients sends 2 x parameters x 4 bytes per worker and inner step
    (2 (n-1)/n of the gradient, rounded up to 2), which for this island's batch is
    ``8 * parameters / tokens_per_step`` bytes per token. Ours: the bytes this island sent, rounds
    and state downloads served together, per token it trained.

    :param sync: the syncer's stats (bytes counted by the codecs and the state transfers)
    :param tokens: tokens this island trained
    :param parameters: model parameters
    :param tokens_per_step: tokens per inner step (batch x sequence length)
    :returns: bytes_per_token (sent), round_bytes_per_token (rounds only, sent), dp_bytes_per_token,
        reduction_vs_dp (dp / ours; None when nothing was sent), peak_bytes_per_inner_step
    """
    dp = 2.0 * parameters * 4 / max(1, tokens_per_step)
    ours = sync.bytes_sent / tokens if tokens else None
    return {
        "bytes_per_token": round(ours, 3) if ours is not None else None,
        "round_bytes_per_token": round(sync.round_bytes_sent / tokens, 3) if tokens else None,
        "dp_bytes_per_token": round(dp, 3),
        "reduction_vs_dp": round(dp / ours, 1) if ours else None,
        "peak_bytes_per_inner_step": sync.peak_bytes_per_step,
    }
