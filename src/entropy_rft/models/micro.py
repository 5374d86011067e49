"""The micro policy: a random tiny Llama (the character tokenizer, d 32, one layer, two heads) whose samples get
different rewards on the digit tasks (:mod:`entropy_rft.tasks.digits`), and the settings that train it for a few
steps in seconds. The smoke policy of the tests (tests/micro.py re-exports it) and of the benchmarks; its bytes are a
function of the seed alone (benchmarks/fingerprint.py's digests depend on them).

Building it imports torch and transformers (seconds); importing this module does not.
"""

from __future__ import annotations

from pathlib import Path

DIGIT_TASK = "entropy_rft.tasks.digits:DigitTask"


def make_micro_policy(folder: Path, seed: int = 0) -> Path:
    """The micro policy drawn from ``seed``, saved in ``folder`` (an HF folder any ``--model`` takes); returns it."""
    import torch
    from transformers import LlamaForCausalLM

    from entropy_rft.models.scratch import build_char_tokenizer, llama_config, save_policy

    torch.manual_seed(seed)
    tok = build_char_tokenizer()
    model = LlamaForCausalLM(llama_config(tok, d_model=32, layers=1, heads=2, mlp=64))
    with torch.no_grad():  # make the first digit likely enough for rewards to vary
        model.lm_head.weight.mul_(4.0)
    save_policy(folder, model, tok)
    return folder


def micro_overrides(model_dir: Path, **extra) -> list[str]:
    """``--set`` overrides that train the policy in ``model_dir`` on the digit task for 4 steps of 4 x 4 samples
    (checkpoints, evaluations, samples and probe records every 2 steps, one thread); ``extra`` replaces or adds
    settings (``**{"task.name": ...}``)."""
    sets = {
        "model.name": str(model_dir),
        "task.name": DIGIT_TASK,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "eval.every": 2,
        "eval.prompts": 8,
        "eval.samples": 4,
        "train.max_steps": 4,
        "train.checkpoint_every": 2,
        "train.samples_every": 2,
        "probe.records_every": 2,
        "probe.records_per_step": 16,
        "train.progress": False,
        "train.threads": 1,
        "optim.lr": 1e-2,
        "tuned_for": "",  # settings made for this micro policy: no "tuned for another model" warning
    }
    sets.update(extra)
    return [f"{k}={v}" for k, v in sets.items()]
