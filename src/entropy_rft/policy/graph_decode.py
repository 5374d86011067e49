"""The static sampler's decode loop, shaped so that a GPU can run it without waiting on the host.

:func:`decode` samples responses with a :class:`entropy_rft.policy.fast_llama.StaticDecoder`. One step (append
the last tokens, compute the next logits, draw, mark the rows that emitted EOS) is :func:`_Loop.body`:

- every piece of state is a tensor on the device: the step number, the ``done`` flags, the tokens, the
  output buffers (written with ``index_copy_`` at the step number);
- the draw is torch's own one-sample multinomial without its host-side validity checks
  (:func:`draw_token`), so the same generator gives the same tokens as ``torch.multinomial``;
- nothing reads a value back, so the step can be captured in a CUDA graph and replayed.

The host looks at ``done`` only every ``check_every`` steps, through a non-blocking copy into pinned memory
(one event wait per check, not one per token), and it drops finished rows from the cache only there:

- ``buckets=False`` (the eager default): the rows still going, once at most ``compact_below`` of those held
  are (:meth:`StaticDecoder._compact`). With ``check_every=1`` this is the loop that
  :func:`entropy_rft.policy.rollout.sample_kv` runs, token for token and draw for draw: the generator ends in the
  same state;
- ``buckets=True``: batch sizes of powers of two (B, then 2^k < B down to 8): a finished row stays held until
  the going rows fit the next smaller size, so a CUDA graph is captured once per size, not per row count.

``cuda_graph=True`` (CUDA only) captures one graph per batch size with the sampling generator registered
(``CUDAGraph.register_generator_state``): a replay draws the numbers the eager step would draw. Rows that are
done keep receiving ``pad_id`` and no mask; the output is trimmed after the last column any row used, so it
has the shape the eager loop returns. The only difference a check interval makes is that the generator
advances by up to ``check_every - 1`` further draws after the last row finished.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The smallest batch-size bucket: below it a graph per size costs more than the rows it drops.
MIN_BUCKET = 8


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero the tail outside the smallest set whose mass reaches top_p (nucleus sampling)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    drop = (cum - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def draw_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    """One token per row from softmax(z / T) (nucleus-filtered when top_p < 1); greedy at T = 0.

    The draw is argmax(p / q) with q ~ Exp(1) from ``generator``: the Gumbel-max trick in exponential form,
    which is how ``torch.multinomial(p, 1)`` draws one sample (the same numbers from the same generator state;
    tested), minus the checks that read the probabilities back to the host. No host synchronisation."""
    if temperature == 0:
        return logits.float().argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(-1)


def bucket_sizes(batch: int) -> list[int]:
    """Batch sizes the cache may hold, largest first: ``batch``, then the powers of two below it down to
    :data:`MIN_BUCKET`."""
    sizes, s = [batch], 1 << max(0, (batch - 1).bit_length() - 1)
    while s >= MIN_BUCKET and s < batch:
        sizes.append(s)
        s //= 2
    return sizes


class _Loop:
    """The state of one decode: tensors the step reads and writes in place (a graph replays on them)."""

    def __init__(self, dec, first_logits: Tensor, *, max_new_tokens: int, temperature: float, top_p: float,
                 eos_id: int, pad_id: int, generator: torch.Generator | None):
        self.dec, self.temperature, self.top_p, self.gen = dec, temperature, top_p, generator
        self.eos_id, self.pad_id = eos_id, pad_id
        b, dev = first_logits.shape[0], first_logits.device
        self.b, self.vocab = b, first_logits.shape[-1]
        self.out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=dev)
        self.valid = torch.zeros(b, max_new_tokens, dtype=torch.bool, device=dev)
        self.tok = draw_token(first_logits, temperature, top_p, generator)
        self.out[:, 0] = self.tok
        self.valid[:, 0] = True
        self.done = self.tok == eos_id
        self.step = torch.ones(1, dtype=torch.long, device=dev)  # the response column the next step writes

    def body(self) -> None:
        """One token for every row, in place: extend the held rows, draw, pad the finished rows."""
        dec = self.dec
        full = dec.rows.shape[0] == self.b
        logits = dec.extend(self.tok if full else self.tok[dec.rows], self.step)
        if not full:  # rows not held get logits 0: their draw is discarded, and it takes the same numbers
            logits = logits.new_zeros(self.b, self.vocab).index_copy(0, dec.rows, logits)
        new = draw_token(logits, self.temperature, self.top_p, self.gen)
        new = torch.where(self.done, torch.full_like(new, self.pad_id), new)
        self.out.index_copy_(1, self.step, new[:, None])
        self.valid.index_copy_(1, self.step, ~self.done[:, None])
        self.done.logical_or_(new == self.eos_id)
        self.tok.copy_(new)
        self.step.add_(1)

    def state(self) -> list[Tensor]:
        return [self.out, self.valid, self.tok, self.done, self.step]


class _Going:
    """How many rows are still going, read on the host: at once on CPU, through a pinned non-blocking copy
    and an event on CUDA (the only wait on the device in a check)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros(1, dtype=torch.long, pin_memory=True)
            self.event = torch.cuda.Event()

    def __call__(self, done: Tensor) -> int:
        n = (~done).sum()
        if not self.cuda:
            return int(n)
        self.host.copy_(n.view(1), non_blocking=True)
        self.event.record()
        self.event.synchronize()
        return int(self.host[0])


def _capture(loop: _Loop, pool) -> torch.cuda.CUDAGraph:
    """Capture ``loop.body`` for the rows held now. A warm-up run first (lazy library set-up happens outside
    the capture); everything it changed is put back, the generator included, so the tokens do not move."""
    dev = loop.tok.device
    saved = [t.clone() for t in loop.state()]
    gen_state = loop.gen.get_state() if loop.gen is not None else torch.cuda.get_rng_state(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        loop.body()  # writes the cache slot the replay rewrites with the same values
    torch.cuda.current_stream(dev).wait_stream(side)
    for t, s in zip(loop.state(), saved):
        t.copy_(s)
    if loop.gen is not None:
        loop.gen.set_state(gen_state)
    else:
        torch.cuda.set_rng_state(gen_state, dev)
    graph = torch.cuda.CUDAGraph()
    if loop.gen is not None:
        graph.register_generator_state(loop.gen)
    autocast = torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda")
    # autocast's cache of cast weights would keep tensors from the capture's pool: off inside it
    with torch.cuda.graph(graph, pool=pool), torch.autocast("cuda", dtype=dtype, enabled=autocast,
                                                            cache_enabled=False):
        loop.body()
    return graph


@torch.no_grad()
def decode(dec, *, max_new_tokens: int, temperature: float, top_p: float, eos_id: int, pad_id: int,
           generator: torch.Generator | None, check_every: int = 1, buckets: bool = False,
           cuda_graph: bool = False) -> tuple[Tensor, Tensor]:
    """Sample up to ``max_new_tokens`` tokens per row with ``dec`` (a fresh :class:`StaticDecoder`).

    Returns (ids [B, R], mask [B, R]), R the last column any row used. See the module docstring for
    ``check_every``, ``buckets`` and ``cuda_graph`` (which needs the decoder's tensors on CUDA)."""
    if check_every < 1:
        raise ValueError(f"check_every: must be >= 1, got {check_every}")
    first = dec.prefill()
    if cuda_graph and first.device.type != "cuda":
        raise ValueError(f"cuda_graph: needs a CUDA device, the model is on {first.device.type}")
    loop = _Loop(dec, first, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos_id=eos_id,
                 pad_id=pad_id, generator=generator)
    sizes = bucket_sizes(loop.b) if buckets else None
    going_count = _Going(first.device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    pool = torch.cuda.graph_pool_handle() if cuda_graph else None
    for s in range(1, max_new_tokens):
        if (s - 1) % check_every == 0:
            going = going_count(loop.done)
            if going == 0:
                break
            if sizes is None:
                dec._compact(loop.done)
            else:
                fit = min(z for z in sizes if z >= going)
                if fit < dec.rows.shape[0]:  # the going rows first, then finished ones to fill the size
                    order = torch.sort(loop.done[dec.rows].to(torch.uint8), stable=True).indices
                    dec.keep(order[:fit])
        if cuda_graph:
            held = dec.rows.shape[0]
            if held not in graphs:
                graphs.clear()  # a smaller size never goes back to a larger one
                graphs[held] = _capture(loop, pool)
            graphs[held].replay()
        else:
            loop.body()
    used = int(loop.valid.any(0).nonzero().max()) + 1  # one read at the end
    return loop.out[:, :used], loop.valid[:, :used]
