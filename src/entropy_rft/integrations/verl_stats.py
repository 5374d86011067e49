"""Old-policy TokenStats from verl's actor forward, and the rollout-stage keep mask chosen on the batch of all
data-parallel ranks (layer 3 of :mod:`entropy_rft.integrations.verl`; verl-free, the worker and engine there
call these).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from entropy_rft.control.carriage import checked_masks
from entropy_rft.control.registry import Method
from entropy_rft.core import dynamics
from entropy_rft.integrations.dist import all_gather_rows, rank_and_world
from entropy_rft.integrations.dist_select import dist_rollout_masks

PREFIX = "erft_"
STATS_FIELDS = ("entropy", "s_star", "s_expected", "s_centered")  # returned as erft_<field> by the old pass


def stats_model_output(output: Any, output_args: dict[str, Any], micro_batch: Any,
                       gather: Any = None) -> dict[str, Tensor]:
    """Old-policy TokenStats from the logits of verl's FSDP language-model forward (remove-padding path,
    no fused kernels): ``dynamics.token_stats`` on ``output.logits`` (packed, [1, nnz, V]) with verl's
    per-token temperature applied inside the pass (``temperature_rmpad``), labels ``input_ids_rmpad_rolled``;
    returned as nested tensors like verl's ``log_probs`` (``erft_entropy``, ``erft_s_star``,
    ``erft_s_expected``, ``erft_s_centered``).
    ``gather(t, pad_size)`` undoes sequence-parallel packing (the engine's ``_gather_and_unpad_packed``).
    """
    if "input_ids_rmpad_rolled" not in output_args:
        raise NotImplementedError("erft TokenStats need actor_rollout_ref.model.use_remove_padding=True")
    logits = output.logits.squeeze(0).detach()
    if not torch.is_floating_point(logits):
        raise NotImplementedError("erft TokenStats need the logits (use_fused_kernels=False)")
    if hasattr(logits, "full_tensor"):  # tensor-parallel DTensor, sharded on the vocabulary
        logits = logits.full_tensor()
    ids = output_args["input_ids_rmpad_rolled"].reshape(-1)
    # verl's per-token temperature goes into the statistics pass itself (no ``logits / T`` copy of the logits;
    # on CUDA the Triton kernel divides in float32 as it reads)
    temp = 1.0 if output_args.get("temperature_is_one", False) else output_args["temperature_rmpad"].reshape(-1)
    st = dynamics.token_stats(logits, ids, temp if isinstance(temp, float) else temp.float())
    cu = micro_batch["input_ids"].offsets()
    out = {}
    for f in STATS_FIELDS:
        v = getattr(st, f)
        if gather is not None:
            v = gather(v, output_args.get("pad_size", 0))
        out[PREFIX + f] = torch.nested.nested_tensor_from_jagged(v, cu)
    return out


def rollout_keep(method: Method, stats: dict[str, Tensor], advantages: Tensor, mask: Tensor) -> Tensor:
    """Rollout-stage keep mask of this rank's rows, chosen on the batch of *all* ranks, as the method's
    ``exchange`` declares (``integrations.dist_select``): ClipB and ClipV exchange only sums and their cap's
    top-k candidates, a per-token rule selects on this rank's rows; for a method that exchanges its tokens
    the per-token statistics ([B, T] response layout, keys ``entropy``/``s_star``/``s_expected``/
    ``s_centered``), the advantages and the response mask are all-gathered (``integrations.dist``) and
    ``method.rollout_masks`` runs on the concatenation. Methods without a rollout stage keep every valid
    token."""
    mask = mask.bool()
    if method.stage != "rollout":
        return mask
    if rank_and_world()[1] > 1:  # ClipB, ClipV: sums and top-k candidates; local rules: own rows (Method.exchange)
        st = dynamics.TokenStats(entropy=stats["entropy"].float(), logp=torch.zeros_like(stats["entropy"].float()),
                                 **{f: stats[f].float() for f in ("s_star", "s_expected", "s_centered")})
        local = dist_rollout_masks(method, st, advantages.float(), mask)
        if local is not None:
            return mask if local.keep is None else local.keep & mask
    g_mask, rows = all_gather_rows(mask, False)
    g_adv, _ = all_gather_rows(advantages.float(), 0.0)
    g = {f: all_gather_rows(stats[f].float(), 0.0)[0] for f in STATS_FIELDS}
    logp = torch.zeros_like(g["entropy"])  # not used by any rollout-stage rule
    st = dynamics.TokenStats(entropy=g["entropy"], logp=logp, s_star=g["s_star"],
                             s_expected=g["s_expected"], s_centered=g["s_centered"])
    keep = checked_masks(method, method.rollout_masks(st, g_adv, g_mask)).keep
    keep = g_mask if keep is None else keep & g_mask
    return keep[rows, : mask.shape[-1]]
