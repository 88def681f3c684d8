"""What the scheduler knows about one request (`JobInfo`), and what the policies ask of where cached prefixes are
known (`PrefixSource`: the Coordinator's estimate, scheduling/affinity.py, or the engines' KV events,
scheduling/kv_index.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduling import clock
from scheduling.registry import Target


@dataclass
class JobInfo:
    """What the scheduler knows about one request."""

    model: str
    prompt_tokens: int
    max_tokens: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    block_hashes: list[int] = field(default_factory=list)
    prompt_keys: object = None  # the prompt's block keys from its exact ids (scheduling/kv_index.PromptKeys), if known
    # The engines' KV events are asked about it (its ids are exact, or meant to be): its prediction is counted,
    # as unpredicted when the ids were not had (not in within EXACT_WAIT_S, an image, the encoding queue full).
    kv_predicted: bool = False
    prompt_bytes: int = 0  # its rendering's length, when an engine's count of it may calibrate the meter (else 0)
    engine_type: str | None = None  # only engines of this kind may serve it (Anthropic routes: vllm)
    priority: int = 1  # its x-priority class: 0 interactive, 1 standard, 2 batch (scheduling/fairness.py)
    teaches: bool = True  # served whole, its timings can teach the model (it streams: a JSON answer has no TTFT)
    tenant: str = ""  # whose it is, and the tenant's weight: the admission queue's fair share
    weight: float = 1.0
    arrived: float = field(default_factory=lambda: clock.now())
    cached: dict[int, int] = field(default_factory=dict)  # slot -> cached prompt tokens (memo)
    cached_predicted: int = -1  # what the engine of its last prefill or whole lease was predicted to hold
    opens: bool = False  # the last plan placed it as a new conversation (on KV events)
    failed: set[int] = field(default_factory=set)  # slots whose engine failed it: a continuation goes to none of them
    # The verdict of the last plan: can the chosen engines meet the budgets? (None: cannot tell.)
    feasible: bool | None = None
    ttft_s: float = 0.0  # predicted for the chosen engines, with their allowances for errors
    tpot_s: float = 0.0
    tpot_model_s: float = 0.0  # the decode model's own TPOT prediction (its errors are learned)
    tpot_batch: float = 0.0  # the decode batch (itself included) that prediction is for
    tpot_budget_ms: float = 0.0  # the TPOT budget it was judged against: its own, or a tighter stream's there
    floor_s: float = 0.0  # expected TTFT with empty queues (no allowance): below this budget no wait can help
    hopeless: bool = False  # even that floor, or the expected TPOT, is over the budget
    # Which stage the last plan's verdict found saturated: "prefill" (its TTFT is over budget: the prefill
    # engine's queue and speed, with the decode engine's first step), "decode" (its TPOT: the decode batch it
    # would join), both, or "" (neither).
    over: str = ""
    alone: bool = False  # the last plan serves a P/D pair's request on its decode engine alone (no prefill leg)
    retry_after_s: float = 1.0


class PrefixSource(Protocol):
    """Where the policies learn which engine holds how much of a prompt in its prefix cache: the Coordinator's
    own estimate (scheduling/affinity.py: the prompts it had each engine compute), or the engines' own KV cache
    events (scheduling/kv_index.py), through these calls alone."""

    needs_hashes: bool  # it reads the prompt's block hashes (JobInfo.block_hashes: Scheduler.prepare makes them)
    needs_ids: bool  # it reads the prompt's exact token ids (JobInfo.prompt_keys: Scheduler.prepare makes them)
    tells_conversations: bool  # `starts` and `chains` can answer (not always None and -1)

    def cached_tokens(self, job: JobInfo, target: Target) -> int:
        """The leading prompt tokens of `job` that `target` is believed to hold (0: none)."""

    def last_holder(self, job: JobInfo, tokens: int) -> int:
        """The slot that most recently came to hold the first `tokens` prompt tokens of `job` (-1: unknown)."""

    def cache_fill(self, target: Target) -> tuple[int, int]:
        """The blocks `target`'s prefix cache holds now and its size in blocks (0: not known: its engine has not
        evicted yet, or the source sees no evictions)."""

    def starts(self, job: JobInfo, target: Target, tokens: int) -> bool | None:
        """Whether `job` starts a conversation (True) or continues one (False), judged on `target`, which holds its
        first `tokens` prompt tokens (None: the source cannot tell)."""

    def chains(self, target: Target) -> int:
        """How many conversations (chains of blocks) `target` holds (-1: not known)."""

    def previous_turn(self, job: JobInfo, tokens: int) -> int:
        """The slot this worker sent `job`'s conversation's turn before it to, when that turn was a prompt `job`
        extends whose full blocks end at its first `tokens` tokens (-1: none, or not known)."""

    def kept(self, job: JobInfo, target: Target, tokens: int) -> None:
        """`job`, a conversation's next turn (`starts` said False), stays on `target`, which holds `tokens` of it."""

    def record(self, hashes: list[int], slot: int) -> None:
        """The engine at `slot` has just computed a prompt with these block hashes (what an estimate learns
        from; a source the engines tell may ignore it)."""

    def placed(self, lease, job: JobInfo) -> None:
        """`job`'s prompt was just sent to be computed on `lease.slot` (its ledger Lease, released when done)."""
