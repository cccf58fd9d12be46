"""`raytool bench trainer`: tokens/s of raytool's RL step against a plain HF loop on the same batch.

The plain loop is what a first GRPO implementation looks like: pad each micro-batch, run the HF
model with its attention mask, log-softmax over the full fp32 logits, PPO-clip token mean,
backward, AdamW. Both see the same trajectories, the same micro-batches and the same model, in
the same process, alternating (A B A B ...) so that a noisy machine hits both alike. The RL step
is also timed with trainer.compile on and off (`compile_vs_eager`). On a GPU (model.path: e.g. a
1.5B checkpoint) MFU, peak memory and the host's CPU time per step are reported too. The plain
loop's micro-batches are at most 4,096 tokens (its full fp32 logits); where it still runs out of
memory it is reported as not measured, and raytool's figures stand.
"""

from __future__ import annotations

import logging
import random
import time

import torch

from raytool.config import RunConfig
from raytool.types import TrainBatch

log = logging.getLogger(__name__)

# Dense bf16 peak of the accelerators MFU is reported against (TFLOP/s).
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
# The plain loop's largest micro-batch, for its full fp32 logits (2.3 GiB a copy at 4k tokens of a
# 152k vocabulary) next to raytool's trainer on one 80 GB GPU: at 16k, a budget that fitted the
# warm-up ran out of memory in the timed steps (issue 38).
_PLAIN_MICRO_BATCH_TOKENS = 4096


def _batch(vocab: int, n: int, prompt: int, response: tuple[int, int], seed: int = 0):
    from raytool.agent.ledger import TokenLedger
    from raytool.types import TokenOutput

    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 4 == 0:  # a GRPO group's samples share its prompt
            p = [rng.randrange(3, vocab) for _ in range(prompt)]
        r = [rng.randrange(3, vocab) for _ in range(rng.randint(*response))]
        ledger = TokenLedger(p)
        ledger.generated(TokenOutput(r, [-1.0] * len(r), "stop"))
        out.append(ledger.trajectory(str(i), str(i // 4), [], "", reward=float(rng.random() < 0.5)))
    return out


def _plain_step(model, optimizer, trajectories, groups, device, lr: float) -> None:
    """A straightforward HF training step over the same micro-batches."""
    from raytool.algos import get_adv_estimator
    from raytool.training.batching import pad_right

    rewards = torch.tensor([t.reward for t in trajectories])
    adv = get_adv_estimator("grpo")(rewards, [t.group_id for t in trajectories])
    n_tokens = sum(len(t.response_ids) for t in trajectories)
    for group in groups:
        seqs = [trajectories[i] for i in group]
        ids = pad_right([t.prompt_ids + t.response_ids for t in seqs], 0).to(device)
        attention = pad_right([[1] * (len(t.prompt_ids) + len(t.response_ids)) for t in seqs], 0).to(device)
        mask = pad_right([[0] * (len(t.prompt_ids) - 1) + t.response_mask for t in seqs], 0, torch.float32).to(device)[:, : ids.size(1) - 1]
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        a = adv[torch.tensor(group)].to(device)[:, None]
        ratio = torch.exp(logp - logp.detach())
        loss = -(torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a) * mask).sum() / n_tokens
        loss.backward()
    for g in optimizer.param_groups:
        g["lr"] = lr
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _seconds(fn, cuda: bool) -> float:
    """How long `fn()` takes, the GPU's queued work included."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


class _PlainLoop:
    """The plain HF loop's model and optimizer (fp32 weights, autocast to the trainer's dtype)."""

    def __init__(self, cfg: RunConfig, model_path: str, device: str, dtype: torch.dtype, trajectories: list):
        from transformers import AutoModelForCausalLM

        self.cfg, self.device, self.dtype, self.trajectories = cfg, device, dtype, trajectories
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=cfg.model.attn_implementation).to(device)
        self.model.config.use_cache = False
        if cfg.trainer.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.trainer.lr)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]

    def run(self, budget: int) -> None:
        """One step at micro-batches of at most `budget` tokens."""
        from raytool.training.batching import micro_batches

        with torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype != torch.float32):
            _plain_step(self.model, self.optimizer, self.trajectories, micro_batches(self.lengths, budget), self.device, self.cfg.trainer.lr)

    def reset(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.device == "cuda":
            torch.cuda.empty_cache()


def bench(cfg: RunConfig, repeats: int = 3) -> tuple[str, dict]:
    from raytool.models import resolve_model
    from raytool.training import Trainer
    from raytool.training.batching import micro_batches

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model_path = resolve_model(cfg.model.path)
    trainer = Trainer(cfg, model_path, device=device)
    cfg = trainer.cfg  # "auto" settings decided for this device
    vocab = trainer.lm.config.vocab_size
    # ReTool-like shapes: a short prompt, long multi-turn responses, GRPO groups of 4.
    n, prompt, response = (64, 256, (1024, 4096)) if cuda else (8, 96, (64, 320))
    trajectories = _batch(vocab, n, prompt, response)
    batch = TrainBatch.whole(trajectories)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    groups = micro_batches(lengths, cfg.trainer.micro_batch_tokens)

    def timed(fn) -> float:
        return _seconds(fn, cuda)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timed(lambda: trainer.rl_step(batch))  # warm-up (allocator, kernels, thread pools; compiles where on), before the plain loop's model exists
    trainer_peak = torch.cuda.max_memory_allocated() if cuda else None

    plain = _PlainLoop(cfg, model_path, device, trainer.dtype, trajectories)
    run_plain, reset_plain, params = plain.run, plain.reset, plain.params

    plain_budget = min(cfg.trainer.micro_batch_tokens, _PLAIN_MICRO_BATCH_TOKENS)
    try:
        plain_budget = largest_that_fits(lambda budget: timed(lambda: run_plain(budget)), plain_budget, reset_plain)
        plain_fits = True
    except torch.OutOfMemoryError:  # even at the floor; largest_that_fits has reset it
        plain_fits = False
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ours, theirs, host = [], [], []
    for _ in range(repeats):
        thread_start = time.thread_time()
        ours.append(timed(lambda: trainer.rl_step(batch)))
        host.append(time.thread_time() - thread_start)
        if plain_fits:
            try:
                theirs.append(timed(lambda: run_plain(plain_budget)))
            except torch.OutOfMemoryError:
                plain_fits, theirs = False, []
                reset_plain()
    ours_s = min(ours)
    plain_s = min(theirs) if plain_fits else None
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    rows = [f"{'':18} {'s/step':>8} {'tokens/s':>10}",
            f"{'raytool RL step':18} {ours_s:8.3f} {tokens / ours_s:10.0f}",
            f"{'plain HF loop':18} {plain_s:8.3f} {tokens / plain_s:10.0f}" if plain_fits else
            f"plain HF loop: not measured, out of memory at {plain_budget}-token micro-batches"]
    # Logged before the compile comparison, so that a run cut off there still shows the step's figures.
    log.info("the RL step and the plain loop:\n%s", "\n".join(rows))
    dtype_result, dtype_rows = ({}, []) if cuda else _bf16_vs_fp32(cfg, model_path, trainer, batch, timed, repeats)
    compile_result, compile_rows = _compile_vs_eager(trainer, batch, tokens, timed, repeats)
    sharing_result, sharing_rows = _sharing_vs_unshared(trainer, batch, timed, repeats)
    result = {
        "tokens_per_step": tokens,
        "trainer_tokens_per_s": tokens / ours_s,
        "plain_tokens_per_s": tokens / plain_s if plain_fits else None,
        "trainer_vs_plain": plain_s / ours_s if plain_fits else None,
        "compute_dtype": str(trainer.dtype).removeprefix("torch."),
        "micro_batch_tokens": cfg.trainer.micro_batch_tokens,
        "plain_micro_batch_tokens": plain_budget,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "micro_batches_per_step": len(groups),
        "compile": cfg.trainer.compile,
        "kernels": cfg.trainer.kernels,
        **dtype_result,
        **compile_result,
        **sharing_result,
    }
    if cuda:
        result.update(_gpu_figures(cfg, model_path, result, params, tokens, ours_s, peak_mem, trainer_peak, min(host), len(groups)))
    return _table(cfg, n, tokens, ours_s, result, rows + dtype_rows + compile_rows + sharing_rows, plain_fits, plain_budget, cuda), result



def _gpu_figures(cfg: RunConfig, model_path: str, result: dict, params: int, tokens: int, step_s: float, peak_mem: float,
                 trainer_peak: float, host_s: float, micro_batches: int) -> dict:
    """On a GPU: MFU (of the step, compiled and eager), peak memory against the planner's, and the
    main thread's CPU time per step: the host's share (launches, Python, FSDP's bookkeeping), which
    bounds the step when it exceeds the GPU's time."""
    out = {"peak_mem_gib": peak_mem, "host_cpu_s_per_step": host_s, "host_ms_per_micro_batch": 1e3 * host_s / micro_batches}
    peak = next((v for k, v in _PEAK_TFLOPS.items() if k in result["device"]), None)
    if peak:
        out["mfu"] = 6 * params * tokens / step_s / (peak * 1e12)
        out["mfu_compiled"] = 6 * params * result["compiled_tokens_per_s"] / (peak * 1e12)
        out["mfu_eager"] = 6 * params * result["eager_tokens_per_s"] / (peak * 1e12)
    return out | _planned_peak(cfg, model_path, trainer_peak)


def _table(cfg: RunConfig, n: int, tokens: int, ours_s: float, result: dict, rows: list[str], plain_fits: bool, plain_budget: int, cuda: bool) -> str:
    """The bench's table: its timed rows, then the ratios and, on a GPU, MFU, memory and host time."""
    plain_note = ([f"the plain loop ran {plain_budget}-token micro-batches (its full fp32 logits)"]
                  if plain_fits and plain_budget != cfg.trainer.micro_batch_tokens else [])
    timed, extra = rows[:3], rows[3:]
    return "\n".join(
        [f"trainer bench: {n} trajectories, {tokens} tokens, micro-batches of {cfg.trainer.micro_batch_tokens} tokens, {result['compute_dtype']} on {result['device']}"]
        + timed
        + ([f"trainer_vs_plain = {result['trainer_vs_plain']:.2f}"] if plain_fits else [])
        + plain_note
        + extra
        + ([f"mfu = {result['mfu']:.1%} (compiled {result['mfu_compiled']:.1%}, eager {result['mfu_eager']:.1%}), kernels {'on' if cfg.trainer.kernels else 'off'}; "
            f"peak memory = {result['peak_mem_gib']:.1f} GiB"] if "mfu" in result else [])
        + ([f"planner: the trainer's peak {result['planned_peak_gib']:.1f} GiB predicted, {result['trainer_peak_gib']:.1f} GiB measured in its first step "
            f"(planned_vs_measured = {result['planned_vs_measured']:.2f}; {'within' if abs(result['planned_vs_measured'] - 1) <= 0.10 else 'NOT within'} 10%)"]
           if cuda else [])
        + ([f"host CPU time {result['host_cpu_s_per_step']:.3f} s/step ({result['host_ms_per_micro_batch']:.1f} ms per micro-batch) "
            f"for {ours_s:.3f} s of wall time"] if cuda else [])
    )

def _planned_peak(cfg: RunConfig, model_path: str, measured: float | None) -> dict:
    """On a GPU: the planner's accelerator memory for this trainer (less its fixed allowance for the
    CUDA context, which the allocator does not see) against the peak the allocator measured in the
    trainer's first step."""
    if measured is None:
        return {}
    from raytool.planner import ACCELERATOR_RESERVE, Cluster, plan

    predicted = plan(cfg, Cluster.this_machine(), model_path).roles[0].accelerator_total - ACCELERATOR_RESERVE
    return {"planned_peak_gib": predicted / 2**30, "trainer_peak_gib": measured / 2**30, "planned_vs_measured": predicted / measured}


def _bf16_vs_fp32(cfg: RunConfig, model_path: str, trainer, batch: TrainBatch, timed, repeats: int) -> tuple[dict, list[str]]:
    """On a CPU: the RL step in the other compute dtype too (same batch, alternating), where the
    CPU computes bf16 natively; elsewhere bf16 is emulated, many times slower, and not timed."""
    import msgspec

    from raytool.device import cpu_bf16_support
    from raytool.training import Trainer

    native, why = cpu_bf16_support()
    if not native:
        return {"cpu_bf16_native": False, "bf16_vs_fp32": None}, [f"bf16_vs_fp32: not measured, this CPU has no native bf16 ({why})"]
    other_dtype = "float32" if trainer.dtype == torch.bfloat16 else "bfloat16"
    other = Trainer(msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, compute_dtype=other_dtype)),
                    model_path, device="cpu")
    timed(lambda: other.rl_step(batch))
    other_s, ours_s = _alternating(timed, [lambda: other.rl_step(batch), lambda: trainer.rl_step(batch)], repeats)
    fp32_s, bf16_s = (other_s, ours_s) if other_dtype == "float32" else (ours_s, other_s)
    return ({"cpu_bf16_native": True, "bf16_vs_fp32": fp32_s / bf16_s, "fp32_step_s": fp32_s, "bf16_step_s": bf16_s},
            [f"bf16 RL step {bf16_s:.3f} s, fp32 {fp32_s:.3f} s: bf16_vs_fp32 = {fp32_s / bf16_s:.2f} ({why})"])


def _compile_vs_eager(trainer, batch: TrainBatch, tokens: int, timed, repeats: int) -> tuple[dict, list[str]]:
    """The RL step with trainer.compile on and off, on the same trainer (switched in place,
    alternating after a warm-up that compiles), whichever the config chose. Each state takes
    one step of the model, so the two keep training rather than repeat one update."""
    policy = trainer.policy
    chosen = trainer.cfg.trainer.compile
    policy.set_compiled(not chosen)
    compile_s = timed(lambda: trainer.rl_step(batch))  # the other state's first step: compiles when that is on

    def step(state: bool):
        def run():
            policy.set_compiled(state)
            return trainer.rl_step(batch)
        return run

    # the configured state runs last in each round, so the trainer is left as configured
    other_s, chosen_s = _alternating(timed, [step(not chosen), step(chosen)], repeats)
    on_s, off_s = (chosen_s, other_s) if chosen else (other_s, chosen_s)
    first = f"first step {compile_s:.1f} s" + (" (compiling)" if not chosen else "")
    return ({"compile_vs_eager": off_s / on_s, "compiled_tokens_per_s": tokens / on_s, "eager_tokens_per_s": tokens / off_s},
            [f"compiled RL step {on_s:.3f} s, eager {off_s:.3f} s: compile_vs_eager = {off_s / on_s:.2f} ({first})"])


def _sharing_vs_unshared(trainer, batch: TrainBatch, timed, repeats: int) -> tuple[dict, list[str]]:
    """The RL step with each group's shared prompt run once (trainer.prefix_sharing, as the
    config chose) and with one row per sequence, on the same trainer, alternating; and the tokens
    each runs through the model per step (rows x width)."""
    chosen = trainer.prefix_sharing
    if not chosen:
        return {"prefix_sharing": False}, ["prefix sharing: off for this trainer (trainer.prefix_sharing)"]
    row_tokens = {}

    def step(mode: str):
        def run():
            trainer.prefix_sharing = mode
            row_tokens[mode] = trainer.rl_step(batch)["perf/update_row_tokens"]
        return run

    unshared_s, shared_s = _alternating(timed, [step(""), step(chosen)], repeats)  # the chosen one last: the trainer is left as configured
    ratio = row_tokens[chosen] / row_tokens[""]
    return ({"prefix_sharing": True, "sharing_vs_unshared": unshared_s / shared_s, "row_tokens_per_step": row_tokens[chosen],
             "unshared_row_tokens_per_step": row_tokens[""], "row_tokens_shared_vs_unshared": ratio},
            [f"shared prefixes {shared_s:.3f} s, one row per sequence {unshared_s:.3f} s: sharing_vs_unshared = {unshared_s / shared_s:.2f}; "
             f"tokens through the model per step {row_tokens[chosen]:.0f} vs {row_tokens['']:.0f} ({ratio:.2f}x)"])


def largest_that_fits(run, budget: int, reset, floor: int = 512) -> int:
    """Run `run(budget)` (the plain loop's warm-up), halving the token budget after each
    out-of-memory error down to `floor` (its full fp32 logits grow with the micro-batch, so it may
    not fit where raytool's step does); `reset` drops what the failed try left. Returns the budget
    that ran; raises the last out-of-memory error below `floor`."""
    while True:
        try:
            run(budget)
            return budget
        except torch.OutOfMemoryError:
            reset()
            if budget // 2 < floor:
                raise
            budget //= 2


def _alternating(timed, runs: list, repeats: int) -> list[float]:
    """Each of `runs` timed `repeats` times in turn (A B A B ...), so that a noisy machine hits
    all alike; the best time of each."""
    times = [[] for _ in runs]
    for _ in range(repeats):
        for spent, run in zip(times, runs):
            spent.append(timed(run))
    return [min(spent) for spent in times]
