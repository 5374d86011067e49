"""Test harness only: verl's rollout named ``hf_cpu`` (registered by ``erft_cpu_platform``): transformers'
model sampled token by token in a Ray actor, one server per rollout replica, token-in-token-out as verl's agent
loop asks (``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput``), with the trainer's
weights pushed to it each step through verl's ``update_weights`` (the ``naive`` checkpoint engine).

Sampling is reproducible: request k of a prompt after weight version v draws from a generator seeded with
(seed, v, prompt, k), whatever order the requests arrive in.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import Counter
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput


def server_name(replica_rank: int) -> str:
    return f"erft_hf_cpu_server_{replica_rank}"


class HFServer:
    """One rollout server: the model at ``path`` in float32, plain sampling at the requested temperature."""

    def __init__(self, path: str, response_length: int, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.eos = self.model.generation_config.eos_token_id
        self.response_length, self.seed, self.version = response_length, seed, 0
        self.seen: Counter = Counter()
        self.lock = asyncio.Lock()

    def load_weights(self, state: dict[str, torch.Tensor]) -> int:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"weight names do not match the model: missing {missing}, unexpected {unexpected}")
        self.version += 1
        self.seen.clear()
        return self.version

    def _generator(self, prompt: tuple[int, ...]) -> torch.Generator:
        k = self.seen[prompt]
        self.seen[prompt] += 1
        digest = hashlib.sha256(repr((self.seed, self.version, prompt, k)).encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], params: dict[str, Any]) -> TokenOutput:
        temperature = float(params.get("temperature", 1.0))
        limit = int(params.get("max_tokens", params.get("max_new_tokens", self.response_length)))
        limit = max(1, min(limit, self.response_length))
        gen = self._generator(tuple(prompt_ids))
        ids = torch.tensor([prompt_ids])
        tokens: list[int] = []
        logps: list[float] = []
        for _ in range(limit):
            logits = self.model(ids).logits[0, -1].float()
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            else:
                logp = torch.log_softmax(logits, -1)
                tok = int(logits.argmax())
            tokens.append(tok)
            logps.append(float(logp[tok]))
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
            if tok == self.eos:
                break
        return TokenOutput(token_ids=tokens, log_probs=logps, stop_reason="completed",
                           extra_fields={"global_steps": self.version})

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs) -> TokenOutput:
        async with self.lock:  # one request at a time: the generator's draw order stays fixed
            return self._sample(list(prompt_ids), dict(sampling_params))

    def get_server_address(self):
        return "127.0.0.1", 0

    async def _noop(self, *a, **k):
        return None

    wake_up = sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = _noop
    abort_all_requests = resume_generation = start_profile = stop_profile = _noop


class CPUReplica(RolloutReplica):
    """One ``HFServer`` per replica, started in the hybrid (colocated) mode the sync trainer uses."""

    async def launch_servers(self):
        cfg = self.config
        server = ray.remote(HFServer).options(name=server_name(self.replica_rank), num_cpus=0.01,
                                              max_concurrency=64).remote(
            str(self.model_config.path), int(cfg.response_length), int(os.environ.get("ERFT_CPU_SEED", "0")))
        await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"erft-hf-cpu-{self.replica_rank}:0"


class CPURolloutAdapter(BaseRollout):
    """The worker side: pushes the trainer's weights to this rank's replica server (rollout rank 0 only)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        size = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                * self.config.pipeline_model_parallel_size)
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // size if replica_rank == -1 else replica_rank
        self.is_sender = rank % size == 0
        self.sleep_level = 2

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        state = {}
        for name, tensor in weights:  # every rank iterates: the full tensors are gathered collectively
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if self.is_sender:
                state[name] = tensor.detach().to("cpu", torch.float32).clone()
        if self.is_sender:
            await ray.get_actor(server_name(self.replica_rank)).load_weights.remote(state)
