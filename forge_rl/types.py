"""The data that flows through forge_rl.

One prompt becomes one `Episode`: a GRPO group of `Completion`s sampled from it. Every generated
token carries the behaviour logprob the generator sampled it with and the policy version whose
weights decoded it, so the trainer can (a) refuse tokens older than `max_policy_age` and (b) correct
for the difference between the behaviour policy and the current one.

Worked example (task "max of two digits", group size 2, policy version 3 swapped to 4 mid-decode):

    Episode(
        episode_id=17, prompt_text="M37=", answer="7", prompt_token_ids=[1, 13, 6, 10, 14],
        completions=[
            Completion(token_ids=[10, 2], logprobs=[-0.11, -0.02], policy_versions=[3, 4],
                       text="7", reward=1.0, status=CompletionStatus.OK),
            Completion(token_ids=[6, 2], logprobs=[-2.30, -0.05], policy_versions=[3, 3],
                       text="3", reward=0.0, status=CompletionStatus.OK),
        ],
    )

Lengths: for each completion, `token_ids`, `logprobs`, `policy_versions` and `trainable` all have the
same length (the number of generated tokens, EOS included when it was sampled). `trainable` starts all
True; the replay buffer's `mask_tokens` drop policy turns over-age tokens False, so they reach no loss.

Trajectories, not prompts (a multi-turn episode against an environment, forge_rl/envs/): the same
`Completion` holds one trajectory's token sequence, where each token is generated (sampled by the
policy) or context (the prompt, the environment's observations, tool output), per `generated`. A
single-turn completion is the one-turn trajectory: every token generated, `generated` None. Worked
example (calculator, as `forge_rl.envs.trajectory`; the episode's prompt_token_ids is empty, since the
trajectory holds its own prompt as context):

    Completion(token_ids=[1, 7, 11, 43, 9, 6, 40,  16, 7, 11, 43, 9, 6, 2,  31, 5, 13, 6, 8, 40,  5, 13, 6, 8, 2],
               generated=[False] * 7 + [True] * 7 + [False] * 6 + [True] * 5,
               logprobs=[0.0] * 7 + [-0.9, ...] + [0.0] * 6 + [-0.4, ...],    # 0.0 on context
               policy_versions=[3] * 7 + [3] * 7 + [3] * 6 + [3, 3, 4, 4, 4],   # context: see the field
               reward=1.0, num_turns=2, turn_rewards=[None, None], end_reason="done")
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import operator
from dataclasses import dataclass, field
from typing import Any, Literal

from forge_rl.routing import RoutingRecord


class CompletionStatus(str, enum.Enum):
    """How a completion ended. The order of members carries no meaning."""

    OK = "ok"
    """Stopped on EOS (or a stop token) within the length budget."""
    TRUNCATED = "truncated"
    """Hit `max_new_tokens` before EOS; it is scored and trained like any other."""
    ERRORED = "errored"
    """The reward function raised or timed out; never trained, counted in the run summary."""


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    """Generated token ids, [T]."""
    logprobs: list[float]
    """Behaviour logprob of each generated token under the weights that sampled it, [T]."""
    policy_versions: list[int]
    """Policy version (trainer optimizer steps) of the weights that decoded each token, [T]."""
    text: str = ""
    """Detokenized completion (EOS stripped), what the verifier sees."""
    reward: float = 0.0
    status: CompletionStatus = CompletionStatus.OK
    error: str | None = None
    """For ERRORED completions: the exception the reward function raised."""
    trainable: list[bool] | None = None
    """Whether each token may still reach a loss, [T]; None (the default) means all True and is
    replaced by that list on construction. Tokens turned False keep their place (and their reward
    counts for the group's advantage baseline) but get no gradient."""
    sampling_support: list[list[int]] | None = None
    """Per token, the ids the generator could have drawn it from after top-k/top-p filtering
    (vLLM's sampling mask), [T][k_t]; None when sampling kept the whole vocabulary. The behaviour
    logprob is normalized over this set, so the trainer renormalizes its own over the same set."""
    num_truncated_support: int = 0
    """Tokens whose kept set may be incomplete: on engines that read it from the top
    `generator.max_support_ids` logprobs (CPU), a set that filled them all. The trainer
    renormalizes those tokens over too few ids, which biases their importance ratios above 1."""
    reference_logprobs: list[float] | None = None
    """Logprob of each token under the frozen reference model, [T]; set only when the KL penalty
    is on (trainer.loss.kl_beta > 0)."""
    generated: list[bool] | None = None
    """Per token, [T]: sampled by the policy (True) or context the model read but did not write
    (False: the prompt, observations, tool output), which is in the sequence and never in a loss.
    None (the default, every single-turn completion) means all generated. A context token's logprob
    is 0.0, its kept set empty, and its policy version that of the generated token before it (the
    first generated token's, before any): never older than the trajectory's oldest generated token,
    so staleness is decided by generated tokens alone."""
    num_turns: int = 1
    """Model turns of the trajectory (1 for a single-turn completion)."""
    num_malformed_turns: int = 0
    """Turns the environment rejected as malformed (bad tool calls): the tool error count."""
    turn_rewards: list[float | None] = field(default_factory=list)
    """Per environment step, the turn's own reward (a process reward) or None; trained as
    `step_rewards` over the turns' tokens (`forge_rl.envs.rollout.turn_steps`)."""
    env_latencies_s: list[float] = field(default_factory=list)
    """Wall time of each environment reset and step that answered."""
    end_reason: str | None = None
    """Why an environment's episode ended (`forge_rl.envs.trajectory.TrajectoryStatus` value:
    done, truncated_turns, truncated_tokens, parse_error, env_error, env_timeout); None for a
    single-turn completion, whose `status` says it."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """The named parts of `reward` as the scorer reported them (`forge_rl.scoring.scorers`): a scorer's own
    components, and with several scorers each one's reward under its name. Logged as
    `reward/components/<name>` means; the reward is what trains."""
    step_ends: list[int] | None = None
    """Process rewards: the exclusive end of each step in `token_ids`, [S], increasing, the last
    = T (a step is tokens [previous end, end)); set with `step_rewards` by a per-step scorer."""
    step_rewards: list[float] | None = None
    """Reward of each step, [S]; `forge_rl.core.advantages.token_advantages` places it on its tokens."""
    token_rewards: list[float] | None = None
    """Dense reward of each token, [T]; added to that token's advantage (`token_advantages`)."""
    routed_experts: RoutingRecord | None = None
    """Mixture-of-experts policies with Keep Routing: the experts each generated token was sampled
    through, [G, layers, top_k] over the G generated tokens in order (context tokens have none);
    None when not recorded (dense model, recording off, or an engine that cannot), and the trainer
    then routes those tokens itself. `forge_rl.routing`."""
    kv_versions: list[int] | None = None
    """Per token, [T]: the oldest weights a generated token depends on, those that sampled it and
    those that encoded the KV it attended to, as the engine recorded it; the entry of a context
    token means nothing. None: not recorded, and `forge_rl.core.columns.exact_versions` takes each
    turn's oldest version up to the token, which is never younger. Every age bound is applied to
    these versions (`forge_rl.core.buffer`), so a token that continued on KV of older weights is as old
    as they are."""
    agent: str | None = None
    """The agent of a multi-agent episode whose view this is ("proposer", "solver/2":
    `forge_rl.envs.graph`); None in a single-agent episode."""
    baseline_group: str | None = None
    """Which completions of its group this one's advantage is baselined against: those with the same
    value (an agent's seat, or its seat within one episode: `forge_rl.envs.rollout.group_completions`); None:
    the whole group, GRPO's baseline."""
    policy: str | None = None
    """The policy that sampled it and that trains it (a `policies` entry of the run's config, by
    name: its own trainer, versions and age bound); None: the run's own policy."""
    entropies: list[float] | None = None
    """Per token, [T]: the entropy in nats of the distribution it was sampled from, as the engine
    estimated it (`forge_rl.core.branches.token_entropies`); recorded only for branch.rule
    entropy, 0.0 for a context token."""
    parent: int | None = None
    """A branch (`forge_rl.core.branches`): the index, in its group, of the completion it
    continues; None for a completion sampled from the prompt."""
    fork_at: int = 0
    """A branch's pivot: its first `fork_at` tokens are its parent's, held as context; 0 for a
    completion sampled from the prompt."""

    def __post_init__(self) -> None:
        if self.trainable is None:
            self.trainable = [True] * len(self.token_ids)
        lengths = {
            "token_ids": len(self.token_ids),
            "logprobs": len(self.logprobs),
            "policy_versions": len(self.policy_versions),
            "trainable": len(self.trainable),
        }
        for name in (
            "sampling_support",
            "reference_logprobs",
            "generated",
            "token_rewards",
            "kv_versions",
            "entropies",
        ):
            if getattr(self, name) is not None:
                lengths[name] = len(getattr(self, name))
        if len(set(lengths.values())) > 1:
            raise ValueError(f"Completion fields disagree in length: {lengths}")
        check_steps(self.step_ends, self.step_rewards, len(self.token_ids))
        if self.routed_experts is not None and self.routed_experts.num_tokens != self.num_generated_tokens:
            raise ValueError(
                f"Completion.routed_experts holds {self.routed_experts.num_tokens} tokens' routing for "
                f"{self.num_generated_tokens} generated tokens: one record per generated token"
            )

    @property
    def generated_mask(self) -> list[bool]:
        """Per token, [T]: sampled by the policy (`generated`, all True when it is None)."""
        return [True] * self.num_tokens if self.generated is None else list(self.generated)

    @property
    def oldest_policy_version(self) -> int:
        """The version that bounds this completion's staleness: its oldest generated token's (0
        without one)."""
        if self.generated is None:  # every token sampled: no walk in Python
            return min(self.policy_versions, default=0)
        versions = [v for v, sampled in zip(self.policy_versions, self.generated) if sampled]
        return min(versions, default=0)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, context included (its row length in a batch)."""
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.generated_mask)

    @property
    def loss_mask(self) -> list[bool]:
        """Per token, [T]: does it reach the loss? Generated and `trainable`, and nothing of an
        ERRORED completion."""
        if self.status == CompletionStatus.ERRORED:
            return [False] * self.num_tokens
        assert self.trainable is not None  # __post_init__ fills it
        if self.generated is None:  # every token sampled: no walk in Python
            return list(self.trainable)
        return [t and g for t, g in zip(self.trainable, self.generated)]

    @property
    def num_trainable_tokens(self) -> int:
        """sum(loss_mask), counted without building the mask (the buffer and the metrics ask it of
        every completion at every step)."""
        if self.status == CompletionStatus.ERRORED:
            return 0
        assert self.trainable is not None  # __post_init__ fills it
        if self.generated is None:
            return self.trainable.count(True)
        return sum(map(operator.and_, self.trainable, self.generated))

    def trained_tokens_by_version(self) -> dict[int, int]:
        """Tokens that reach the loss, counted by the policy version that sampled them (versions
        with none left out)."""
        versions = self.policy_versions
        if versions and min(versions) == max(versions):  # one version, the common case: no walk in Python
            count = self.num_trainable_tokens
            return {versions[0]: count} if count else {}
        return dict(collections.Counter(v for v, trains in zip(versions, self.loss_mask) if trains))


def join_pieces(head: Completion, tail: Completion) -> Completion:
    """One completion from a prefix sampled by one request and its continuation by a later one
    (after an abort-mode swap's abort, at a segment's end, or on another generator after its own
    died): tokens, logprobs, versions and kept sets in order; the tail's status and text. An empty
    head (a completion restarted from nothing) is the tail itself."""
    if not head.token_ids:
        return tail
    support = None if head.sampling_support is None else head.sampling_support + (tail.sampling_support or [])
    routing = None  # a record for the whole completion, or none (one piece unrecorded)
    if head.routed_experts is not None and tail.routed_experts is not None:
        routing = RoutingRecord.concat([head.routed_experts, tail.routed_experts])
    return Completion(
        head.token_ids + tail.token_ids,
        head.logprobs + tail.logprobs,
        head.policy_versions + tail.policy_versions,
        text=tail.text,
        status=tail.status,
        sampling_support=support,
        num_truncated_support=head.num_truncated_support + tail.num_truncated_support,
        routed_experts=routing,
        # The continuation's prefix was encoded anew when it was submitted: its tokens depend on
        # its own versions, whatever the head's did.
        kv_versions=None
        if head.kv_versions is None or tail.kv_versions is None
        else head.kv_versions + tail.kv_versions,
        entropies=None if head.entropies is None or tail.entropies is None else head.entropies + tail.entropies,
    )


def check_steps(step_ends: list[int] | None, step_rewards: list[float] | None, num_tokens: int) -> None:
    """ValueError unless the steps cover the tokens in order, one reward each (or there are none)."""
    if (step_ends is None) != (step_rewards is None):
        raise ValueError(f"step_ends ({step_ends}) and step_rewards ({step_rewards}) come together or not at all")
    if step_ends is None or step_rewards is None:  # both None: the check above pairs them
        return
    if len(step_ends) != len(step_rewards):
        raise ValueError(f"{len(step_ends)} step_ends but {len(step_rewards)} step_rewards: one reward per step")
    starts = [0, *step_ends[:-1]]
    if any(end <= start for start, end in zip(starts, step_ends)) or (step_ends or [0])[-1] != num_tokens:
        raise ValueError(
            f"step_ends ({step_ends}) must increase strictly and end at the completion's length ({num_tokens}): "
            "every token belongs to exactly one step"
        )


@dataclass
class Episode:
    """A prompt and its group of completions (the GRPO unit: advantages are normalized per group)."""

    episode_id: int
    """Unique id of the prompt hand-out, for accounting (trained once, or dropped with a reason)."""
    prompt_text: str
    answer: str
    """What the verifier compares against."""
    prompt_token_ids: list[int]
    """Empty for an environment's episode: each trajectory holds its own prompt as context (an
    environment may render it differently per trajectory, and a forked sample re-renders it)."""
    completions: list[Completion] = field(default_factory=list)
    forced_length: int | None = None
    """When set, every completion is generated exactly this long (EOS ignored): how a task imposes
    a completion-length distribution, e.g. the long tail of the async-vs-sync benchmark."""
    generator_index: int | None = None
    """The generator that sampled the completions (set by the generator pool); the trainer reports
    the sampler mismatch per generator, so one serving stale weights stands out."""
    temperature: float = 1.0
    """Temperature the completions were sampled at (set by the generator). Behaviour logprobs are
    log_softmax(logits / temperature); the trainer divides its logits by the same value, or its
    importance ratios would compare two different distributions."""
    admitted_version: int | None = None
    """The generator's policy version when the admission gate let this episode's rollout start
    (set by the train loop); None for an episode made outside a run's rollout loops."""
    columns: dict[str, Any] | None = None
    """Every column of the data row the prompt came from, by name (a run with data.path); None for a
    task's prompt. A checkpoint without it loads as None."""

    @property
    def oldest_policy_version(self) -> int:
        return min(c.oldest_policy_version for c in self.completions)

    @property
    def schedule_version(self) -> int:
        """The version the buffer serves stalest-first by and the admission gate schedules by
        (`forge_rl.core.admission`): the admitted version, else the oldest token's (never older)."""
        return self.oldest_policy_version if self.admitted_version is None else self.admitted_version

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the policy sampled (a trajectory's context excluded)."""
        return sum(c.num_generated_tokens for c in self.completions)

    @property
    def num_tokens(self) -> int:
        """Tokens the episode holds: the prompt once plus every completion, context included (what
        buffer capacity counts)."""
        return len(self.prompt_token_ids) + sum(c.num_tokens for c in self.completions)

    @property
    def num_trainable_tokens(self) -> int:
        return sum(c.num_trainable_tokens for c in self.completions)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    def to_dict(self) -> dict[str, Any]:
        """Plain lists, numbers and strings (status as its value): what checkpoints store."""
        return dataclasses.asdict(self) | {"completions": [completion_to_dict(c) for c in self.completions]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Episode:
        """Inverse of `to_dict`."""
        return cls(**data | {"completions": [completion_from_dict(c) for c in data["completions"]]})


def completion_to_dict(completion: Completion) -> dict[str, Any]:
    """Plain lists, numbers and strings (status as its value): what checkpoints store."""
    return dataclasses.asdict(completion) | {
        "status": completion.status.value,
        "routed_experts": None if completion.routed_experts is None else completion.routed_experts.to_dict(),
    }


def completion_from_dict(data: dict[str, Any]) -> Completion:
    """Inverse of `completion_to_dict`."""
    return Completion(
        **data
        | {
            "status": CompletionStatus(data["status"]),
            "routed_experts": None
            if data.get("routed_experts") is None
            else RoutingRecord.from_dict(data["routed_experts"]),
        }
    )


@dataclass(frozen=True)
class SwapStats:
    """One weight swap, timed from the generator's side. Seconds throughout."""

    policy_version: int
    mode: str
    """vLLM pause mode: keep (in flight), wait (drain) or abort (abort and resubmit)."""
    loader: str
    """"staged" (references swapped while paused) or "reload" (vLLM's reload_weights while paused)."""
    stage_s: float
    """Staging in the worker while the engine decoded (0 when staged beforehand or reloading)."""
    pause_s: float
    """From asking for the pause to the engine being paused: the current step finishing
    (keep), every in-flight request finishing (wait), or the abort (abort)."""
    load_s: float
    """Paused, swapping (staged: a reference swap; reload: the whole reload)."""
    stall_s: float
    """From asking for the pause to resuming: `pause_s` + the paused time."""
    paused_s: float
    """From paused to resumed: the time the engine could not decode at all."""
    num_bytes: int
    num_requests_over_older_kv: int = 0
    """Requests that continued across the swap on KV computed by older weights (swap_kv="reuse"):
    their later tokens are labelled with the new version, one version younger than the oldest
    weights they depend on."""


# A sampling request of the service and what it returns (`forge_rl.service.backend`): here, below
# the engines that answer it (VLLMEngine.sample).
@dataclass(frozen=True)
class SampleSpec:
    prompt: list[int]
    num_samples: int = 1
    max_tokens: int | None = None
    """Unset: up to the context's end."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: no limit."""
    stop: list[int] | list[str] | None = None
    """Stop token ids or stop strings; None: stop at EOS; []: never stop before max_tokens."""
    seed: int | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    """k > 0: the k likeliest next tokens at each prompt position, by the model's distribution
    (temperature 1, no top-k/top-p)."""
    topk_sample_logprobs: int = 0
    """k > 0: the k likeliest tokens at each sampled position, by the distribution the token was
    drawn from (the request's temperature, top-k and top-p)."""


TopK = list[tuple[int, float]]
"""(token id, logprob) of the likeliest tokens at one position, likeliest first."""


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    policy_versions: list[int]
    """The weights version each token was sampled by (forge_rl's per-token stamp)."""
    topk_logprobs: list[TopK] | None = None
    """With SampleSpec.topk_sample_logprobs: each sampled position's likeliest tokens."""


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """With SampleSpec.prompt_logprobs: each prompt token's logprob (None for the first)."""
    topk_prompt_logprobs: list[TopK | None] | None = None
    """With SampleSpec.topk_prompt_logprobs: each prompt position's likeliest tokens (None for the first)."""
