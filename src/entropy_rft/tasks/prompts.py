"""Prompt templates, and chat templates applied at tokenisation time.

A math task writes each question into :data:`MATH_TEMPLATE` ("reason step by step and put the final
answer in \\boxed{}"). With ``prompt_format="chat"`` the prompt becomes a :class:`ChatPrompt`: a ``str``
(the user message, so logs, JSON and any code that treats prompts as text keep working) that also carries
its chat ``messages``. :func:`encode_prompt`, which ``rollout.tokenize_prompts`` calls for every prompt,
renders a ChatPrompt with the tokenizer's chat template (``add_generation_prompt=True``) when the tokenizer
has one, and tokenises plain text as before. So the :class:`~entropy_rft.tasks.base.Task` interface is
unchanged, the task needs no tokenizer, and the same task file works for a base model (no template:
plain text) and an instruct model (template).

For engines that apply chat templates themselves (TRL's ``GRPOTrainer`` does so for conversational
datasets), :func:`as_conversation` gives the messages list.
"""

from __future__ import annotations

from typing import Any

MATH_TEMPLATE = "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
PROMPT_FORMATS = ("chat", "plain")


class ChatPrompt(str):
    """A user message (its text is the str value) meant to be rendered with the model's chat template.

    ``system`` is an optional system message; ``None`` leaves the template's default.
    """

    system: str | None

    def __new__(cls, text: str, system: str | None = None) -> ChatPrompt:
        obj = super().__new__(cls, text)
        obj.system = system
        return obj

    def __reduce__(self):
        return (ChatPrompt, (str(self), self.system))

    @property
    def messages(self) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": str(self)}]


def format_question(question: str, template: str = MATH_TEMPLATE) -> str:
    """Put ``question`` into ``template`` (which must contain ``{question}``)."""
    if "{question}" not in template:
        raise ValueError(f"prompt template must contain '{{question}}', got {template!r}")
    # the template's own "{{}}" is unescaped, never the question's text (a dataset row may hold "{{}}")
    return question.strip().join(part.replace("{{}}", "{}") for part in template.split("{question}"))


def make_prompt(question: str, *, template: str = MATH_TEMPLATE, prompt_format: str = "chat",
                system: str | None = None) -> str:
    """The prompt for one question: a :class:`ChatPrompt` (``"chat"``) or plain text (``"plain"``)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    text = format_question(question, template)
    return ChatPrompt(text, system) if prompt_format == "chat" else text


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, prompt: str) -> tuple[str, bool]:
    """(text to tokenise, whether the text already holds the special tokens).

    A :class:`ChatPrompt` with a tokenizer that has a chat template is rendered by it; anything else is
    returned as is.
    """
    if isinstance(prompt, ChatPrompt) and has_chat_template(tokenizer):
        try:
            text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, SecurityError, the template's own raise
            from entropy_rft.common.errors import UserError

            what = (str(e).strip().splitlines() or [""])[0][:200] or type(e).__name__
            raise UserError(f"the tokenizer's chat template cannot render a prompt ({type(e).__name__}: {what}); "
                            "fix chat_template in the model's tokenizer_config.json, or pass plain prompts "
                            "(task.params.prompt_format=plain)") from None
        return text, True
    return str(prompt), False


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of one prompt: chat-rendered prompts without extra special tokens (the template wrote
    them), plain prompts with the tokenizer's usual ones."""
    text, templated = render_prompt(tokenizer, prompt)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def as_conversation(prompt: str) -> Any:
    """The messages list of a ChatPrompt (for engines that template themselves), else the text."""
    return prompt.messages if isinstance(prompt, ChatPrompt) else str(prompt)
