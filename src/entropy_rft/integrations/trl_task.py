"""An erft task as TRL sees it: the prompts as a ``datasets.Dataset`` and the task's reward as a TRL reward
function (``erft train --engine trl``)."""

from __future__ import annotations

from datasets import Dataset

from entropy_rft.tasks.prompts import ChatPrompt, as_conversation, has_chat_template


def prompt_dataset(examples, tokenizer):
    """The ``datasets.Dataset`` TRL trains on: a ``prompt`` column and ``erft_index`` back into ``examples``.

    Chat prompts (math tasks) become conversations when the tokenizer has a chat template, so TRL applies
    the template itself; anything else stays plain text.
    """
    chat = has_chat_template(tokenizer) and all(isinstance(ex.prompt, ChatPrompt) for ex in examples)
    prompts = [as_conversation(ex.prompt) if chat else str(ex.prompt) for ex in examples]
    return Dataset.from_dict({"prompt": prompts, "erft_index": list(range(len(examples)))})


def task_reward_func(erft_task, examples: list, on_scored=None):
    """An erft task's reward as a TRL reward function (named ``task``): TRL passes the dataset's ``erft_index``
    column (``prompt_dataset``) with the completions; ``on_scored(examples, texts, rewards)`` sees each batch."""
    def task(completions, erft_index, **_kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        batch = [examples[i] for i in erft_index]
        rewards = [float(erft_task.reward(text, ex)) for text, ex in zip(texts, batch)]
        if on_scored is not None:
            on_scored(batch, texts, rewards)
        return rewards

    return task
