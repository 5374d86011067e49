"""Pinned CPU numerics (issues 36 and 62): the same bytes on every x86-64 CPU, Intel or AMD.

The rule of ``common.numerics.pin_cpu_numerics`` on fake environments, and, in fresh processes (the point: the
variables are read when torch loads), ``erft train`` on the micro policy with this machine's own instruction set
and with an AVX2-only machine's forced, and with MKL told it runs on an Intel CPU or on an AMD one (a small
library preloaded with ``LD_PRELOAD`` that answers MKL's vendor queries, compiled here with the machine's C
compiler): under the pin the trained weights are the same bytes; without it, the kernels' instruction set shows
in the bytes (``ATEN_CPU_CAPABILITY=default``, no vectorisation, differs from the pin on any x86-64 CPU; this
machine's own AVX-512, where it has it, too), and under the earlier pin's ``MKL_CBWR=AVX2`` the vendor does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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
    assert added == numerics.PIN_VARIABLES and env == {**added, numerics.PIN_SET_ENV: ",".join(sorted(added))}
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_CBWR"] == "COMPATIBLE"  # oneMKL's one branch documented alike on Intel and non-Intel CPUs
    # a process the first one spawns inherits the variables: they stay the pin's, not the user's
    child = dict(env)
    assert numerics.pin_cpu_numerics(child, modules={}, machine="x86_64", flags=AVX_CPU) == {} and child == env


def test_the_pin_never_overrides_the_user_and_stays_out_where_it_cannot_hold():
    env = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "COMPATIBLE"}
    added = numerics.pin_cpu_numerics(env, modules={}, machine="x86_64", flags=AVX_CPU)
    assert env["ATEN_CPU_CAPABILITY"] == "avx512" and set(added) == {"MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"}
    assert env[numerics.PIN_SET_ENV] == "MKL_ENABLE_INSTRUCTIONS,ONEDNN_MAX_CPU_ISA"  # the user's MKL_CBWR stays theirs
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
    assert rec["mkl_branch"] == "COMPATIBLE" and "MKL_CBWR" in rec["pin_set"]  # what MKL itself reports
    assert numerics.isa_tag(rec) == ""
    assert numerics.isa_tag({"pinned": False, "cpu_capability": "AVX512"}) == "native-avx512"
    assert numerics.isa_tag({"pinned": False, "cpu_capability": "AVX2", "mkl_branch": "AUTO"}) == "native-avx2-mklauto"
    assert numerics.mkl_fallback(rec) is None


def test_a_branch_mkl_did_not_take_is_a_warning_naming_the_variable():
    rec = {"env": {"MKL_CBWR": "AVX2,STRICT"}, "mkl_branch": "AUTO", "pin_set": []}
    line = numerics.mkl_fallback(rec)
    assert line is not None and line.startswith("MKL_CBWR=AVX2 asked") and "MKL took AUTO" in line
    assert "MKL_CBWR=COMPATIBLE" in line
    assert numerics.mkl_fallback({**rec, "mkl_branch": "AVX2"}) is None  # taken as asked
    # the pin's own move to the fast branch (a pretrained model) is a choice, not a fallback
    assert numerics.mkl_fallback({**rec, "env": {"MKL_CBWR": "COMPATIBLE"}, "pin_set": ["MKL_CBWR"]}) is None


def test_exact_gemm_is_the_built_in_policies_and_what_the_setting_says(tmp_path):
    from entropy_rft.training.policies import exact_gemm

    assert exact_gemm("default") and exact_gemm("default-strong", "fast")  # their builds are cached for all
    assert not exact_gemm("smollm2-135m") and not exact_gemm("HuggingFaceTB/SmolLM2-135M")
    assert exact_gemm(str(tmp_path)) and not exact_gemm(str(tmp_path), "fast")
    assert exact_gemm("smollm2-135m", "exact")


def test_a_resumed_run_must_have_computed_with_this_pins_mkl_branch():
    from types import SimpleNamespace

    from entropy_rft.launch.sweep import numerics_mismatch, planned_numerics

    now = {"cpu_capability": "AVX2", "pinned": True, "mkl_branch": "COMPATIBLE", "pin_set": ["MKL_CBWR"]}
    old_pin = {"cpu_capability": "AVX2", "pinned": True}  # run.json of an erft whose pin was MKL_CBWR=AVX2
    said = numerics_mismatch(old_pin, now)
    assert said == "AVX2 pinned, MKL branch not recorded there, AVX2 pinned, MKL COMPATIBLE now"
    assert numerics_mismatch(now, now) is None
    smol = SimpleNamespace(model=SimpleNamespace(name="smollm2-135m", cpu_gemm="auto"))
    fast = {**now, "pinned": False, "mkl_branch": "AVX2"}  # how a SmolLM2 run records itself
    planned = planned_numerics(now, smol)
    assert planned["pinned"] is False and numerics_mismatch(fast, planned) is None
    assert numerics_mismatch(fast, now) is not None


def test_a_pretrained_model_takes_mkl_fast_branch_before_its_first_matrix_multiply():
    """``choose_mkl_branch`` in fresh pinned processes: the fast branch holds when chosen first (AVX2 on Intel,
    AUTO where MKL runs no explicit branch), and a choice after a matrix multiply changes nothing."""
    code = ("from entropy_rft.common import numerics as n; n.pin_cpu_numerics(); import torch; import sys\n"
            "if sys.argv[1] == 'late': torch.ones(4, 4) @ torch.ones(4, 4)\n"
            "print(n.choose_mkl_branch(False), n.mkl_branch(), n.numerics_record()['pinned'])")
    env = {k: v for k, v in os.environ.items() if k not in numerics.PIN_VARIABLES and k != numerics.PIN_SET_ENV}
    got = {when: subprocess.run([sys.executable, "-c", code, when], env=env, capture_output=True, text=True,
                                timeout=120).stdout.split() for when in ("first", "late")}
    intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    assert got["first"] == [("AVX2" if intel else "AUTO")] * 2 + ["False"], got
    assert got["late"] == ["COMPATIBLE", "COMPATIBLE", "True"], got


# ----------------------------------------------------------------------------- fresh processes


def _train(policy: Path, out: Path, env: dict[str, str]) -> tuple[str, dict, str]:
    """``erft train`` (3 steps on the micro policy) in a fresh process under ``env``; returns the SHA-256 of its
    final weights, run.json's record of the numerics and its stderr."""
    sets = micro_overrides(policy, **{"train.max_steps": 3, "eval.every": 0, "train.checkpoint_every": 100})
    cmd = [sys.executable, "-m", "entropy_rft.cli", "train", "--out", str(out), *sum((["--set", s] for s in sets), [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    digest = hashlib.sha256((out / "final" / "model.safetensors").read_bytes()).hexdigest()
    return digest, json.loads((out / "run.json").read_text()).get("cpu_numerics", {}), done.stderr


# MKL asks these of the CPU through libtorch_cpu.so's PLT, so a preloaded library answers them: "Intel" (as the
# real mkl_serv_intel_cpu does, 0 under COMPATIBLE) or "not Intel" (another vendor's CPU; not Zen, whose kernels
# MKL picks by more than these answers, so that on an Intel CPU they are no AMD CPU's).
VENDOR_C = r"""
#include <stdlib.h>
#include <strings.h>
static int compatible(void) { const char *v = getenv("MKL_CBWR"); return v && !strncasecmp(v, "COMPATIBLE", 10); }
int mkl_serv_intel_cpu(void) { return AS_INTEL && !compatible(); }
int mkl_serv_intel_cpu_true(void) { return AS_INTEL; }
int mkl_serv_cpuiszen(void) { return 0; }
int mkl_serv_cpuisbulldozer(void) { return 0; }
int mkl_serv_cpuisitbarcelona(void) { return 0; }
"""


def vendor_envs(folder: Path) -> dict[str, dict[str, str]]:
    """How to run a process with MKL told it runs on an Intel CPU and on another vendor's: {"intel": env,
    "other": env}, one of them empty (this CPU as it is), the other preloading a library compiled here."""
    intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (cc) is needed to tell MKL which vendor it runs on"
    source, lib = folder / "vendor.c", folder / ("not-intel.so" if intel else "intel.so")
    source.write_text(VENDOR_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", f"-DAS_INTEL={0 if intel else 1}", "-o", str(lib), str(source)],
                   check=True, capture_output=True, timeout=120)
    told = {"LD_PRELOAD": str(lib)}
    return {"intel": {}, "other": told} if intel else {"intel": told, "other": {}}


def test_erft_computes_the_same_bytes_whatever_the_cpus_instruction_set_and_vendor(tmp_path):
    """Issue 36 item 2 and issue 62 item 3. Before the pin, this machine's own run (AVX-512 here) and an AVX2-only
    machine's (forced) wrote different weights; under the pin's former MKL_CBWR=AVX2 an Intel CPU and another
    vendor's did (MKL runs that branch on Intel only, its AUTO path elsewhere), and every number of the default
    job moved with the vendor."""
    policy = make_micro_policy(tmp_path / "policy")
    vendor = vendor_envs(tmp_path)
    base = {k: v for k, v in os.environ.items()
            if k not in numerics.PIN_VARIABLES and k not in (numerics.PIN_ENV, numerics.PIN_SET_ENV)}
    base["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    avx2_machine = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    envs = {"own": base, "intel_avx2": {**base, **vendor["intel"], **avx2_machine},
            "other": {**base, **vendor["other"]},
            "intel_old": {**base, **vendor["intel"], "MKL_CBWR": "AVX2"},
            "other_old": {**base, **vendor["other"], "MKL_CBWR": "AVX2"},
            "scalar": {**base, "ERFT_CPU_PIN": "0", "ATEN_CPU_CAPABILITY": "default"},
            "native": {**base, "ERFT_CPU_PIN": "0"}}
    with ThreadPoolExecutor(2) as pool:  # two processes at a time (each trains on its own threads)
        done = dict(zip(envs, pool.map(lambda kv: _train(policy, tmp_path / kv[0], kv[1]), envs.items())))
    own, own_rec, own_err = done["own"]
    assert own == done["intel_avx2"][0] == done["other"][0], \
        "under the pin, this machine's run, an AVX2-only Intel machine's and another vendor's write the same bytes"
    for name in ("own", "intel_avx2", "other"):
        rec = done[name][1]
        assert rec["pinned"] and rec["cpu_capability"] == "AVX2" and rec["mkl_branch"] == "COMPATIBLE", (name, rec)
    assert "MKL_CBWR" not in own_err

    # the former pin: MKL takes Intel's AVX2 branch on Intel and its AUTO path elsewhere, and the bytes follow the
    # vendor (the preloaded library is what moves MKL here: without it the equality above would prove nothing)
    (intel_old, intel_rec, intel_err), (other_old, other_rec, other_err) = done["intel_old"], done["other_old"]
    assert intel_old != other_old, "MKL_CBWR=AVX2 computes differently on Intel and other CPUs"
    assert intel_rec["mkl_branch"] == "AVX2" and other_rec["mkl_branch"] == "AUTO"
    assert not intel_rec["pinned"] and not other_rec["pinned"]
    warned = [line for line in other_err.splitlines() if "MKL_CBWR" in line]
    assert len(warned) == 1 and "MKL_CBWR=AVX2 asked" in warned[0] and "MKL took AUTO" in warned[0], other_err
    assert "MKL_CBWR" not in intel_err

    scalar, scalar_rec, _ = done["scalar"]
    assert scalar_rec == {**scalar_rec, "pinned": False, "cpu_capability": "DEFAULT"}
    assert scalar != own, "the kernels' instruction set shows in the bytes: the pin is what keeps them equal"
    native, native_rec, _ = done["native"]
    assert not native_rec["pinned"] and native_rec["mkl_branch"] == "OFF"  # no branch asked: MKL's fastest
    assert native != own


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
    assert "(AVX512 not pinned, MKL COMPATIBLE there, AVX2 pinned, MKL COMPATIBLE now)" in err[0], err
    assert "ERFT_CPU_PIN" in err[0]


# ----------------------------------------------------------------------------- where two CPUs part (issue 77)


def test_the_numerics_probe_names_the_first_entry_that_differs_per_section():
    """benchmarks/cpu/numerics_probe.py hashes the default job's maths link by link, so that two machines' files
    name the first module, kernel or SFT step that computes differently. Its forward section follows the modules'
    call order (embedding first, the loss last); a digest is the SHA-256 of the float32 bytes."""
    import copy
    import hashlib

    import torch

    from benchmarks.cpu import numerics_probe as probe
    assert probe.digest(torch.tensor([1.0])) == hashlib.sha256(bytes.fromhex("0000803f")).hexdigest()[:16]
    secs = probe.model_sections(1)
    fwd = list(secs["forward"])
    assert fwd[0] == "000 model.embed_tokens" and fwd[-2].endswith(" model") and fwd[-1] == "loss"
    assert [k.split()[0] for k in fwd[:-1]] == [f"{i:03d}" for i in range(len(fwd) - 1)]
    assert set(secs["backward"]) >= {n for n in secs["adamw"]} and list(secs["sft"]) == ["loss 000", "weights"]
    from entropy_rft.training.sft import DEFAULT_BUILD

    assert secs["batch"]["shape"].startswith(f"{DEFAULT_BUILD['batch_size']}x")  # the build's batch, padded
    assert set(secs["batch"]) == {"input ids", "labels", "shape"}
    here = {"sections": {"gemm": {"a": "1", "b": "2"}, **secs}}
    other = copy.deepcopy(here)
    for key in (fwd[5], fwd[9]):
        other["sections"]["forward"][key] = "x"
    other["sections"]["gemm"]["b"] = "y"
    lines = dict(line.split(None, 1) for line in probe.compare(here, other))
    assert lines["gemm"] == "1 of 2 differ, first: b"
    assert lines["forward"] == f"2 of {len(fwd)} differ, first: {fwd[5]}"
    assert lines["sft"] == "0 of 2 differ" and lines["bmm"] == "0 of 0 differ"
