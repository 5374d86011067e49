"""Pinned CPU numerics (issue 36): the same bytes on every x86-64 CPU.

The rule of ``common.numerics.pin_cpu_numerics`` on fake environments, and, in fresh processes (the point: the
variables are read when torch loads), ``erft train`` on the micro policy with this machine's own instruction set
and with an AVX2-only machine's forced: under the pin the trained weights are the same bytes; without it, the
kernels' instruction set shows in the bytes (``ATEN_CPU_CAPABILITY=default``, no vectorisation, differs from the
pin on any x86-64 CPU; this machine's own AVX-512, where it has it, too).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from entropy_rft.common import numerics
from micro import make_micro_policy, micro_overrides

TESTS = Path(__file__).resolve().parent
AVX_CPU = frozenset({"sse2", "avx", "avx2", "fma", "avx512f"})


# ----------------------------------------------------------------------------- the rule


def test_the_pin_sets_every_variable_before_torch_loads():
    env: dict[str, str] = {}
    added = numerics.pin_cpu_numerics(env, modules={}, machine="x86_64", flags=AVX_CPU)
    assert added == env == numerics.PIN_VARIABLES
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == env["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_the_pin_never_overrides_the_user_and_stays_out_where_it_cannot_hold():
    env = {"ATEN_CPU_CAPABILITY": "avx512"}
    added = numerics.pin_cpu_numerics(env, modules={}, machine="x86_64", flags=AVX_CPU)
    assert env["ATEN_CPU_CAPABILITY"] == "avx512" and "ATEN_CPU_CAPABILITY" not in added and len(added) == 3
    for off in ("0", "off", "native", "False"):
        assert numerics.pin_cpu_numerics({"ERFT_CPU_PIN": off}, modules={}, machine="x86_64", flags=AVX_CPU) == {}
    assert numerics.pin_cpu_numerics({"ERFT_CPU_PIN": "1"}, modules={}, machine="x86_64", flags=AVX_CPU)
    cases = [
        ({"torch": object()}, "x86_64", AVX_CPU),  # torch already loaded: too late
        ({}, "aarch64", AVX_CPU),  # not x86-64
        ({}, "x86_64", frozenset({"sse2", "avx"})),  # no AVX2: forcing it would crash
        ({}, "x86_64", frozenset({"avx2"})),  # AVX2 without FMA: ATen would not take its AVX2 path
    ]
    for modules, machine, flags in cases:
        env = {}
        assert numerics.pin_cpu_numerics(env, modules=modules, machine=machine, flags=flags) == {} and env == {}


def test_cpu_flags_are_read_from_cpuinfo():
    text = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: none\n"
    assert numerics.cpu_flags(text) == {"fpu", "sse2", "avx2", "fma"}
    assert numerics.cpu_flags("nothing here") == frozenset()


def test_the_record_says_whether_the_pin_was_in_effect():
    rec = numerics.numerics_record()
    assert rec["pinned"] and rec["cpu_capability"] == numerics.PINNED_CAPABILITY  # conftest pins the suite
    assert numerics.isa_tag(rec) == ""
    assert numerics.isa_tag({"pinned": False, "cpu_capability": "AVX512"}) == "native-avx512"


# ----------------------------------------------------------------------------- fresh processes


def _train(policy: Path, out: Path, env: dict[str, str]) -> tuple[str, dict]:
    """``erft train`` (3 steps on the micro policy) in a fresh process under ``env``; returns the SHA-256 of its
    final weights and run.json's record of the numerics."""
    sets = micro_overrides(policy, **{"train.max_steps": 3, "eval.every": 0, "train.checkpoint_every": 100})
    cmd = [sys.executable, "-m", "entropy_rft.cli", "train", "--out", str(out), *sum((["--set", s] for s in sets), [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    digest = hashlib.sha256((out / "final" / "model.safetensors").read_bytes()).hexdigest()
    return digest, json.loads((out / "run.json").read_text()).get("cpu_numerics", {})


def test_erft_computes_the_same_bytes_whatever_the_cpus_instruction_set(tmp_path):
    """Issue 36 item 2. Before the pin, this machine's own run (AVX-512 here) and an AVX2-only machine's
    (forced) wrote different weights, and every number of the default job after them moved."""
    policy = make_micro_policy(tmp_path / "policy")
    base = {k: v for k, v in os.environ.items() if k not in numerics.PIN_VARIABLES and k != numerics.PIN_ENV}
    base["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    avx2_machine = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    envs = {"own": base, "avx2": {**base, **avx2_machine},
            "scalar": {**base, "ERFT_CPU_PIN": "0", "ATEN_CPU_CAPABILITY": "default"},
            "native": {**base, "ERFT_CPU_PIN": "0"}}
    with ThreadPoolExecutor(2) as pool:  # two processes at a time (each trains on its own threads)
        done = dict(zip(envs, pool.map(lambda kv: _train(policy, tmp_path / kv[0], kv[1]), envs.items())))
    (own, own_rec), (avx2, _) = done["own"], done["avx2"]
    assert own == avx2, "under the pin, this machine's run and an AVX2 machine's must write the same bytes"
    assert own_rec["pinned"] and own_rec["cpu_capability"] == "AVX2"

    scalar, scalar_rec = done["scalar"]
    assert scalar_rec == {**scalar_rec, "pinned": False, "cpu_capability": "DEFAULT"}
    assert scalar != own, "the kernels' instruction set shows in the bytes: the pin is what keeps them equal"
    native, native_rec = done["native"]
    assert not native_rec["pinned"] or native_rec["cpu_capability"] == "AVX2"
    # this machine's own instruction set, unpinned: the bytes follow it (on an AVX2-only CPU it is the pin's)
    assert (native == own) == (native_rec["cpu_capability"] == "AVX2")


# ----------------------------------------------------------------------------- one table, one instruction set


def test_compare_refuses_to_keep_a_run_computed_with_another_instruction_set(tmp_path, capsys):
    from entropy_rft.cli.main import main
    from entropy_rft.launch.sweep import numerics_mismatch

    policy = make_micro_policy(tmp_path / "policy")
    sets = [a for s in micro_overrides(policy, **{"train.max_steps": 1, "eval.every": 0, "probe.jvp_every": 0,
                                                  "probe.counterfactual_every": 0}) for a in ("--set", s)]
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "none", "--out", str(out), *sets]) == 0
    run_json = out / "none-s0" / "run.json"
    info = json.loads(run_json.read_text())
    assert info["cpu_numerics"]["pinned"] and numerics_mismatch(info["cpu_numerics"], info["cpu_numerics"]) is None
    info["cpu_numerics"] = {**info["cpu_numerics"], "cpu_capability": "AVX512", "pinned": False}
    run_json.write_text(json.dumps(info))  # as if trained with ERFT_CPU_PIN=0 on this AVX-512 machine
    capsys.readouterr()
    assert main(["compare", "--methods", "none", "--out", str(out), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none-s0 was trained with another CPU instruction set" in err[0], err
    assert "(AVX512 not pinned there, AVX2 pinned now)" in err[0] and "ERFT_CPU_PIN" in err[0]
