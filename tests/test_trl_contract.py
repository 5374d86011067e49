"""The contract between ``EntropyControlGRPOTrainer`` and the installed TRL (1.16): every hook of ``GRPOTrainer``
the subclass overrides or calls exists with the parameter names the plug-in relies on, every ``GRPOConfig`` field it
reads or sets exists, and the attributes it writes are the ones TRL's loss reads. A TRL release that renames or
removes one fails here, naming it, before a training run meets it (the tested-version pin,
``check_trl_version``, is the other guard).

How a break shows: ``contract_breaks`` reads each name with ``getattr`` and the parameters with
``inspect.signature``, so a removed hook is "missing" and a renamed or reordered parameter differs from ``HOOKS``;
``test_a_renamed_or_removed_hook_is_a_break`` runs it on fake classes that do exactly that.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from entropy_rft.integrations.trl import EntropyControlGRPOTrainer  # noqa: E402

# hook -> the parameters (self excluded) erft relies on, and how:
#   "prefix": the first parameters, in this order (erft passes them positionally, or TRL passes them to ours so);
#   "names": present, in any order (erft passes or reads them by name).
HOOKS: dict[str, tuple[str, tuple[str, ...]]] = {
    # overridden (TRL calls ours in its place)
    "__init__": ("names", ("model", "args")),  # read by name through TRL's signature (trl_support.bound_arguments)
    "_get_per_token_logps_and_entropies": ("prefix", ("model", "input_ids", "attention_mask", "logits_to_keep",
                                                      "batch_size", "compute_entropy", "compute_aux_loss")),
    "_generate_and_score_completions": ("prefix", ("inputs",)),
    "_compute_loss": ("prefix", ("model", "inputs")),
    "_save_checkpoint": ("prefix", ("model", "trial")),
    "_load_rng_state": ("prefix", ("checkpoint",)),
    # called only
    "_get_output_dir": ("names", ("trial",)),
}
OVERRIDDEN = {"__init__", "_get_per_token_logps_and_entropies", "_generate_and_score_completions", "_compute_loss",
              "_save_checkpoint", "_load_rng_state", "log"}

# GRPOConfig fields erft reads (refusals, windows, seeds) or sets (a composing method's clip and entropy coefficient)
CONFIG_FIELDS = ("epsilon", "epsilon_high", "entropy_coef", "use_adaptive_entropy", "beta", "loss_type",
                 "importance_sampling_level", "top_entropy_quantile", "off_policy_mask_threshold", "delta", "use_vllm",
                 "vllm_importance_sampling_correction", "use_bias_correction_kl", "steps_per_generation",
                 "gradient_accumulation_steps", "num_iterations", "per_device_train_batch_size", "seed")

# attribute TRL's __init__ sets from its config -> the config field; _apply_knob_to_trl writes the attribute, which
# TRL's _compute_loss must read for the write to act
KNOB_ATTRIBUTES = {"epsilon_low": "epsilon", "epsilon_high": "epsilon_high", "entropy_coef": "entropy_coef",
                   "_entropy_bonus_enabled": "entropy_coef"}

# keys of the per-micro-batch inputs that erft writes and TRL's _compute_loss must read: a drop in the loss mask
# and its normaliser, Clip-Cov's zeroes in the advantages
LOSS_INPUTS = ("tool_mask", "num_items_in_batch", "advantages", "completion_mask", "old_per_token_logps")

# Every other attribute of the trainer that erft's TRL modules read or write and do not define (the subclass on
# ``self``, ``trl_train`` and ``trl_logging`` on the trainer they hold) -> where TRL (GRPOTrainer) or transformers
# (Trainer) sets it and what erft relies on, as (class, function, pattern in its source). ``touched`` derives the
# list from erft's code, so a new read of a TRL name fails until it is pinned here.
TRL_ATTRIBUTES: dict[str, list[tuple[str, str, str]]] = {
    # TRL's count of the micro-batches trained: 0 at the start, +1 after each; the micro-batch it hands out is
    # _buffered_inputs[_step % steps_per_generation], so erft's optimizer window is the ga micro-batches of the
    # buffer from _step - _step % ga (trl._window_inputs)
    "_step": [("GRPOTrainer", "__init__", r"self\._step = 0\b"),
              ("GRPOTrainer", "training_step", r"self\._step \+= 1"),
              ("GRPOTrainer", "training_step", r"self\._step % self\.current_gradient_accumulation_steps == 0"),
              ("GRPOTrainer", "_prepare_inputs",
               r"self\._buffered_inputs\[self\._step % self\.args\.steps_per_generation\]")],
    # the generation batch as steps_per_generation micro-batch dicts (None before the first generation and after
    # a resume); erft reads the window's micro-batches and their RolloutRows from it
    "_buffered_inputs": [("GRPOTrainer", "__init__", r"self\._buffered_inputs = None"),
                         ("GRPOTrainer", "_prepare_inputs",
                          r"self\._buffered_inputs = \[unsplit_pixel_values_by_grid\(batch\) for batch in "
                          r"generation_batches\]")],
    # TRL's log buffer, a list per key and mode: erft appends its metrics (trl._record; its loss calls' in its override
    # of log, before TRL's) and reads TRL's reward of the generation batch; TRL's log averages and clears it
    "_metrics": [("GRPOTrainer", "__init__", r'self\._metrics = \{"train": defaultdict\(list\), "eval": '
                                             r"defaultdict\(list\)\}"),
                 ("GRPOTrainer", "_generate_and_score_completions", r'self\._metrics\[mode\]\["reward"\]\.append\('),
                 ("GRPOTrainer", "log", r"for key, val in self\._metrics\[mode\]\.items\(\)"),
                 ("GRPOTrainer", "log", r"self\._metrics\[mode\]\.clear\(\)")],
    # the micro-batches of the current optimizer step, set by transformers' loop (erft reads it with the config's
    # gradient_accumulation_steps as the fallback before training)
    "current_gradient_accumulation_steps": [
        ("Trainer", "_run_epoch", r"self\.current_gradient_accumulation_steps = len\(batch_samples\)")],
    # TRL's settings, from its config in __init__
    "beta": [("GRPOTrainer", "__init__", r"self\.beta = args\.beta\b")],
    "loss_type": [("GRPOTrainer", "__init__", r"self\.loss_type = args\.loss_type\b")],
    "num_iterations": [("GRPOTrainer", "__init__", r"self\.num_iterations = args\.num_iterations\b")],
    "temperature": [("GRPOTrainer", "__init__", r"self\.temperature = args\.temperature\b")],
    "max_completion_length": [("GRPOTrainer", "__init__",
                               r"self\.max_completion_length = args\.max_completion_length\b")],
    "eos_token_ids": [("GRPOTrainer", "__init__", r"self\.eos_token_ids = eos_token_ids\b")],
    # the group size, and the generation batch's rows grouped by it (the token view groups this process's rows so)
    "num_generations": [("GRPOTrainer", "__init__", r"self\.num_generations = args\.num_generations\b"),
                        ("GRPOTrainer", "_generate_and_score_completions",
                         r"rewards\.view\(-1, num_generations\)")],
    # the tokenizer the trainer holds (the token view decodes prompts and completion tokens with it)
    "processing_class": [("Trainer", "__init__", r"self\.processing_class = processing_class\b")],
    # transformers' Trainer
    "args": [("Trainer", "__init__", r"self\.args = args\b")],
    "model": [("Trainer", "__init__", r"self\.model = model\b")],
    "accelerator": [("Trainer", "create_accelerator_and_postprocess", r"self\.accelerator = Accelerator\(")],
    "state": [("Trainer", "__init__", r"self\.state = TrainerState\(")],
    "add_callback": [("Trainer", "add_callback", r"def add_callback\(self, callback\b")],
    "train": [("Trainer", "train", r"resume_from_checkpoint")],
    "save_model": [("Trainer", "save_model", r"def save_model\(self, output_dir")],
}


def contract_breaks(cls: type, hooks: dict[str, tuple[str, tuple[str, ...]]]) -> list[str]:
    """Each way ``cls`` breaks ``hooks``: a hook missing, or its parameters not those erft relies on."""
    out = []
    for name, (how, want) in hooks.items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            out.append(f"{cls.__name__}.{name}: missing")
            continue
        have = tuple(list(inspect.signature(fn).parameters)[1:])  # self excluded
        ok = have[:len(want)] == want if how == "prefix" else set(want) <= set(have)
        if not ok:
            out.append(f"{cls.__name__}.{name}{have}: erft relies on {how} {want}")
    return out


def test_trls_hooks_have_the_parameters_erft_relies_on():
    assert contract_breaks(GRPOTrainer, HOOKS) == []


def test_a_renamed_or_removed_hook_is_a_break():
    """The check fails on a TRL whose hook is gone, renamed, or has a parameter renamed or moved."""

    class Renamed:  # _compute_loss(model, batch): a parameter renamed; no _load_rng_state at all
        def __init__(self, model, reward_funcs=None, config=None): ...
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               compute_entropy=False, batch_size=None, compute_aux_loss=False): ...
        def _generate_and_score_completions(self, inputs): ...
        def _compute_loss(self, model, batch): ...
        def _save_checkpoint(self, model, trial): ...
        def _get_output_dir(self, trial): ...

    breaks = contract_breaks(Renamed, HOOKS)
    assert len(breaks) == 4, breaks
    for what in ("__init__", "_get_per_token_logps_and_entropies", "_compute_loss", "_load_rng_state: missing"):
        assert any(what in b for b in breaks), (what, breaks)


def test_the_subclass_overrides_exactly_the_pinned_hooks_and_takes_what_trl_passes():
    """Every method of the subclass that shadows a GRPOTrainer name is a pinned hook (a new override, or a TRL
    method added under the name of one of our helpers, fails here), and each override binds every parameter
    TRL's own hook takes, by the same names."""
    shadowing = {n for n, v in vars(EntropyControlGRPOTrainer).items()
                 if callable(v) and hasattr(GRPOTrainer, n) and not n.startswith("__") or n == "__init__"}
    assert shadowing == OVERRIDDEN
    for name in OVERRIDDEN - {"__init__"}:
        trl_params = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)[1:]
        ours = inspect.signature(getattr(EntropyControlGRPOTrainer, name))
        ours.bind(None, **{p: None for p in trl_params})  # TypeError: ours lacks one of TRL's parameters


def test_the_subclass_attributes_are_its_own():
    """The attributes the subclass sets on the trainer are names neither GRPOTrainer nor transformers' Trainer
    uses, except TRL's loss options that ``_apply_knob_to_trl`` writes on purpose."""
    import transformers

    ours = set(re.findall(r"self\.(\w+)(?:\s*:[^=\n]+)?\s*=[^=]", inspect.getsource(EntropyControlGRPOTrainer)))
    ours |= set(re.findall(r"setattr\(self, (\w+)", inspect.getsource(EntropyControlGRPOTrainer)))
    ours.discard("attr")  # setattr(self, attr, ...): the knob attributes, named in KNOB_ATTRIBUTES
    assert {"method", "plan", "_hook", "_generation", "_entropy_bonus_enabled"} <= ours, ours
    theirs = inspect.getsource(GRPOTrainer) + inspect.getsource(transformers.Trainer)
    assert not re.search(r"\bloss_settings\b", theirs)  # the subclass's property
    shared = {a for a in ours if re.search(rf"self\.{a}\b", theirs)}
    assert shared == set(KNOB_ATTRIBUTES) & ours, sorted(shared)


def test_the_multimodal_parameters_erft_forwards_default_to_none():
    """The override forwards TRL's parameters after ``compute_aux_loss`` as ``**multimodal`` and treats a pass
    with any of them set as not ours: each must default to None."""
    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters.values())[8:]
    assert params and all(p.default is None for p in params), params


def test_config_fields_and_the_attributes_trls_loss_reads():
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(CONFIG_FIELDS) <= fields, sorted(set(CONFIG_FIELDS) - fields)
    init = inspect.getsource(GRPOTrainer.__init__)
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    for attr, field in KNOB_ATTRIBUTES.items():
        assert re.search(rf"self\.{attr} = .*\b{field}\b", init), (attr, field)  # set from the config in __init__
        assert f"self.{attr}" in loss, attr  # read by the loss
    for key in LOSS_INPUTS:
        assert f'"{key}"' in loss, key


def test_trls_shuffle_and_split_carry_the_rollout_rows_with_their_rows():
    """``RolloutRows`` rides in TRL's generation batch: TRL's shuffle permutes its tensors with the batch's rows, and
    its split hands each micro-batch the rows it trains on (the plug-in reads them back with ``RolloutRows.of``)."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from entropy_rft.integrations.trl_support import RolloutRows

    torch.manual_seed(0)
    rows = torch.arange(8)
    batch = {"prompt_ids": rows[:, None].repeat(1, 3)}
    RolloutRows(rows[:, None].float().repeat(1, 5), (rows[:, None] % 2 == 0).repeat(1, 5)).put(batch)
    parts = split_tensor_dict(shuffle_sequence_dict(batch), 4)
    assert len(parts) == 4
    for part in parts:
        got = RolloutRows.of(part)
        assert got is not None and got.old_logps.shape == (2, 5)
        assert torch.equal(got.old_logps[:, 0].long(), part["prompt_ids"][:, 0])
        assert torch.equal(got.keep[:, 0], part["prompt_ids"][:, 0] % 2 == 0)
    assert RolloutRows.of({"prompt_ids": rows}) is None  # a batch the plug-in did not see (evaluation)


def test_the_argument_binding_takes_args_by_name_or_position(monkeypatch):
    """The subclass finds its GRPOConfig as GRPOTrainer's ``args`` whether passed by keyword or by position,
    hands TRL a config with the method's clip at the caller's place, and leaves the caller's config as it was;
    a call TRL's signature refuses names TRL's parameters."""
    from entropy_rft.integrations import trl as erft_trl
    from entropy_rft.integrations.trl_support import bound_arguments, replace_argument, trl_plan

    sig = erft_trl._TRL_INIT
    cfg = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], epsilon=0.3)
    for args, kwargs in (((), {"model": "m", "args": cfg}), (("m", None, cfg), {})):
        assert bound_arguments(sig, args, kwargs)["args"] is cfg
    method = erft_trl.build_method("clip_higher", eps_low=0.1, eps_high=0.4)
    ours = trl_plan(method, cfg, "m").args  # delegated: the method's clip in a copy of the caller's config
    assert (ours.epsilon, ours.epsilon_high, cfg.epsilon, cfg.epsilon_high) == (0.1, 0.4, 0.3, None)
    assert trl_plan(method, cfg, "m", agg="token-mean").args is cfg  # erft's loss: the caller's config as given
    assert replace_argument(sig, ("m", None, cfg), {}, "args", ours) == (("m", None, ours), {})
    assert replace_argument(sig, ("m",), {"args": cfg}, "args", ours) == (("m",), {"args": ours})
    assert replace_argument(sig, ("m",), {}, "args", ours) == (("m",), {"args": ours})
    with pytest.raises(TypeError, match="GRPOTrainer's parameters: model, reward_funcs, args"):
        bound_arguments(sig, (), {"args": cfg, "modle": "m"})


def _names_on(source: str, is_obj) -> set[str]:
    """Every attribute read or written on the objects ``is_obj`` accepts (an AST node), and every literal name
    given to ``getattr``/``setattr``/``hasattr`` on them, in ``source``."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and is_obj(node.value):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1 and is_obj(node.args[0])
              and isinstance(node.args[1], ast.Constant)):
            out.add(node.args[1].value)
    return out


def touched() -> set[str]:
    """The names of the trainer erft's TRL modules touch and do not define: the subclass's ``self.X`` (its own
    methods and the attributes it sets for itself left out), ``trl_train``'s ``trainer.X`` and ``trl_logging``'s
    ``self.trainer.X`` / ``trainer.X``."""
    from entropy_rft.integrations import trl_logging, trl_train

    def is_self(n):
        return isinstance(n, ast.Name) and n.id == "self"

    def is_trainer(n):
        return (isinstance(n, ast.Name) and n.id == "trainer") or (
            isinstance(n, ast.Attribute) and n.attr == "trainer" and is_self(n.value))

    src = inspect.getsource(EntropyControlGRPOTrainer)
    names = _names_on(src, is_self)
    names |= _names_on(inspect.getsource(trl_train), is_trainer) | _names_on(inspect.getsource(trl_logging), is_trainer)
    own = set(re.findall(r"self\.(\w+)(?:\s*:[^=\n]+)?\s*=[^=]", src)) - set(KNOB_ATTRIBUTES)
    return names - set(vars(EntropyControlGRPOTrainer)) - own


def test_erft_touches_only_the_trl_names_a_test_pins():
    """Every name of TRL's trainer that erft reads or writes is pinned: a hook (``HOOKS``), a knob attribute
    (``KNOB_ATTRIBUTES``) or an attribute of ``TRL_ATTRIBUTES``, and the lists name nothing erft no longer
    touches."""
    names = touched()
    assert {"_step", "_buffered_inputs", "_metrics", "current_gradient_accumulation_steps"} <= names, names
    assert names - set(HOOKS) - set(KNOB_ATTRIBUTES) == set(TRL_ATTRIBUTES)
    assert {n for n in HOOKS if n not in OVERRIDDEN} <= names  # the hooks erft only calls (self._get_output_dir)


def test_each_trl_attribute_is_set_and_used_as_erft_relies_on():
    """Where TRL or transformers sets each attribute of ``TRL_ATTRIBUTES`` and the use erft relies on, in their
    source (a TRL release that renames one, or changes how its micro-batch counter picks from the buffer, fails
    here naming it)."""
    import transformers

    owners = {"GRPOTrainer": GRPOTrainer, "Trainer": transformers.Trainer}
    for name, pins in TRL_ATTRIBUTES.items():
        for owner, fn, pattern in pins:
            src = inspect.getsource(getattr(owners[owner], fn))
            assert re.search(pattern, src), f"{owner}.{fn}: no {pattern!r} (erft relies on it for {name})"


def test_the_trl_names_erft_imports_exist():
    """Every ``from trl... import name`` of erft's TRL modules, the lazy ones inside functions included."""
    import importlib.util

    from entropy_rft.integrations import trl as erft_trl
    from entropy_rft.integrations import trl_logging, trl_script, trl_support, trl_task, trl_train

    seen = 0
    for mod in (erft_trl, trl_support, trl_task, trl_train, trl_script, trl_logging):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl":
                target = importlib.import_module(node.module)
                for a in node.names:
                    found = hasattr(target, a.name) or importlib.util.find_spec(f"{node.module}.{a.name}")
                    assert found, f"{mod.__name__}: from {node.module} import {a.name}"
                    seen += 1
    assert seen >= 4
