"""Test harness only: what a real ``python -m verl.trainer.main_ppo`` job needs to run on a CPU-only machine,
added through verl's own hooks (no verl file is changed). Loaded in every verl process by
``VERL_USE_EXTERNAL_MODULES=erft_cpu_platform,entropy_rft.integrations.verl`` and selected with
``VERL_PLATFORM=cpu``:

- a CPU platform in verl's ``PlatformRegistry`` (device ``cpu``, Ray's ``GPU`` resource as a logical token);
- process groups on plain gloo (verl 0.9.1 builds ``cpu:gloo,<device>:<backend>``, a duplicate on CPU, and
  has no config key for it: the two module-level bindings of ``initialize_global_process_group_ray`` that
  verl's workers call are rebound here, in the harness, never in the plug-in);
- verl's own FSDP engines registered for device ``cpu`` through ``EngineRegistry``;
- a rollout named ``hf_cpu``: transformers' ``generate`` in a Ray actor (``erft_cpu_rollout``, a module of its
  own so that Ray's import of the actor class does not re-enter this hook before the platform exists).
"""

from __future__ import annotations

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

ROLLOUT = "hf_cpu"


class _CPUDeviceModule:
    """``torch.cpu`` plus the memory and cache calls verl makes on its device module (no-ops on CPU)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return lambda *a, **k: 0  # empty_cache, memory_allocated, reset_peak_memory_stats, mem_get_info ...

    @staticmethod
    def mem_get_info(*a, **k):
        return 1 << 34, 1 << 34

    @staticmethod
    def get_device_name(*a, **k) -> str:
        return "CPU"

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU (gloo; Ray's GPU resource is a logical scheduling token)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPUDeviceModule()

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        import contextlib

        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _gloo_process_group(timeout_second=None, backend=None):
    """verl's ``initialize_global_process_group_ray`` with plain gloo."""
    return _ORIGINAL(timeout_second=timeout_second, backend="gloo")


def _patch_process_group() -> None:
    import verl.checkpoint_engine.base as ckpt
    import verl.workers.engine_workers as workers

    for module in (workers, ckpt):
        module.initialize_global_process_group_ray = _gloo_process_group


def _register_engines() -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    table = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        if "cpu" not in table.get(backend, {}):
            EngineRegistry.register(model_type="language_model", backend=backend, device="cpu")(FSDPEngineWithLMHead)


def _register_rollout() -> None:
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = "erft_cpu_rollout.CPURolloutAdapter"

    def load():
        from erft_cpu_rollout import CPUReplica

        return CPUReplica

    replica.RolloutReplicaRegistry.register(ROLLOUT, load)


from verl.utils import distributed as _distributed  # noqa: E402

_ORIGINAL = _distributed.initialize_global_process_group_ray
_patch_process_group()
_register_engines()
_register_rollout()
