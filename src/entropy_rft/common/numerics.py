"""Pinned CPU numerics: the same bytes on every x86-64 CPU.

ATen's vectorised CPU kernels, MKL's GEMMs and oneDNN's primitives pick their code path from the CPU's
instruction set, and the paths round differently: the built-in base policy built with AVX-512 and with AVX2
differs in its last bits, and every number of the default job after it moves (three tables for one command).
The pin asks each library for the AVX2 path, which nearly every x86-64 CPU of the last ten years has:

- ``ATEN_CPU_CAPABILITY=avx2`` (ATen's dispatch);
- ``MKL_CBWR=AVX2`` (MKL's conditional numerical reproducibility) and ``MKL_ENABLE_INSTRUCTIONS=AVX2``;
- ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's ISA cap).

Each library reads its variable once, when torch loads: the pin must be set before ``import torch``.
``pin_cpu_numerics()`` does that for an entry point to call first thing (``erft`` does, so every command, and
every process a command spawns, runs pinned). It never overrides a value the user set, does nothing once torch
is loaded, nothing off Linux x86-64 or on a CPU without AVX2 and FMA (aarch64: bitwise equality across
architectures is out of reach; docs/results.md gives the spread to expect), and nothing when
``ERFT_CPU_PIN=0`` (``off``, ``false``, ``no``, ``native``): the native instruction set is faster on larger
models (``benchmarks/cpu/pin_cost.py`` measures by how much). A library user who imports torch before
``entropy_rft`` cannot be pinned; ``numerics_record()`` tells what was in effect, and run.json and the base
policy's build info record it, so a mismatch is visible.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = [
    "PIN_ENV",
    "PIN_VARIABLES",
    "PINNED_CAPABILITY",
    "cpu_flags",
    "isa_tag",
    "numerics_record",
    "pin_applies",
    "pin_cpu_numerics",
    "pin_wanted",
]

# The switch: unset (or any other value) pins; these values leave the native instruction set.
PIN_ENV = "ERFT_CPU_PIN"
_PIN_OFF = frozenset({"0", "off", "false", "no", "native"})
# What torch.backends.cpu.get_cpu_capability() reports under the pin.
PINNED_CAPABILITY = "AVX2"
# Each variable and its pinned value (compared case-insensitively).
PIN_VARIABLES: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
_X86_64 = frozenset({"x86_64", "amd64"})
_NEEDED_FLAGS = frozenset({"avx2", "fma"})  # ATen's AVX2 kernels need both


def pin_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the pin is asked for: ``ERFT_CPU_PIN`` unset or not one of 0/off/false/no/native."""
    env = os.environ if environ is None else environ
    return env.get(PIN_ENV, "").strip().lower() not in _PIN_OFF


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``cpuinfo``: its text, for tests); empty where unreadable."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def pin_applies(machine: str | None = None, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU can run pinned: x86-64 with AVX2 and FMA (read from /proc/cpuinfo, so Linux only)."""
    arch = (platform.machine() if machine is None else machine).lower()
    if arch not in _X86_64:
        return False
    return (cpu_flags() if flags is None else flags) >= _NEEDED_FLAGS


def pin_cpu_numerics(environ: MutableMapping[str, str] | None = None, modules: Mapping[str, Any] | None = None,
                     machine: str | None = None, flags: frozenset[str] | None = None) -> dict[str, str]:
    """Set the pin's variables (:data:`PIN_VARIABLES`) that the user has not set, when torch is not loaded yet,
    the pin is wanted (:func:`pin_wanted`) and the CPU can run it (:func:`pin_applies`). Returns the variables
    it set (empty when it did nothing). ``environ``, ``modules``, ``machine`` and ``flags`` default to
    ``os.environ``, ``sys.modules``, this machine and its CPU (parameters for tests)."""
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    if "torch" in mods or not pin_wanted(env) or not pin_applies(machine, flags):
        return {}
    added = {k: v for k, v in PIN_VARIABLES.items() if k not in env}
    env.update(added)
    return added


def _is_pinned(capability: str, environ: Mapping[str, str]) -> bool:
    """Whether ``capability`` and the MKL/oneDNN variables in ``environ`` are the pin's."""
    if capability.upper() != PINNED_CAPABILITY:
        return False
    return all(environ.get(k, "").strip().upper() == v.upper() for k, v in PIN_VARIABLES.items()
               if k != "ATEN_CPU_CAPABILITY")


def numerics_record(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What this process computes with, for run.json and the build info: ATen's CPU capability in effect
    (``torch.backends.cpu.get_cpu_capability()``), whether it is the pin (``pinned``), the machine, and the
    pin's variables as set. Imports torch (call it where torch is loaded anyway)."""
    import torch

    env = os.environ if environ is None else environ
    capability = str(torch.backends.cpu.get_cpu_capability())
    return {
        "cpu_capability": capability,
        "pinned": _is_pinned(capability, env),
        "machine": platform.machine(),
        "env": {k: env[k] for k in (*PIN_VARIABLES, PIN_ENV) if k in env},
    }


def isa_tag(record: Mapping[str, Any] | None = None) -> str:
    """A name part for what was computed outside the pin (``native-avx512``; empty under the pin), so a cache
    folder built with another instruction set never stands in for the pinned one. ``record``: a
    :func:`numerics_record` (this process's when None)."""
    rec = numerics_record() if record is None else record
    if rec["pinned"]:
        return ""
    return "native-" + "".join(c for c in str(rec["cpu_capability"]).lower() if c.isalnum())
