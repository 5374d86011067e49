"""Test harness only: a real ``python -m verl.trainer.main_ppo`` GRPO job on the CPU, in a subprocess.

A tiny Llama over the project's character tokenizer, Countdown rows from ``erft export-verl``, the harness's
reward with spread (``erft_cpu_reward``), verl's console logger; the CPU platform, engines and rollout come
from ``erft_cpu_platform`` through ``VERL_USE_EXTERNAL_MODULES``. ``metrics`` reads the per-step figures back
from the console log.
"""

from __future__ import annotations

import contextlib
import os
import re
import string
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
EXTERNAL = "erft_cpu_platform,entropy_rft.integrations.verl"


def make_model(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (d 64) over the character tokenizer with a chat template, saved in HF format."""
    import torch
    from transformers import LlamaForCausalLM

    from entropy_rft.models.scratch import build_char_tokenizer, llama_config, save_policy

    tok = build_char_tokenizer(alphabet="".join(c for c in string.printable if not c.isspace()))
    tok.chat_template = CHAT
    tok.model_max_length = 512
    torch.manual_seed(seed)
    cfg = llama_config(tok, d_model=64, layers=2, heads=4, mlp=128, max_positions=256)
    save_policy(folder, LlamaForCausalLM(cfg), tok)
    return folder


def export_data(folder: Path) -> Path:
    """Countdown's train and val splits as verl parquet files (``erft export-verl``)."""
    from entropy_rft.cli.main import main

    if main(["export-verl", "--task", "countdown", "--out", str(folder)]) != 0:
        raise RuntimeError("erft export-verl failed")
    return folder


def overrides(model: Path, data: Path, out: Path, *, loss_mode: str, trainer_mode: str = "sync", ranks: int = 1,
              steps: int = 3, extra: tuple[str, ...] = ()) -> list[str]:
    """main_ppo's overrides for a small seeded GRPO job (4 prompts x 4 samples a step, 8 response tokens);
    ``extra`` adds keys or replaces the job's own."""
    base = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "data.shuffle=False",
        "data.dataloader_num_workers=0",
        f"reward.custom_reward_function.path={HERE / 'erft_cpu_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.calculate_entropy=True",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "actor_rollout_ref.rollout.name=hf_cpu",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"trainer.v1.trainer_mode={trainer_mode}",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "+ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"+ray_kwargs.ray_init.num_gpus={ranks}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    return merged(base, list(extra))


def merged(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with each key that ``extra`` also sets replaced by ``extra``'s value, then ``extra``'s other keys
    (Hydra refuses a key given twice)."""
    ours = {_key(o): o for o in extra}
    return [ours.pop(_key(o), o) for o in base] + list(ours.values())


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def kit_overrides(script: Path, model: Path, data: Path, harness: list[str]) -> list[str]:
    """The launch script's own overrides (its ``DRY_RUN=1`` output, with ``MODEL`` and ``DATA`` set), each key
    that the harness also sets replaced by the harness's value (model, sizes, devices, rollout, reward), then the
    harness's remaining keys: what the documented command becomes on this machine."""
    env = {**os.environ, "DRY_RUN": "1", "MODEL": str(model), "DATA": str(data),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{script} DRY_RUN=1 failed: {r.stderr[-2000:]}")
    return merged([o for o in r.stdout.splitlines() if o], harness)


def run_job(args: list[str], out: Path, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    """Run main_ppo with ``args``; its console log (stdout and stderr) lands in ``out/job.log`` and is returned.
    Raises with the log's tail when the job fails."""
    out.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": EXTERNAL,
                "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                "HYDRA_FULL_ERROR": "1", "WANDB_MODE": "disabled", **(env or {})}
    log = out / "job.log"
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args], stdout=f, stderr=subprocess.STDOUT,
                           env=full_env, cwd=out, timeout=timeout)
    text = log.read_text(errors="replace")
    if r.returncode != 0:
        raise RuntimeError(f"main_ppo exited {r.returncode}; log {log}:\n{text[-6000:]}")
    return text


_STEP = re.compile(r"step:(\d+) - (.*)")
_NUMPY = re.compile(r"^np\.\w+\((.*)\)$")  # verl prints numpy scalars as np.float64(x)


def metrics(log: str) -> dict[int, dict[str, float]]:
    """Per-step metrics from verl's console logger lines (``step:N - key:value - ...``; numpy scalars unwrapped)."""
    out: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        m = _STEP.search(line)
        if not m:
            continue
        row = out.setdefault(int(m.group(1)), {})
        for part in m.group(2).split(" - "):
            key, _, val = part.rpartition(":")
            val = val.strip()
            numpy = _NUMPY.match(val)
            with contextlib.suppress(ValueError):
                row[key.strip()] = float(numpy.group(1) if numpy else val)
    return out
