"""The typed run config: every knob, its default and one line of help, in one place.

A config is a YAML file whose sections mirror `RunConfig`; command-line overrides are dotted
`section.key=value` pairs whose values are parsed as YAML scalars. The defaults below ARE the
embedded default run (`examples/tiny_cpu.yaml` spells them out and a test keeps the two equal).
Unknown keys and wrong types fail with one line naming the key and the expected type.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect
import yaml

from raytool.types import SamplingParams

log = logging.getLogger(__name__)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-5` as a string; accept scientific notation without a dot as a float.
    A key given twice in one mapping is an error (PyYAML keeps the later one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key '{key}' is given twice in the same mapping "
                                  f"(first on line {seen[key] + 1}); YAML would keep the later one silently")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


# Ranges of numeric knobs, declared with each knob below; msgspec checks them when a config loads.
Count = Annotated[int, msgspec.Meta(ge=0)]  # 0, 1, 2, ...
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
PositiveNumber = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
MemoryShare = Annotated[float, msgspec.Meta(gt=0, le=1)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]  # -1: off
AboveOne = Annotated[float, msgspec.Meta(gt=1)]
Restarts = Annotated[int, msgspec.Meta(ge=-1)]  # -1: no limit
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: a free one


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what was expected."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    path: str = "smollm2-135m-instruct"  # built-in name (smollm2-135m-instruct, tiny-random) or HF checkpoint dir
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # rollout-engine weights and weight syncs (auto, decided on the driver: bfloat16 on GPU/NPU and native-bf16 CPUs, else float32)
    attn_implementation: str = "sdpa"  # transformers attention in the trainer (flash_attention_2 on GPUs that have it: sequences are then packed)


class DataConfig(_Section):
    task: Literal["auto", "tool_arith", "files", "verifiers"] = "auto"  # tool_arith: the generated task; files: prompt rows from train_files / val_files; verifiers: the dataset (and eval dataset) of the verifiers environment agent.environment names; auto: files when train_files names any, else verifiers when agent.environment is set, else tool_arith
    train_files: list[str] = msgspec.field(default_factory=list)  # files: raytool prompt rows (.parquet/.jsonl, as `raytool preprocess` writes them)
    val_files: list[str] = msgspec.field(default_factory=list)  # files: validation prompt rows (metrics per data source)
    train_size: Positive = 2048  # tool_arith: generated problems in the train split
    val_size: Count = 64  # tool_arith: generated problems in the validation split
    seed: int = 0  # task generation seed (train and val never overlap) and prompt shuffling
    prompts_per_step: Positive = 4  # prompts per GRPO step (each sampled rollout.n times)
    max_prompt_tokens: Positive | None = None  # longest prompt, as the chat template renders it (None: whatever fits rollout.max_model_len with agent.max_response_tokens after it)
    overlong_prompts: Literal["drop", "error"] = "drop"  # a prompt over either limit: drop (left out, the rows named in one line) or error (the run stops at start naming the first)


class EvalConfig(_Section):
    n: Positive = 4  # samples per validation prompt: acc/mean@n, maj@n, pass@n
    temperature: NonNegative = 1.0  # validation sampling (the reference recipes sample, they do not decode greedily)
    top_p: TopP = 1.0  # validation sampling's nucleus (1.0: off)
    max_prompts: Positive | None = None  # validate on the first this many prompts of the validation set (None: all)
    before_train: bool = True  # validate before the first GRPO step (after the SFT warm-up): the "before" of the end summary
    after_train: bool = True  # validate after the last GRPO step: the "after" of the end summary
    every: Count = 0  # validate every this many GRPO steps and after the last one (0: never during training)


class RolloutConfig(_Section):
    engine: Literal["vllm", "hf", "scripted"] = "vllm"  # rollout engine behind each RolloutServer (hf: tests, fallback; scripted: no model, a fixed two-cell tool conversation, for benchmarks of raytool itself)
    num_servers: Positive = 1  # RolloutServer replicas behind the LLMManager
    n: Positive = 4  # samples per prompt (the GRPO group size)
    temperature: NonNegative = 1.0  # sampling temperature of every rollout turn
    top_p: TopP = 1.0  # nucleus sampling (1.0: off)
    top_k: TopK = -1  # -1: no top-k
    max_tokens_per_turn: Positive = 96  # generation budget of one assistant turn; a config that sets agent.max_response_tokens (or verl's data.max_response_length) and not this gets that budget here too (verl has no per-turn limit)
    seed: int | None = None  # sampling seed per request from (seed, trajectory id, turn): reproducible rollouts (None: unseeded)
    max_batch_size: Positive = 64  # sequences one engine runs at once (vLLM max_num_seqs)
    num_cpus: NonNegative = 1.0  # Ray CPUs each server reserves
    num_gpus: NonNegative = 0.0  # accelerators (cluster.accelerator: GPU or NPU) each server reserves (vLLM: set it to tensor_parallel_size)
    tensor_parallel_size: Positive = 1  # vLLM: GPUs / NPUs one server's model is sharded over
    gpu_memory_utilization: MemoryShare = 0.85  # vLLM: fraction of accelerator memory the engine may take
    max_model_len: Positive | None = None  # vLLM: longest prompt + response a request may have (None: the model's own limit)
    cpu_kv_cache_gb: PositiveNumber = 1.0  # vLLM on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE)
    cpu_preload: bool = True  # vLLM on CPU: LD_PRELOAD tcmalloc (Debian libtcmalloc-minimal4) and Intel OpenMP (PyPI intel-openmp) where installed; +32% decode measured on 2 cores (`raytool bench engine`)
    enforce_eager: bool = True  # vLLM: no CUDA graphs / torch.compile: SmolLM2 on 2 CPU cores starts in 28 s instead of 106 s, decodes ~10% slower; set false on GPUs
    engine_start_timeout_s: Positive = 600  # a server whose engine is not up by then fails to start
    stall_timeout_s: PositiveNumber = 60.0  # a server whose engine produces no token for this long while requests wait on it (or that does not answer a probe within it: a hung process) is ejected and its requests retried elsewhere; long requests on a working server are never cut
    request_timeout_s: float | None = None  # deprecated: the total-time limit stall_timeout_s replaced (it ejected slow but healthy servers); ignored, with a warning
    affinity_slack: Count = 8  # GRPO siblings share a server unless it has more than this many requests in flight beyond the least busy
    max_restarts: Restarts = 10  # Ray restarts of a server whose process died (then re-synced and re-admitted; -1: no limit); one that dies after them stops the run in one line
    retry_budget: NonNegative = 1.0  # groups rolled out again per step, as a fraction of the groups the step started (never fewer than 4): past it a failing group has failed, so retries cannot multiply the load on a stage failing under it (0: the floor alone)
    max_group_retries: Count = 2  # a GRPO group hit by an infrastructure failure (sandbox, engine, reward fn or a worker that died) is rolled out again this many times, same seeds; then it is left out of the loss and recorded as failed
    health_probe_interval_s: PositiveNumber = 5.0  # how often the manager probes ejected servers for re-admission
    scripted_delay_s: NonNegative = 0.5  # engine=scripted: seconds each request takes
    scripted_crash: str | None = None  # engine=scripted: every request kills the engine with this error ('Type: message'): a deliberately poisoned engine

    def sampling(self, **fields) -> SamplingParams:
        """How one turn of a rollout samples (max_tokens_per_turn, temperature, top_p, top_k), with
        `fields` set on top (stop tokens, a seed, a smaller max_tokens): the one place it is built."""
        return SamplingParams(**{"max_tokens": self.max_tokens_per_turn, "temperature": self.temperature, "top_p": self.top_p,
                                 "top_k": self.top_k, **fields})

class AgentConfig(_Section):
    format: Literal["retool", "hermes", "llama3_json", "mistral", "qwen3_coder", "glm45", "kimi_k2", "deepseek", "gpt_oss", "auto"] = "retool"  # tool calls as ReTool <code> tags, Hermes/Qwen <tool_call> JSON, or a model family's own format (raytool.agent.families); auto: the format the model's chat template writes
    observation_style: Literal["tool_message", "in_turn"] = "tool_message"  # retool: output as a tool message (verl's recipe) or as <interpreter>...</interpreter> inside the same assistant turn (the ReTool paper)
    max_turns: Positive = 4  # assistant turns per trajectory (in_turn: tool rounds plus the answer)
    max_response_tokens: Positive = 384  # token budget of everything after the prompt
    max_tool_calls_per_turn: Positive = 4  # calls beyond this in one turn are answered with a too_many_calls error; the rest run concurrently
    tool_output_tokens: Positive = 256  # longer tool output is cut in the middle, with a "... N tokens truncated ..." marker
    max_trajectory_s: PositiveNumber = 600.0  # wall-clock limit of one trajectory (it ends with finish reason time_limit)
    max_concurrent_trajectories: Positive = 256  # trajectories one agent worker runs at once
    tools: str | None = None  # verl-format tool YAML (tools: [{class_name, config, tool_schema}]); None: the code interpreter only
    default_agent: str = "tool_agent"  # agent loop of rows without an agent_name (registered in raytool.agent.registry)
    langgraph_graph: str | None = None  # rows with agent_name langgraph: 'package.module:function' building the LangGraph agent from a chat model
    openai_agent: str | None = None  # rows with agent_name openai: 'package.module:function', an `async def agent(client, row) -> str` given an openai.AsyncOpenAI client on its trajectory's gateway URL
    environment: str | None = None  # rows with agent_name verifiers: the verifiers environment (an installed environment's id, or 'package.module:load_environment'); agent_name openenv: the OpenEnv server's URL, or its app ('package.module:app', served by each agent worker)
    environment_args: dict = msgspec.field(default_factory=dict)  # verifiers: keyword arguments of the environment's load_environment; openenv: action_field (default message) and observation_field (default: the observation as JSON)
    on_history_rewrite: Literal["truncate", "drop"] = "truncate"  # an agent (langgraph, openai) that rewrote its history: train on what was recorded up to there, or on none of it
    gateway: bool = False  # start an OpenAI-compatible gateway actor with the run, for agents outside raytool (its URL is logged and in RUN_DIR/gateway.json)
    gateway_host: str = "127.0.0.1"  # the gateway's interface (0.0.0.0: reachable from other machines, unauthenticated)
    gateway_port: Port = 0  # the gateway's TCP port (0: a free one)
    loop_modules: list[str] = msgspec.field(default_factory=list)  # modules the agent workers import first (where your own loops and tools register)
    num_workers: Positive | Literal["auto"] = "auto"  # AgentLoopWorker actors; auto: as many as keep every rollout server full (rollout.num_servers x rollout.max_batch_size sequences over agent.max_concurrent_trajectories each)
    system_prompt: str | None = None  # None: the task's own system prompt
    chat_template_kwargs: dict = msgspec.field(default_factory=dict)  # extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3 (verl's apply_chat_template_kwargs)


class SandboxConfig(_Section):
    backend: Literal["local", "sandbox_fusion", "e2b"] = "local"  # where code runs (local: isolated fork-server on the pool's node)
    num_pools: Positive = 1  # SandboxPool actors; a trajectory's cells all go to one pool (by session)
    pool_resources: dict[str, float] = msgspec.field(default_factory=dict)  # custom Ray resources each pool asks for, e.g. {sandbox: 1} to place pools on CPU nodes tagged with it
    max_concurrency: Positive = 8  # cells running at once in one pool
    max_queue: Positive = 256  # cells waiting for a slot in one pool; beyond it a cell is refused at once (back-pressure)
    timeout_s: PositiveNumber = 5.0  # wall-clock limit of one cell
    memory_mb: Positive = 1024  # memory a cell may allocate (address space beyond the preloaded interpreter)
    max_output_bytes: Positive = 8192  # stdout/stderr kept per cell (the rest is dropped and flagged)
    retries: Count = 1  # re-runs of a cell whose backend failed (infra_error), not of failing code
    breaker_failures: Positive = 5  # consecutive infrastructure failures that open a pool's circuit breaker
    breaker_reset_s: NonNegative = 10.0  # an open breaker fails cells fast for this long, then lets one probe through
    isolate: bool = True  # local: namespaces (no network, read-only file system, own PIDs); false only for debugging
    warm_sessions: Count = 4  # local: interpreters forked ahead so a new trajectory's first cell does not wait for a fork
    idle_session_s: PositiveNumber = 600.0  # local: a session unused this long is ended
    max_processes: Positive = 64  # local: processes (and threads) one session may run
    disk_mb: Positive = 64  # local: size of a session's private working directory (tmpfs) and of any file it writes
    fusion_url: str = "http://127.0.0.1:8080"  # sandbox_fusion: server base URL (or its /run_code endpoint)
    fusion_sessions: bool = False  # sandbox_fusion: keep interpreter state per trajectory (only `raytool sandbox serve` supports it)
    e2b_domain: str | None = None  # e2b: API domain (None: E2B's own; ap-shanghai.tencentags.com for Tencent AGS)
    e2b_api_key_env: str = "E2B_API_KEY"  # e2b: the environment variable holding the API key (never the key itself)
    e2b_template: str = "code-interpreter-v1"  # e2b: sandbox template
    e2b_sandbox_timeout_s: Positive = 300  # e2b: a sandbox's lifetime from its creation
    e2b_request_timeout_s: PositiveNumber = 30.0  # e2b: each API call
    added_latency_median_s: NonNegative = 0.0  # every cell waits a further lognormal delay with this median while it holds its slot (benchmarks: a remote sandbox's round trip on the local backend; 0: none)
    added_latency_p95_s: NonNegative = 0.0  # ... and this 95th percentile (>= the median)


class JudgeConfig(_Section):
    """An LLM judge (reward.fn: judge): a model behind an OpenAI-compatible API scores each response by a rubric."""

    base_url: str | None = None  # the judge's OpenAI-compatible API, e.g. http://judge-host:8000/v1 (`raytool serve` of a judge model, vLLM's server, a hosted API); `self`: the run's own rollout servers through its gateway (the policy judges)
    model: str | None = None  # the model name the judge's API serves (null: the first its /models lists)
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the judge API's key (never the key itself; unset: no key)
    rubric: str | None = None  # the judge's prompt, a Python format string over {prompt}, {response}, {reasoning}, {ground_truth}, {data_source} and the row's extra_info keys (null: a 0-10 correctness rubric)
    score_pattern: str = "(?i)score\\s*[:=]?\\s*(-?\\d+(?:\\.\\d+)?)"  # regex whose first group, searched in the judge's reply (its last match), is the score
    max_score: PositiveNumber | None = 10.0  # the score is divided by this (a 0-10 rubric becomes 0-1); null: used as it is
    temperature: NonNegative = 0.0  # the judge's sampling temperature
    max_tokens: Positive = 256  # the judge's reply length limit
    concurrency: Positive = 8  # judge calls one reward worker makes at once
    timeout_s: PositiveNumber = 60.0  # one judge call; a judge that fails or times out makes the trajectory infra-failed (retried), never a zero score
    cache_size: Count = 100000  # verdicts remembered per reward worker, keyed by the rubric text sent (question, answer, reference): a retried group is not judged twice (0: off)


class RewardConfig(_Section):
    fn: str = "math"  # registered reward (boxed_match: exact; math: 1/0 by math-verify; retool: +1/-1 shaped; judge: an LLM judge, see reward.judge) or `path/to/file.py:function`
    num_workers: Positive = 1  # RewardWorker actors
    timeout_s: PositiveNumber = 5.0  # per-answer math-verify limit; a timed-out answer scores as wrong (metric verify_timeout)
    call_timeout_s: PositiveNumber = 60.0  # one scoring call to a reward worker; a call that raises or outlives this is retried on the next worker
    retries: Count = 1  # scoring calls tried again after one failed (then the trajectory is infra-failed, never scored as wrong)
    tool_call_bonus: NonNegative = 0.1  # retool: added to a wrong answer's -1 per tool call (verl's ReTool recipe: 0.1)
    wrong_score_cap: float = -0.6  # retool: a wrong answer never scores above this, however many tool calls (< 1)
    format_penalty: NonNegative = 0.0  # subtracted when the fn reports has_answer=0: no final answer in a known format (0: off)
    overlong_buffer_tokens: Count = 0  # DAPO overlong shaping over the last N tokens before agent.max_response_tokens (0: off)
    overlong_penalty_factor: NonNegative = 1.0  # DAPO: the penalty at agent.max_response_tokens, rising linearly from 0 over the buffer
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)

    @property
    def judges_itself(self) -> bool:
        """reward.judge.base_url self: the policy being trained is the judge, through the run's gateway."""
        return self.fn == "judge" and self.judge.base_url == "self"


class RolloutCorrectionConfig(_Section):
    """Off-policy correction between the engine's log-probs (the behaviour policy) and the trainer's
    (names after verl's algorithm.rollout_correction). auto: on in asynchronous mode, off in synchronous mode."""

    decoupled: bool = True  # decoupled PPO: clip around the trainer's own log-probs before the update (proximal policy); false: around the engine's (no recompute)
    rollout_is: Literal["auto", "token", "sequence"] | None = "auto"  # importance weight trainer/engine per token or per sequence, truncated (null: off)
    rollout_is_threshold: AboveOne = 2.0  # importance weights above this are cut to it
    rollout_rs: Literal["token", "sequence"] | None = None  # rejection: mask tokens (or whole sequences) whose trainer/engine ratio leaves [lower, upper] (null: off)
    rollout_rs_threshold: AboveOne = 2.0  # rejection: upper bound of the ratio
    rollout_rs_threshold_lower: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None  # rejection: lower bound (null: 1 / upper)


class AlgorithmConfig(_Section):
    adv_estimator: str = "grpo"  # registered advantage estimator (grpo, rloo)
    norm_adv_by_std: bool = True  # GRPO: divide by the group std (False: Dr. GRPO)
    policy_loss: str = "ppo_clip"  # registered policy loss
    clip_ratio_low: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2  # PPO epsilon below 1
    clip_ratio_high: NonNegative = 0.28  # PPO epsilon above 1 (DAPO clip-higher)
    clip_ratio_c: AboveOne | None = 3.0  # dual-clip bound on the loss of negative-advantage tokens (> 1; None: off)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"  # token-mean counts tokens over the whole mini-batch, all ranks
    kl_type: Literal["k1", "k2", "k3"] = "k3"  # estimator of KL(policy || reference) (Schulman's k1/k2/k3)
    kl_loss_coef: NonNegative = 0.0  # KL to the reference policy as a loss term (0: off, no reference model is kept)
    kl_reward_coef: NonNegative = 0.0  # KL to the reference policy subtracted from each sequence's reward (0: off)
    entropy_coeff: NonNegative = 0.0  # entropy bonus in the loss (the entropy is reported either way)
    dynamic_sampling: bool = False  # DAPO: drop prompt groups whose rewards are all equal and roll out more prompts until the batch is full
    max_sampling_rounds: Positive = 4  # dynamic sampling: rollout rounds one step may take at most (then it trains on the groups it has)
    ppo_epochs: Positive = 1  # passes over each rollout batch
    mini_batches: Positive = 1  # optimizer steps per pass
    rollout_correction: RolloutCorrectionConfig = msgspec.field(default_factory=RolloutCorrectionConfig)

    @property
    def kl_on(self) -> bool:
        """A KL term is in the loss or in the reward: the trainer keeps a reference policy."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0


class TrainerConfig(_Section):
    total_steps: Count = 12  # GRPO steps
    total_epochs: Positive | None = None  # GRPO steps as passes over the training prompts instead (verl's trainer.total_epochs): whole batches of data.prompts_per_step per pass, counted at start; overrides total_steps
    lr: PositiveNumber = 5e-6  # peak learning rate of the GRPO phase
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after the warm-up
    warmup_steps: Count = 0  # linear learning-rate warm-up, in optimizer steps
    min_lr_ratio: Fraction = 0.0  # cosine: the final learning rate as a fraction of the peak
    weight_decay: NonNegative = 0.0  # AdamW weight decay
    grad_clip: PositiveNumber = 1.0  # global gradient-norm clip
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # forward/backward dtype (auto: bfloat16 on GPU/NPU and on CPUs with native bf16, float32 on other CPUs); weights and optimizer state are always float32
    micro_batch_tokens: Positive | Literal["auto"] = "auto"  # token budget of one forward/backward micro-batch (padded tokens; packed tokens when packing); auto: 4096 on a CPU, 16384 on an accelerator
    packing: bool | Literal["auto"] = "auto"  # sequences end to end in one row (auto: only with a varlen flash-attention kernel)
    prefix_sharing: bool | Literal["auto"] = "auto"  # the samples of a GRPO group as one tree per row: their shared prompt (and any later turns they agree on) run once, each sample attending to its own prefix (the same log-probs and gradients from fewer tokens); true: always, auto: in the micro-batches where it saves tokens; not with packing, sequence parallelism or mixture-of-experts models
    activation_checkpointing: bool | Literal["auto"] = "auto"  # recompute decoder layers in backward; auto: off on a CPU, on an accelerator on only when the planner finds that the micro-batch's activations would not fit without it
    compile: bool | Literal["auto"] = "auto"  # torch.compile each decoder layer and the LM head's log-prob chunk (CUDA GPUs and CPUs; not with NPU, SP or 4-bit); auto: on for CUDA GPUs (1.45x measured on an H100), off on CPUs and where it cannot run
    kernels: bool | Literal["auto"] = "auto"  # Liger-Kernel's fused Triton RMSNorm, SwiGLU and RoPE in the trainer's model (CUDA GPUs; pip install 'raytool[gpu]'; the log-prob head is raytool's own chunked one either way); auto: off everywhere until a GPU run has measured them to pay (`raytool bench trainer`, the device check's kernels variant)
    router_replay: Literal["off", "r2", "r3"] = "off"  # mixture-of-experts routing in the trainer's forward: r3 uses the experts the rollout engine routed each token to (vLLM on GPUs, or the HF engine, returns them), r2 the trainer's own old-policy routing in a batch's later updates; the gate weights stay the trainer's (verl: router_replay.mode R2/R3)
    router_aux_loss_coef: NonNegative = 0.0  # mixture of experts: the load-balancing loss (Switch Transformer's: experts x sum of each expert's token share x its mean router probability, per layer) added to the RL loss with this weight (0: off, as RL recipes run; the checkpoint's own router_aux_loss_coef is not used)
    logprob_chunk_tokens: Positive = 2048  # the LM head and log-softmax run over this many scored tokens at a time (more: recomputed in backward)
    cpu_offload: bool = False  # FSDP2 keeps parameters, gradients and optimizer state in host memory
    lora_rank: Count = 0  # LoRA adapters of this rank instead of full fine-tuning (0: off; one trainer worker)
    lora_alpha: Positive = 16  # LoRA scaling numerator
    lora_target_modules: list[str] = msgspec.field(default_factory=lambda: ["all-linear"])  # module names that get adapters
    load_in_4bit: bool = False  # QLoRA: the frozen base in bitsandbytes NF4 under the LoRA adapters (CUDA GPUs, one worker); weight sync sends it dequantized, adapters merged
    num_workers: Positive = 1  # TrainerWorker actors (data parallel, FSDP2 when > 1)
    sequence_parallel_size: Positive = 1  # Ulysses SP: each sequence split over this many consecutive workers (it divides num_workers and the attention heads)
    num_cpus: NonNegative = 1.0  # Ray CPUs each trainer worker reserves
    num_gpus: NonNegative = 0.0  # accelerators (cluster.accelerator: GPU or NPU) each trainer worker reserves
    seed: int = 0  # the run's seed: torch on the trainer ranks, SFT batch order and split, each rollout server's engine (seed + server index)
    sft_warmup_steps: Count = 12  # cold-start SFT steps on the task's traces before GRPO (0: none; batch size and lr from sft)
    fresh_rl_optimizer: bool = True  # GRPO starts from a fresh AdamW state after the warm-up (false: keep SFT's moments)
    save_every: Count = 0  # write a resumable checkpoint every this many GRPO steps (0: only at the end)
    save_final: bool = True  # write a resumable checkpoint and an HF export at the end of the run
    keep_checkpoints: Count = 0  # after each save, delete all but the newest this many checkpoints (0: keep all)
    checkpoint_dir: str = ""  # where checkpoints go: "" is RUN_DIR/checkpoints; else a path every node mounts, or an fsspec URI (s3://bucket/path; its fsspec package on every node), under which each run writes <run name>/step_N
    max_skipped_steps: Positive = 3  # GRPO steps in a row whose update is skipped (a non-finite reward, advantage, loss or gradient norm: each step says so, naming the rows) before the run stops in one line
    max_failures: Count = 3  # a trainer worker whose process dies or hangs: the whole actor graph is rebuilt and restored from the last checkpoint (none yet: the run starts over) this many times; then the run stops
    weight_sync_bucket_mb: Positive = 64  # size of one ZMQ weight bucket (larger tensors are split)
    weight_sync_in_place: bool = True  # servers on the trainer's node read its staging buffers in place (CUDA IPC, shared memory) instead of TCP
    weight_sync_backend: Literal["auto", "zmq", "collective"] = "auto"  # how weight buckets travel: zmq (TCP relay chain, in place on one node) or collective (a broadcast in a process group of the trainer's sending rank and every rollout worker: NCCL on GPUs, HCCL on NPUs, gloo on CPUs); auto: collective where the trainer runs on accelerators and this torch has their backend, else zmq
    weight_sync_timeout_s: PositiveNumber = 300.0  # deadline of each wait of a weight sync (a bucket, an ack, a group's join): a server that misses it is named and ejected, the run goes on


class SFTConfig(_Section):
    train_files: list[str] = msgspec.field(default_factory=list)  # `raytool sft`: conversations (jsonl/parquet, messages + tools)
    val_files: list[str] = msgspec.field(default_factory=list)  # validation conversations (none: val_fraction of the train files)
    val_fraction: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0  # share of the train conversations held out for validation loss when val_files is empty
    epochs: Positive = 1  # passes over the SFT data
    batch_size: Positive = 8  # conversations per optimizer step (also the in-run warm-up's batch)
    lr: PositiveNumber = 1e-4  # peak learning rate (also the in-run warm-up's)
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after the warm-up
    warmup_steps: Count = 0  # linear learning-rate warm-up of `raytool sft`
    max_length: Positive = 4096  # tokens per conversation; longer ones are cut (and counted)
    val_every: Count = 0  # validation loss every this many steps (0: after each epoch)
    save_every: Count = 0  # resumable checkpoint every this many steps (0: only at the end)


class AsyncConfig(_Section):
    """Asynchronous training: rollout runs on while the trainer updates (0: the synchronous loop)."""

    max_staleness: Count = 0  # policy versions a trained token may lag the trainer by; groups running or buffered ahead stay within (max_staleness + 1) steps (0: synchronous)
    partial_rollout: Literal["continue", "abort", "wait"] = "continue"  # requests in flight at a weight load: frozen and continued on the new weights (vLLM pause keep), aborted and resumed from their tokens on the new weights, or finished on the old weights first


class LoggingConfig(_Section):
    logger: list[Literal["console", "tensorboard", "wandb"]] = msgspec.field(default_factory=lambda: ["console", "tensorboard"])  # trackers besides metrics.jsonl (always written), as verl's trainer.logger: a line per step on stderr, event files in RUN_DIR/tensorboard, Weights & Biases in RUN_DIR/wandb (online with WANDB_API_KEY set, else offline)
    project_name: str = "raytool"  # wandb: the W&B project
    experiment_name: str | None = None  # wandb: the W&B run name (None: the run directory's name)
    trace_samples: Count = 2  # full trajectories written to traces.jsonl each step
    val_trace_samples: Count = 2  # validation trajectories per data source written to val_traces.jsonl at each validation (0: none)
    progress: bool = True  # progress bar while rolling out
    console_level: Literal["raytool", "all"] = "raytool"  # raytool: the console shows raytool's own lines (banner, progress, a line per step, validation, the end summary) and every error, the rest goes to RUN_DIR/run.log and Ray's per-actor logs; all: every program's lines as they come (`-v`)


class ClusterConfig(_Section):
    address: str | None = None  # Ray address; None: RAY_ADDRESS if set, else a new local instance
    torch_threads: Count = 0  # intra-op threads of engine and trainer actors (0: on an accelerator the Ray CPUs the actor reserves, on a CPU every core)
    light_actor_cpus: NonNegative = 0.0  # Ray CPUs of manager, agent, sandbox and reward actors
    accelerator: Literal["GPU", "NPU"] = "GPU"  # the Ray resource rollout.num_gpus / trainer.num_gpus count (NPU: Ascend nodes started with --resources '{"NPU": 8}')
    env_vars: dict[str, str] = msgspec.field(default_factory=dict)  # environment of every actor, e.g. HCCL_* or NCCL_* settings of your network
    namespace: str | None = None  # Ray namespace of the run's actors (None: raytool-<run directory name>-<6 random hex digits>)
    wait_for_resources_s: NonNegative = 0.0  # an autoscaling cluster: wait this long for nodes before a missing resource is an error (0: fail at once)
    placement_timeout_s: PositiveNumber = 600.0  # the trainer's placement group not placed by then is an error naming what it waits for
    max_actor_restarts: Restarts = 10  # Ray restarts of the LLM manager, an agent worker, reward worker or sandbox pool whose process died (-1: no limit); their work is retried
    heartbeat_s: NonNegative = 30.0  # the driver pings every actor of the run (trainer ranks included) this often; one alive but silent for a whole interval (hung, stopped) is killed and restarted (a trainer rank: the group re-forms): found within twice this (0: off)
    nodes: Positive | None = None  # `raytool plan`: nodes of the cluster this run is for (None: 1; --nodes overrides)
    gpus_per_node: Count | None = None  # `raytool plan`: accelerators (cluster.accelerator) per node, 0 for CPU nodes (None: this machine's; --gpus-per-node overrides)
    gpu_memory_gb: PositiveNumber | None = None  # `raytool plan`: memory of one accelerator, GiB (None: this machine's; --gpu-memory-gb overrides)
    host_memory_gb: PositiveNumber | None = None  # `raytool plan`: host memory of one node, GiB (None: this machine's; --host-memory-gb overrides)
    link_gbit: PositiveNumber | None = None  # `raytool plan`: bandwidth between nodes, Gbit/s, for the predicted weight-sync time of each backend (None: 100, one NIC of a common GPU cluster; --link-gbit overrides)


class DistillConfig(_Section):
    """On-policy distillation: a teacher scores every token the student samples (docs/distillation.md)."""

    teacher: str | None = None  # the teacher model (a hub name, a local path or a bundled name), served by its own rollout servers with rollout.engine and never weight-synced; or the URL of an OpenAI-compatible API that returns prompt log-probs (vLLM's server: http://host:8000/v1); each trained token's advantage is -(log p_student - log p_teacher) (None: off)
    teacher_model: str | None = None  # a teacher URL: the model name to ask it for (None: the one model its /models lists)
    api_key_env: str = "OPENAI_API_KEY"  # a teacher URL: the environment variable holding its API key (never the key itself; unset: no key)
    timeout_s: PositiveNumber = 300.0  # a teacher URL: one scoring call (one prefill of a whole trajectory, queued behind others on a busy server)
    retries: Count = 2  # a teacher URL: a call that failed to connect, timed out or was answered 408/429/5xx is tried again this many times, backing off (honouring Retry-After); then the trajectory is infra-failed and its group rolled out again
    num_servers: Positive = 1  # the teacher's rollout servers
    num_gpus: NonNegative | None = None  # accelerators each teacher server reserves (None: rollout.num_gpus); a teacher larger than the student wants more
    tensor_parallel_size: Positive | None = None  # the teacher's vLLM tensor parallelism (None: rollout.tensor_parallel_size)
    kl_coef: NonNegative = 1.0  # weight of the per-token reverse KL in the advantage
    reward_weight: NonNegative = 0.0  # weight of the task reward's (GRPO) advantage added to it (0: the teacher alone teaches)

    @property
    def url(self) -> str | None:
        """The teacher's API when distill.teacher is a URL (no teacher servers of raytool's own), else None."""
        return self.teacher if self.teacher and self.teacher.startswith(("http://", "https://")) else None

    @property
    def has_servers(self) -> bool:
        """Whether the run starts teacher servers of its own (a teacher model, not a URL)."""
        return bool(self.teacher) and self.url is None


class RunConfig(_Section):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    sandbox: SandboxConfig = msgspec.field(default_factory=SandboxConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    sft: SFTConfig = msgspec.field(default_factory=SFTConfig)
    async_: AsyncConfig = msgspec.field(default_factory=AsyncConfig, name="async")
    distill: DistillConfig = msgspec.field(default_factory=DistillConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)


def _allowed_values(key: str) -> str | None:
    """What a key with named choices takes, for error messages: "one of [...]" for a Literal-typed
    key such as 'agent.format', "'auto' or an int" for a choice or another type."""
    node: Any = RunConfig
    for part in re.sub(r"\[\d+\]", "", key).split("."):  # 'logging.logger[1]': an item of a list of choices
        hints = typing.get_type_hints(node) if isinstance(node, type) else {}
        if isinstance(node, type) and issubclass(node, msgspec.Struct):  # keys by their YAML name ('async' is field async_)
            part = next((f.name for f in msgspec.structs.fields(node) if f.encode_name == part), part)
        if part not in hints:
            return None
        node = hints[part]
    if typing.get_origin(node) is list:
        (node,) = typing.get_args(node)
    if typing.get_origin(node) is Literal:
        return f"one of {list(typing.get_args(node))}"
    if typing.get_origin(node) in (typing.Union, types.UnionType):  # e.g. int | Literal["auto"]: "'auto' or an int"
        args = typing.get_args(node)
        choices = [repr(v) for arg in args if typing.get_origin(arg) is Literal for v in typing.get_args(arg)]
        kinds = [{"int": "an int", "bool": "true/false", "float": "a number"}.get(arg.__name__, arg.__name__)
                 for arg in args if isinstance(arg, type) and arg is not type(None)]
        return " or ".join([", ".join(choices)] + kinds) if choices else None
    return None


def _did_you_mean(section: str, field: str) -> str:
    """' (did you mean 'trainer.total_steps'?)' for a mistyped key of `section` ('' : a section), or ''."""
    from raytool.errors import did_you_mean

    node: Any = RunConfig
    for part in section.split(".") if section else []:
        hints = typing.get_type_hints(node)
        part = next((f.name for f in msgspec.structs.fields(node) if f.encode_name == part), part)
        node = hints.get(part)
        if not (isinstance(node, type) and issubclass(node, msgspec.Struct)):
            return ""
    return did_you_mean(field, [f.encode_name for f in msgspec.structs.fields(node)], f"{section}." if section else "")


def _error_from_msgspec(err: msgspec.ValidationError, source: str, raw: dict | None = None) -> ConfigError:
    # msgspec says e.g. "Expected `int`, got `str` - at `$.trainer.total_steps`" (no "at" at the root),
    # or for a value out of its declared range "Expected `int` >= 1 - at `$.rollout.n`".
    msg, sep, where = str(err).rpartition(" - at `")
    if not sep:
        msg, where = str(err), "$`"
    key = where.rstrip("`").removeprefix("$").lstrip(".")
    if msg.startswith("Object contains unknown field"):
        field = msg.split("`")[1]
        return ConfigError(f"{source}: unknown config key '{f'{key}.{field}' if key else field}'{_did_you_mean(key, field)}")
    if re.match(r"Expected `\w+` [<>]=? ", msg):  # the right type, out of range: say what was given
        value: Any = raw
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return ConfigError(f"{source}: config key '{key}': {msg[0].lower()}{msg[1:]}, got {value!r}")
    allowed = _allowed_values(key)
    if allowed is not None:
        msg += f"; expected {allowed}"
    return ConfigError(f"{source}: config key '{key or '<root>'}': {msg[0].lower()}{msg[1:]}")


def parse_override(item: str) -> tuple[list[str], Any]:
    """`trainer.total_steps=3` -> (["trainer", "total_steps"], 3); the value is a YAML scalar."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}': expected section.key=value")
    try:
        value = _yaml_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{item}': value is not valid YAML ({exc.problem})") from None
    return key.split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{'.'.join(path[: i + 1])}' is not a section")
            node = child
        node[path[-1]] = value
    return raw


def from_dict(raw: dict, source: str = "config") -> RunConfig:
    try:
        return msgspec.convert(raw, RunConfig)
    except msgspec.ValidationError as err:
        raise _error_from_msgspec(err, source, raw) from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config (None: the embedded default) and apply dotted overrides."""
    raw: dict = {}
    source = "default config"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
        try:
            raw = _yaml_load(text) or {}
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections, got {type(raw).__name__}")
    try:
        given = {item.partition("=")[0] for item in overrides}
        cfg = _checked(apply_overrides(copy.deepcopy(raw), list(overrides)), source, given)
    except ConfigError as exc:
        if not overrides or not _valid(raw, source):
            raise
        # The file (or the embedded default) is fine alone: the command line's overrides are at fault.
        raise ConfigError(str(exc).replace(f"{source}: ", "command line: ", 1)) from None
    return cfg


def _checked(raw: dict, source: str, given: set[str] = frozenset()) -> RunConfig:
    """The config `raw` describes (verl's keys read as raytool's; `given`: the keys the command
    line set, whose verl keys override the file's), its keys, types, ranges and cross-key rules checked."""
    from raytool.verl_keys import VerlKeyError, translate

    try:
        raw = translate(raw, given, config_keys())
    except VerlKeyError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _turns_follow_the_budget(raw)
    cfg = from_dict(raw, source)  # keys, types and ranges
    validate_rules(cfg, source)
    return cfg


def _turns_follow_the_budget(raw: dict) -> None:
    """A config that sets the response budget (agent.max_response_tokens) and not the per-turn
    limit lets one turn use all of it, as verl does (its data.max_response_length is the only limit)."""
    budget = (raw.get("agent") or {}).get("max_response_tokens") if isinstance(raw.get("agent"), dict) else None
    rollout = raw.get("rollout")
    if budget is None or (isinstance(rollout, dict) and "max_tokens_per_turn" in rollout) or (rollout is not None and not isinstance(rollout, dict)):
        return
    raw.setdefault("rollout", {})["max_tokens_per_turn"] = budget
    log.info("rollout.max_tokens_per_turn follows agent.max_response_tokens (%s): set it to limit one turn", budget)


@functools.cache
def config_keys() -> frozenset[str]:
    """Every dotted key of RunConfig (a dict-valued key counts as one): what verl's keys are told apart from."""
    keys: set[str] = set()

    def walk(struct, prefix: str) -> None:
        for f in struct.fields:
            if isinstance(f.type, msgspec.inspect.StructType):
                walk(f.type, f"{prefix}{f.encode_name}.")
            else:
                keys.add(f"{prefix}{f.encode_name}")

    walk(msgspec.inspect.type_info(RunConfig), "")
    return frozenset(keys)


def _valid(raw: dict, source: str) -> bool:
    try:
        _checked(copy.deepcopy(raw), source)
        return True
    except ConfigError:
        return False


def validate(cfg: RunConfig, source: str = "config") -> None:
    """The declared ranges (for a config built in Python: msgspec checks them only when it decodes),
    and the rules across keys that types alone cannot express."""
    builtins = msgspec.to_builtins(cfg)
    try:
        msgspec.convert(builtins, RunConfig)
    except msgspec.ValidationError as err:
        raise _error_from_msgspec(err, source, builtins) from None
    validate_rules(cfg, source)


def validate_rules(cfg: RunConfig, source: str = "config") -> None:
    """The rules across keys that types alone cannot express (a decoded config's ranges are checked)."""
    if cfg.rollout.request_timeout_s is not None:
        log.warning("%s: config key 'rollout.request_timeout_s' is deprecated and ignored: a server is ejected when it stops "
                    "making progress (rollout.stall_timeout_s=%g), not when a request is long", source, cfg.rollout.stall_timeout_s)
    if cfg.agent.observation_style == "in_turn" and cfg.agent.format != "retool":
        raise ConfigError(f"{source}: config key 'agent.observation_style': in_turn needs agent.format=retool (hermes observations are tool messages)")
    r = cfg.rollout
    if r.engine == "vllm" and r.tensor_parallel_size > 1 and not r.num_gpus:
        raise ConfigError(f"{source}: config keys 'rollout.tensor_parallel_size' ({r.tensor_parallel_size}) and 'rollout.num_gpus' (0): "
                          "a server sharded over accelerators needs them: set rollout.num_gpus to the tensor-parallel size")
    if cfg.trainer.cpu_offload and not cfg.trainer.num_gpus:
        raise ConfigError(f"{source}: config key 'trainer.cpu_offload': offloading moves accelerator memory to the host; give the trainer GPUs (trainer.num_gpus) or set it false")
    validate_4bit(cfg, source)
    if cfg.trainer.compile is True:
        why = ("inductor has no NPU backend: set it false on cluster.accelerator NPU" if cfg.cluster.accelerator == "NPU" and cfg.trainer.num_gpus else
               "with sequence parallelism (its attention's all-to-all) is not supported yet: set it false or trainer.sequence_parallel_size=1"
               if cfg.trainer.sequence_parallel_size > 1 else
               "with a 4-bit base (bitsandbytes kernels) is not supported: set it false" if cfg.trainer.load_in_4bit else "")
        if why:
            raise ConfigError(f"{source}: config key 'trainer.compile' {why}")
    if cfg.trainer.kernels is True:
        why = ("Liger-Kernel's kernels are Triton kernels for CUDA GPUs, not NPUs: set it false or auto" if cfg.cluster.accelerator == "NPU" and cfg.trainer.num_gpus else
               "needs CUDA GPUs (Liger-Kernel's Triton kernels), but the trainer runs on CPUs: give it GPUs (trainer.num_gpus) or set it false or auto"
               if not cfg.trainer.num_gpus else "")
        if why:
            raise ConfigError(f"{source}: config key 'trainer.kernels' {why}")
    validate_router_replay(cfg, source)
    if cfg.trainer.lora_rank and cfg.trainer.num_workers > 1:
        raise ConfigError(f"{source}: config key 'trainer.lora_rank': LoRA runs on one trainer worker (trainer.num_workers=1), got {cfg.trainer.num_workers} workers")
    if cfg.data.task == "files" and not cfg.data.train_files:
        raise ConfigError(f"{source}: config key 'data.train_files': data.task=files needs prompt files (raytool preprocess writes them)")
    if cfg.data.task == "tool_arith" and (cfg.data.train_files or cfg.data.val_files):
        raise ConfigError(f"{source}: config key 'data.task': tool_arith generates its prompts, but data.train_files/val_files name files; "
                          "set data.task=auto (or files) to train on the files, or drop the files")
    if cfg.data.task == "verifiers" and not cfg.agent.environment:
        raise ConfigError(f"{source}: config key 'agent.environment': data.task=verifiers takes its prompts from a verifiers environment: name it "
                          "(an installed environment's id, or 'package.module:load_environment')")
    if cfg.data.task == "verifiers" and (cfg.data.train_files or cfg.data.val_files):
        raise ConfigError(f"{source}: config key 'data.task': verifiers takes its prompts from the environment's datasets, but data.train_files/val_files name files; "
                          "set data.task=files (rows with agent_name verifiers are mapped onto the environment), or drop the files")
    if cfg.data.val_files and not cfg.data.train_files:
        raise ConfigError(f"{source}: config key 'data.val_files': validation files without data.train_files would validate on "
                          "files while training on the generated task; give data.train_files too")
    sp = cfg.trainer.sequence_parallel_size
    if cfg.trainer.num_workers % sp:
        raise ConfigError(f"{source}: config key 'trainer.sequence_parallel_size' is {sp}: it must divide trainer.num_workers "
                          f"({cfg.trainer.num_workers}), each group of {sp} workers sharing its sequences")
    if sp > 1 and cfg.model.attn_implementation.startswith("flash_attention"):
        raise ConfigError(f"{source}: config key 'trainer.sequence_parallel_size' > 1 runs attention in PyTorch SDPA; model.attn_implementation "
                          f"{cfg.model.attn_implementation} with sequence parallelism is not supported yet: set model.attn_implementation=sdpa")
    if cfg.trainer.prefix_sharing is True and (why := no_prefix_sharing(cfg)):
        raise ConfigError(f"{source}: config key 'trainer.prefix_sharing' is true, but {why}: set it auto or false")
    validate_async(cfg, source)
    validate_sandbox_lifetime(cfg, source)
    validate_distill(cfg.distill, source)
    if cfg.cluster.env_vars.get("VLLM_ASCEND_ENABLE_NZ", "0") != "0":
        raise ConfigError(f"{source}: config key 'cluster.env_vars': VLLM_ASCEND_ENABLE_NZ={cfg.cluster.env_vars['VLLM_ASCEND_ENABLE_NZ']} lets "
                          "vllm-ascend hold weights in the FRACTAL_NZ layout, which raytool's weight syncs do not write; leave it out (raytool sets 0)")
    s = cfg.sandbox
    if s.added_latency_median_s > 0 and s.added_latency_p95_s < s.added_latency_median_s:
        raise ConfigError(f"{source}: config key 'sandbox.added_latency_p95_s': expected a 95th percentile >= the median, "
                          f"got {s.added_latency_median_s} and {s.added_latency_p95_s}")
    r = cfg.reward
    if r.wrong_score_cap >= 1.0:
        raise ConfigError(f"{source}: config key 'reward.wrong_score_cap': must be < 1 (a correct answer's score) so a wrong answer never scores as high, got {r.wrong_score_cap}")
    if r.overlong_buffer_tokens >= cfg.agent.max_response_tokens:
        raise ConfigError(f"{source}: config key 'reward.overlong_buffer_tokens': must be below agent.max_response_tokens "
                          f"({cfg.agent.max_response_tokens}), got {r.overlong_buffer_tokens}")


def validate_distill(d: DistillConfig, source: str) -> None:
    """Keys that size raytool's own teacher servers mean nothing beside a teacher URL, and the URL's
    keys nothing beside a teacher model: either named with the other is refused."""
    if d.url is not None:
        sized = [k for k in ("num_gpus", "tensor_parallel_size") if getattr(d, k) is not None] + (["num_servers"] if d.num_servers != 1 else [])
        if sized:
            raise ConfigError(f"{source}: config key 'distill.{sized[0]}' sizes raytool's own teacher servers, but distill.teacher is a URL "
                              f"({d.url}), whose server you run yourself: drop distill.{sized[0]}, or name a teacher model")
    elif d.teacher_model is not None:
        raise ConfigError(f"{source}: config key 'distill.teacher_model' names the model of a teacher URL, but distill.teacher is "
                          f"{d.teacher!r}, not a URL (http://host:port/v1)")


# Why r3 cannot run on vLLM without GPUs (measured with vLLM 0.32); the config rule and the engine say it alike.
VLLM_CPU_NO_ROUTES = "vLLM's CPU build cannot return routed experts (its capture needs Model Runner V2, which needs Triton)"


def validate_router_replay(cfg: RunConfig, source: str) -> None:
    """trainer.router_replay's rules across keys (a dense model is refused where the trainer loads it)."""
    t, r = cfg.trainer, cfg.rollout
    if t.router_replay == "off":
        return
    why = ("replays the routing of whole sequences; with sequence parallelism each worker sees a slice: set trainer.sequence_parallel_size=1"
           if t.sequence_parallel_size > 1 else
           "replays eager routers; torch.compile'd layers would recompile for every batch: set trainer.compile false or auto" if t.compile is True else
           "is r3, but the scripted engine runs no model and routes nothing: use rollout.engine=hf or vllm" if t.router_replay == "r3" and r.engine == "scripted" else
           f"is r3, but {VLLM_CPU_NO_ROUTES}: give the rollout servers GPUs (rollout.num_gpus), use rollout.engine=hf, "
           "or set trainer.router_replay=r2"
           if t.router_replay == "r3" and r.engine == "vllm" and not r.num_gpus else "")
    if why:
        raise ConfigError(f"{source}: config key 'trainer.router_replay' {why}")


def validate_sandbox_lifetime(cfg: RunConfig, source: str = "config") -> None:
    """An E2B sandbox lives e2b_sandbox_timeout_s from its creation, one per trajectory: one that
    dies before its trajectory's wall-clock limit loses the interpreter's state mid-trajectory."""
    s, limit = cfg.sandbox, cfg.agent.max_trajectory_s
    if s.backend == "e2b" and s.e2b_sandbox_timeout_s < limit:
        raise ConfigError(f"{source}: config key 'sandbox.e2b_sandbox_timeout_s' is {s.e2b_sandbox_timeout_s} s, shorter than a trajectory may run "
                          f"(agent.max_trajectory_s={limit:g}): longer trajectories would lose their sandbox's state; raise it to at least "
                          f"{math.ceil(limit)} or lower agent.max_trajectory_s")


def prompt_source(data: DataConfig, environment: str | None = None) -> Literal["tool_arith", "files", "verifiers"]:
    """Where the run's prompts come from: data.task, with auto deciding by whether files are named,
    then whether a verifiers environment is (agent.environment)."""
    if data.task == "auto":
        return "files" if data.train_files else "verifiers" if environment else "tool_arith"
    return data.task


def validate_4bit(cfg: RunConfig, source: str) -> None:
    t = cfg.trainer
    if not t.load_in_4bit:
        return
    why = ("trains LoRA adapters on a quantized base: set trainer.lora_rank" if not t.lora_rank else
           "needs a CUDA GPU (bitsandbytes NF4): give the trainer GPUs (trainer.num_gpus)" if not t.num_gpus else
           "needs CUDA GPUs (bitsandbytes NF4), not cluster.accelerator NPU" if cfg.cluster.accelerator == "NPU" else
           "keeps the 4-bit base on the GPU: set trainer.cpu_offload false" if t.cpu_offload else "")
    if why:
        raise ConfigError(f"{source}: config key 'trainer.load_in_4bit' {why}, or set it false")


def no_prefix_sharing(cfg: RunConfig) -> str:
    """Why the trainer cannot train shared prefixes as trees under `cfg` ("": it can)."""
    t, attention = cfg.trainer, cfg.model.attn_implementation
    if t.packing is True or attention.startswith("flash_attention"):
        return f"packed sequences (trainer.packing, model.attn_implementation {attention}) run a varlen kernel, which takes no tree mask"
    if attention not in ("sdpa", "eager"):
        return f"model.attn_implementation {attention} takes no tree mask (sdpa and eager do)"
    if t.sequence_parallel_size > 1:
        return "sequence parallelism (trainer.sequence_parallel_size > 1) splits sequences, not trees"
    if t.router_replay != "off":
        return f"trainer.router_replay={t.router_replay} replays routes per sequence position"
    return ""


def validate_async(cfg: RunConfig, source: str = "config") -> None:
    """Asynchronous training and off-policy correction: what the engine and the trainer can honour."""
    a = cfg.async_
    if a.max_staleness > 0 and cfg.rollout.engine == "hf" and a.partial_rollout != "wait":
        raise ConfigError(f"{source}: config key 'async.partial_rollout': {a.partial_rollout} needs an engine that pauses mid-sequence (rollout.engine=vllm); "
                          "the hf engine finishes each batch on the weights it started with: use wait")
    if a.max_staleness > 0 and (cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0):
        key = "rollout.top_p" if cfg.rollout.top_p < 1.0 else "rollout.top_k"
        raise ConfigError(f"{source}: config key '{key}': in asynchronous mode the engine's log-probs are compared with the trainer's, which "
                          "does not truncate the distribution; train with top_p=1 and top_k=-1 (validation may still use eval.top_p)")


def sandbox_backend_options(s: SandboxConfig) -> dict:
    """The constructor arguments of the configured sandbox backend (`raytool.sandbox.make_backend`)."""
    if s.backend == "local":
        return {"max_output_bytes": s.max_output_bytes, "isolate": s.isolate, "warm_sessions": s.warm_sessions, "idle_session_s": s.idle_session_s,
                "max_processes": s.max_processes, "disk_mb": s.disk_mb, "memory_mb": s.memory_mb}
    if s.backend == "sandbox_fusion":
        return {"url": s.fusion_url, "max_output_bytes": s.max_output_bytes, "sessions": s.fusion_sessions}
    return {"domain": s.e2b_domain, "api_key_env": s.e2b_api_key_env, "template": s.e2b_template, "sandbox_timeout_s": s.e2b_sandbox_timeout_s,
            "request_timeout_s": s.e2b_request_timeout_s, "max_output_bytes": s.max_output_bytes}


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)


# What a checkpoint's weights and optimizer state are of: a resume that changes one of these would
# load them into a different model or train them under a different objective.
RESUME_FIXED = ("model.path", "trainer.lora_rank", "algorithm.adv_estimator", "algorithm.policy_loss")


def check_resume(saved_yaml: str, cfg: RunConfig, saved_source: str) -> None:
    """Refuse a resumed run whose config changes what its checkpoint holds (RESUME_FIXED), naming
    the key; every other key may change on resume (steps, learning rate, logging, ...)."""
    saved = _yaml_load(saved_yaml) or {}
    new, defaults = msgspec.to_builtins(cfg), msgspec.to_builtins(RunConfig())
    for key in RESUME_FIXED:
        section, name = key.split(".")
        before = saved.get(section, {}).get(name, defaults[section][name])
        after = new[section][name]
        if before != after:
            raise ConfigError(f"config key '{key}': the checkpoint was trained with {before!r} ({saved_source}), this config says {after!r}; "
                              f"a resume keeps the model and the algorithm (start a new run to change them)")
