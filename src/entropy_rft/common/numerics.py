"""Pinned CPU numerics: the same bytes on every x86-64 CPU, Intel or AMD.

ATen's vectorised CPU kernels, MKL's GEMMs and oneDNN's primitives pick their code path from the CPU (its
instruction set, and for MKL its vendor), and the paths round differently: the built-in base policy built with
AVX-512 and with AVX2, or on an Intel and an AMD CPU, differs in its last bits, and every number of the default
job after it moves. The pin asks each library for one path that every x86-64 CPU with AVX2 runs alike:

- ``ATEN_CPU_CAPABILITY=avx2`` (ATen's dispatch);
- ``MKL_CBWR=COMPATIBLE`` (MKL's conditional numerical reproducibility: the one branch oneMKL documents to give
  the same results on Intel and non-Intel CPUs; its explicit branches such as ``AVX2`` run on Intel CPUs only,
  and elsewhere MKL takes ``AUTO`` without a word) and ``MKL_ENABLE_INSTRUCTIONS=AVX2``;
- ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's ISA cap).

Each library reads its variable once, when torch loads: the pin must be set before ``import torch``.
``pin_cpu_numerics()`` does that for an entry point to call first thing (``erft`` does, so every command, and
every process a command spawns, runs pinned). It never overrides a value the user set, does nothing once torch
is loaded, nothing off Linux x86-64 or on a CPU without AVX2 and FMA (aarch64: bitwise equality across
architectures is out of reach; docs/results.md gives the spread to expect), and nothing when
``ERFT_CPU_PIN=0`` (``off``, ``false``, ``no``, ``native``).

MKL's branch has a price: ``COMPATIBLE`` runs MKL's SSE2 code, about twice the time of a GEMM-bound step. Only
erft's own small policies promise bytes, so a pretrained model's process may move MKL to the pin's fast branch
before its first matrix multiply (:func:`choose_mkl_branch`; ``model.cpu_gemm``): ``AVX2`` on Intel CPUs, MKL's
``AUTO`` elsewhere, the same bytes on CPUs of one vendor. ``numerics_record()`` tells what was in effect, MKL's
branch as MKL reports it (:func:`mkl_branch`), and run.json and the base policy's build info record it, so a
mismatch is visible; :func:`mkl_fallback` words a branch the user asked for that MKL did not take.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = [
    "EXACT_BRANCH",
    "FAST_BRANCH",
    "PIN_ENV",
    "PIN_SET_ENV",
    "PIN_VARIABLES",
    "PINNED_CAPABILITY",
    "choose_mkl_branch",
    "cpu_flags",
    "isa_tag",
    "mkl_branch",
    "mkl_fallback",
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
# MKL's branch under the pin (the same bytes on every vendor), and the fast one a pretrained model may take.
EXACT_BRANCH = "COMPATIBLE"
FAST_BRANCH = "AVX2"
# Each variable and its pinned value (compared case-insensitively).
PIN_VARIABLES: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": EXACT_BRANCH,
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
# The variables the pin set (not the user), comma-separated; spawned processes inherit it with the pin's values,
# so that they too know which values are the pin's to change (choose_mkl_branch) and which the user's.
PIN_SET_ENV = "ERFT_CPU_PIN_SET"
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
    if added:
        env[PIN_SET_ENV] = ",".join(sorted({*_pin_set(env), *added}))
    return added


def _pin_set(environ: Mapping[str, str]) -> set[str]:
    """The variables the pin set in this process or a parent (:data:`PIN_SET_ENV`) that still hold its value."""
    named = {v.strip() for v in environ.get(PIN_SET_ENV, "").split(",")}
    return {k for k in named if k in PIN_VARIABLES and environ.get(k) == PIN_VARIABLES[k]}


# ----------------------------------------------------------------------------- MKL's branch, as MKL reports it

# mkl_cbwr.h: the branch codes mkl_cbwr_get(MKL_CBWR_BRANCH) returns and mkl_cbwr_set takes.
_MKL_CBWR_BRANCH = 1
_MKL_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
                 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
_MKL_CODES = {name: code for code, name in _MKL_BRANCHES.items()}
_MKL_STRICT = 0x10000  # a flag on top of the branch (MKL_CBWR=AVX2,STRICT)
_MKL_UNSUPPORTED = -3  # MKL_CBWR_ERR_UNSUPPORTED_BRANCH: an explicit branch on a non-Intel CPU


@functools.cache
def _mkl() -> tuple[Any, Any] | None:
    """MKL's ``(get, set)`` of the CNR branch: in torch's CPU library, where the pip wheels link MKL in and export
    its service functions (``mkl_serv_cbwr_get``/``_set``, what ``mkl_cbwr_get``/``_set`` call), else MKL's own
    ``mkl_cbwr_get``/``_set`` among the process's loaded libraries (a torch linked to a shared MKL); None where
    neither is found (a torch without MKL)."""
    import torch

    places = [(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"), "mkl_serv_cbwr_"),
              (None, "mkl_cbwr_")]
    for path, prefix in places:
        try:
            lib = ctypes.CDLL(path)
            fns = (getattr(lib, prefix + "get"), getattr(lib, prefix + "set"))
        except (OSError, AttributeError):
            continue
        for fn in fns:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fns
    return None


def mkl_branch() -> str | None:
    """The branch MKL computes with in this process, as MKL itself reports it (``mkl_cbwr_get``): ``COMPATIBLE``,
    ``AVX2``, ``AUTO`` (MKL's choice for the CPU, also where an explicit branch was asked on a non-Intel CPU),
    ``OFF`` (no branch asked: the CPU's fastest path), ...; None where MKL cannot be asked. Imports torch."""
    fns = _mkl()
    if fns is None:
        return None
    code = int(fns[0](_MKL_CBWR_BRANCH)) & ~_MKL_STRICT
    return _MKL_BRANCHES.get(code, f"code {code}")


def choose_mkl_branch(exact: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """Under the pin, put MKL on the exact branch (``COMPATIBLE``: the same bytes on Intel and AMD) or on the fast
    one (``AVX2`` on Intel CPUs, ``AUTO`` where MKL runs no explicit branch; about half the time of ``COMPATIBLE``
    on a GEMM-bound step) for this process. It must run before the process's first matrix multiply: MKL fixes its
    branch there (``mkl_cbwr_set`` fails afterwards, and the branch stays). Nothing when the pin did not set
    ``MKL_CBWR`` (the user's value, or ``ERFT_CPU_PIN=0``). Returns the branch in effect (:func:`mkl_branch`)."""
    env = os.environ if environ is None else environ
    fns = _mkl() if "MKL_CBWR" in _pin_set(env) else None
    if fns is not None:
        wanted = EXACT_BRANCH if exact else FAST_BRANCH
        if fns[1](_MKL_CODES[wanted]) == _MKL_UNSUPPORTED:
            fns[1](_MKL_CODES["AUTO"])
    return mkl_branch()


def mkl_fallback(record: Mapping[str, Any]) -> str | None:
    """A warning line when the user's ``MKL_CBWR`` asked for a branch MKL did not take (an explicit branch on a
    non-Intel CPU runs as ``AUTO``, silently), from a :func:`numerics_record`; None otherwise."""
    asked = str(record.get("env", {}).get("MKL_CBWR", "")).split(",")[0].strip().upper()
    took = record.get("mkl_branch")
    if not asked or took is None or asked == took or "MKL_CBWR" in record.get("pin_set", ()):
        return None
    return (f"MKL_CBWR={asked} asked MKL for its {asked} branch, and MKL took {took} (MKL runs its explicit "
            f"branches on Intel CPUs only): these numbers are this CPU's; MKL_CBWR={EXACT_BRANCH}, or leaving "
            "MKL_CBWR unset under the pin, computes alike on Intel and AMD")


def _is_pinned(capability: str, branch: str | None, environ: Mapping[str, str]) -> bool:
    """Whether ``capability``, MKL's ``branch`` and the other variables in ``environ`` are the pin's."""
    if capability.upper() != PINNED_CAPABILITY or branch != EXACT_BRANCH:
        return False
    return all(environ.get(k, "").strip().upper() == v.upper() for k, v in PIN_VARIABLES.items()
               if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR"))


def numerics_record(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What this process computes with, for run.json and the build info: ATen's CPU capability in effect
    (``torch.backends.cpu.get_cpu_capability()``), MKL's branch as MKL reports it (``mkl_branch``: what MKL
    took, not what was asked), whether both are the pin's (``pinned``: the vendor-independent setting), the
    machine, the pin's variables as set and which of them the pin set (``pin_set``). Imports torch (call it where
    torch is loaded anyway)."""
    import torch

    env = os.environ if environ is None else environ
    capability = str(torch.backends.cpu.get_cpu_capability())
    branch = mkl_branch()
    return {
        "cpu_capability": capability,
        "mkl_branch": branch,
        "pinned": _is_pinned(capability, branch, env),
        "machine": platform.machine(),
        "env": {k: env[k] for k in (*PIN_VARIABLES, PIN_ENV) if k in env},
        "pin_set": sorted(_pin_set(env)),
    }


def isa_tag(record: Mapping[str, Any] | None = None) -> str:
    """A name part for what was computed outside the pin (``native-avx512``, ``native-avx2-mklauto``; empty under
    the pin), so a cache folder built with another instruction set or MKL branch never stands in for the pinned
    one. ``record``: a :func:`numerics_record` (this process's when None)."""
    rec = numerics_record() if record is None else record
    if rec["pinned"]:
        return ""
    branch = rec.get("mkl_branch")
    return "native-" + _alnum(rec["cpu_capability"]) + (f"-mkl{_alnum(branch)}" if branch else "")


def _alnum(value: object) -> str:
    """``value`` in lower case, letters and digits only (a part of a folder name)."""
    return "".join(c for c in str(value).lower() if c.isalnum())
