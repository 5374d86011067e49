"""``erft export-verl`` read by verl's own code: ``RLHFDataset`` reads the parquet files, and verl's ``naive``
reward manager calls ``integrations.verl_reward.compute_score`` loaded as verl loads a custom reward function
(``get_custom_reward_fn``: the file by path, ``reward.custom_reward_function.{path,name}``).

Countdown needs nothing beyond entropy_rft; the reasoning-gym case needs reasoning-gym, which `make test-verl`
installs into .venv-verl.
"""

from __future__ import annotations

import string

import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.workers.reward_manager.naive import NaiveRewardManager

from entropy_rft.cli.export_verl import reward_path
from entropy_rft.cli.main import main
from entropy_rft.models.loading import build_char_tokenizer
from entropy_rft.tasks import build_task

CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


def tokenizer():
    tok = build_char_tokenizer(alphabet="".join(c for c in string.printable if not c.isspace()))
    tok.chat_template = CHAT
    tok.model_max_length = 4096
    return tok


def export(tmp_path, *argv):
    out = tmp_path / "data"
    assert main(["export-verl", *argv, "--out", str(out)]) == 0
    return out / "train.parquet", out / "val.parquet"


def dataset(path, tok, tmp_path):
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 512, "filter_overlong_prompts": True,
                            "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "cache")})
    return RLHFDataset(data_files=str(path), tokenizer=tok, config=cfg)


def verl_reward_fn():
    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": reward_path(), "name": "compute_score"}}})
    fn = get_custom_reward_fn(cfg)
    assert fn is not None
    return fn


def rewards(tok, items, responses):
    """verl's naive reward manager over (dataset items, response texts): the reward of each row."""
    batch = collate_fn(items)
    prompts = tok([str(i) for i in range(len(items))], padding=True, return_tensors="pt")
    tok.padding_side = "right"
    resp = tok(responses, padding=True, add_special_tokens=False, return_tensors="pt")
    tok.padding_side = "left"
    data = DataProto.from_dict(
        tensors={"prompts": prompts["input_ids"], "responses": resp["input_ids"],
                 "attention_mask": torch.cat([prompts["attention_mask"], resp["attention_mask"]], dim=1)},
        non_tensors={k: batch[k] for k in ("data_source", "reward_model", "extra_info")},
    )
    manager = NaiveRewardManager(tokenizer=tok, num_examine=0, compute_score=verl_reward_fn())
    return manager(data).sum(dim=-1).tolist()


def test_countdown_export_read_by_rlhf_dataset_and_scored_by_verl(tmp_path):
    train_path, val_path = export(tmp_path, "--task", "countdown", "--task-param", "n_val=6", "--seed", "2")
    task = build_task("countdown", n_val=6)
    train, val = task.split(2)
    tok = tokenizer()
    ds = dataset(val_path, tok, tmp_path)
    assert len(ds) == 6
    items = [ds[i] for i in range(len(ds))]
    for i, (item, ex) in enumerate(zip(items, val)):
        assert item["raw_prompt"] == [{"role": "user", "content": ex.prompt}]
        assert item["data_source"] == "erft:countdown"
        assert item["reward_model"]["ground_truth"] == str(ex.answer)
        assert item["index"] == i and item["extra_info"]["split"] == "val"
    assert len(dataset(train_path, tok, tmp_path)) == len(train)

    good = [task.solutions(ex)[0] for ex in val]
    responses = [g if i % 2 == 0 else "1+1+1+1" for i, g in enumerate(good)]
    assert rewards(tok, items, responses) == [1.0, 0.0] * 3


def test_rg_export_read_and_scored_by_verl(tmp_path):
    _, val_path = export(tmp_path, "--task", "rg:products", "--task-param", "size=20", "--task-param", "val_size=4")
    tok = tokenizer()
    items = [dataset(val_path, tok, tmp_path)[i] for i in range(4)]
    gold = [it["reward_model"]["ground_truth"] for it in items]
    responses = [f"<answer>{g}</answer>" if i < 2 else f"<answer>{int(g) + 1}</answer>" for i, g in enumerate(gold)]
    assert rewards(tok, items, responses) == [1.0, 1.0, 0.0, 0.0]
