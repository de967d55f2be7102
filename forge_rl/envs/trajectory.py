"""Token-in/token-out trajectories: one token sequence per episode, built turn by turn.

Each token of a trajectory is either generated (sampled by the policy: trainable, with its
behaviour logprob and the policy version that decoded it) or context (the prompt, the
environment's observations, tool output: in the sequence, never in a loss, no logprob). Sampled ids
are appended exactly as the generator returned them and are never re-derived from text:
re-tokenizing a turn can give other ids than those sampled (a different split of the same text, or
a special token dropped), and training on those is a silent off-policy error.

Only observations are rendered to tokens. The renderer renders the whole conversation and the
builder keeps what lies past the tokens it holds. When that rendering does not start with them (the
prefix breaks: a chat template that drops earlier reasoning, a turn whose text does not re-encode to
its ids, a turn cut before its end-of-turn token that the template would add), the trajectory
forks: the tokens so far stay one sample, as sampled, and a new sample starts from the
re-rendered conversation, all context, so what the model reads next is what the template says.

Worked example (calculator environment, plain format of the tiny models, char tokenizer: <bos>=1,
<eos>=2, digits 4-13, "C"=16, "R"=31, "="=40, "*"=43; policy version 3, swapped to 4 during the
second turn). One sample, four spans:

    ContextSpan(token_ids=(1, 7, 11, 43, 9, 6, 40))                              "<bos>37*52="
    GeneratedSpan(token_ids=(16, 7, 11, 43, 9, 6, 2),
                  logprobs=(-0.9, -0.1, -0.2, -0.1, -0.1, -0.3, -0.05),
                  policy_versions=(3, 3, 3, 3, 3, 3, 3))                         "C37*52<eos>"
    ContextSpan(token_ids=(31, 5, 13, 6, 8, 40))                                 "R1924="
    GeneratedSpan(token_ids=(5, 13, 6, 8, 2), logprobs=(-0.4, -0.2, -0.1, -0.1, -0.02),
                  policy_versions=(3, 3, 4, 4, 4))                               "1924<eos>"

    Trajectory(samples=[TrajectorySample(spans=[...the four above])], status=DONE,
               final_reward=1.0, num_turns=2, ...)

Lengths: in each GeneratedSpan, token_ids, logprobs, policy_versions (and sampling_support and
routed_experts, when recorded) have one entry per token.
A sample's token_ids is its spans' ids concatenated; its loss_mask is True on generated tokens.

How the trainer sees a trajectory: `forge_rl.envs.rollout.trajectory_completion` makes its first
sample one `Completion` (`forge_rl.types`) holding the whole token sequence with a `generated`
mask (context tokens: logprob 0.0, never in a loss), the final reward as its reward, the per-turn
rewards as process-reward steps, and the status as `end_reason` (DONE and PARSE_ERROR -> OK,
TRUNCATED_* -> TRUNCATED, ENV_ERROR and ENV_TIMEOUT -> ERRORED). A single-turn completion is the
one-turn trajectory (`generated` None: every token generated), so the buffer, the batch and the
losses have one path; an `Episode` stays the GRPO group: the trajectories of one prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from forge_rl.envs.environment import Message, Observation, as_messages
from forge_rl.envs.renderers import Renderer
from forge_rl.routing import RoutingRecord


@dataclass(frozen=True)
class ContextSpan:
    """Tokens the model read but did not write: prompt, observations, tool output. Never trained."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class GeneratedSpan:
    """One turn as the generator sampled it: trainable."""

    token_ids: tuple[int, ...]
    """Sampled ids, exactly as the generator returned them, [T]."""
    logprobs: tuple[float, ...]
    """Behaviour logprob of each token under the weights that sampled it, [T]."""
    policy_versions: tuple[int, ...]
    """Policy version that decoded each token, [T] (weights can change mid-turn)."""
    sampling_support: tuple[tuple[int, ...], ...] | None = None
    """Per token, the ids top-k/top-p kept when it was sampled, [T][kept] (as
    `Completion.sampling_support`); None when nothing was filtered or none were recorded."""
    routed_experts: RoutingRecord | None = None
    """Mixture-of-experts policies: the experts each token was sampled through, [T, layers, top_k]
    (`forge_rl.routing`: the routing of the pass that sampled it, the context's last token's
    for the turn's first token); None when not recorded."""
    num_truncated_support: int = 0
    """Tokens whose kept set may be incomplete, as the generator counted them
    (`Completion.num_truncated_support`)."""

    def __post_init__(self) -> None:
        lengths = {
            "token_ids": len(self.token_ids),
            "logprobs": len(self.logprobs),
            "policy_versions": len(self.policy_versions),
        }
        if self.sampling_support is not None:
            lengths["sampling_support"] = len(self.sampling_support)
        if self.routed_experts is not None:
            lengths["routed_experts"] = self.routed_experts.num_tokens
        if len(set(lengths.values())) > 1:
            raise ValueError(f"GeneratedSpan fields disagree in length: {lengths}")


Span = ContextSpan | GeneratedSpan


@dataclass
class TrajectorySample:
    """One token sequence: what the trainer sees as one training sequence."""

    spans: list[Span] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [token_id for span in self.spans for token_id in span.token_ids]

    @property
    def loss_mask(self) -> list[bool]:
        """Per token: generated (True) or context (False), [L]."""
        return [isinstance(span, GeneratedSpan) for span in self.spans for _ in span.token_ids]

    @property
    def generated_spans(self) -> list[GeneratedSpan]:
        return [span for span in self.spans if isinstance(span, GeneratedSpan)]

    @property
    def num_tokens(self) -> int:
        return sum(len(span.token_ids) for span in self.spans)


class TrajectoryStatus(str, enum.Enum):
    """Why an episode ended. The order of members carries no meaning."""

    DONE = "done"
    """The environment closed it (StepResult.done) with its final reward."""
    TRUNCATED_TURNS = "truncated_turns"
    """The model had its `max_turns` turns and the environment had not closed it."""
    TRUNCATED_TOKENS = "truncated_tokens"
    """No room for another turn or observation within `max_total_tokens` (the context budget)."""
    PARSE_ERROR = "parse_error"
    """The model broke the environment's format more than `max_malformed_turns` times."""
    ENV_ERROR = "env_error"
    """The environment raised in reset or step (the error says which and what)."""
    ENV_TIMEOUT = "env_timeout"
    """The environment's reset or step ran past `env_step_timeout_s`."""

    @property
    def trainable(self) -> bool:
        """Whether the episode may reach a loss. The environment's failures (ENV_ERROR,
        ENV_TIMEOUT: "errored") say nothing about the policy and are counted, never trained; the
        model's own (PARSE_ERROR, truncation) are trained with the reward they earned."""
        return self not in (TrajectoryStatus.ENV_ERROR, TrajectoryStatus.ENV_TIMEOUT)


@dataclass
class Trajectory:
    """One episode played against an environment."""

    samples: list[TrajectorySample]
    """The token sequences: one, or more after prefix breaks (each fork starts a new one). Empty
    when reset failed."""
    status: TrajectoryStatus
    final_reward: float
    """The environment's closing reward (DONE); 0.0 for an episode it did not close (the model ran
    out of turns or tokens, or broke the format: nothing earned)."""
    turn_rewards: list[float | None]
    """StepResult.turn_reward of each step the environment answered, in order."""
    conversation: list[Message]
    """What was said, as text (observations, and each turn as its tokens decode): logs and debugging."""
    num_turns: int
    """Model turns sampled."""
    num_malformed_turns: int
    env_latencies_s: list[float]
    """Wall time of each reset and step call that returned."""
    error: str | None = None
    """For ENV_ERROR, ENV_TIMEOUT, PARSE_ERROR and truncation: what happened, in words."""

    @property
    def num_forks(self) -> int:
        return max(0, len(self.samples) - 1)

    @property
    def generated_spans(self) -> list[GeneratedSpan]:
        return [span for sample in self.samples for span in sample.generated_spans]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(span.token_ids) for span in self.generated_spans)

    @property
    def oldest_policy_version(self) -> int | None:
        """The version that bounds its staleness (its oldest generated token); None without one."""
        return min((v for span in self.generated_spans for v in span.policy_versions), default=None)


class TrajectoryBuilder:
    """Builds a trajectory's samples turn by turn.

    Invariant: the generated spans of all samples, in order, are exactly the turns given to
    `add_turn`; every other token is context. Every sample stays shorter than `max_total_tokens`.
    """

    def __init__(self, renderer: Renderer, max_total_tokens: int):
        self.renderer = renderer
        self.max_total_tokens = max_total_tokens
        self.samples: list[TrajectorySample] = []
        self.conversation: list[Message] = []

    @property
    def prefix(self) -> list[int]:
        """The token ids the next turn is sampled after: the current sample's."""
        return self.samples[-1].token_ids

    @property
    def num_tokens(self) -> int:
        return self.samples[-1].num_tokens

    def start(self, first_observation: Observation) -> bool:
        """Render the prompt; False (and nothing started) when it leaves no room for a turn."""
        conversation = as_messages(first_observation)
        token_ids = self.renderer.render(conversation)
        self.conversation = conversation
        if len(token_ids) >= self.max_total_tokens:
            return False
        self.samples.append(TrajectorySample([ContextSpan(tuple(token_ids))]))
        return True

    def add_turn(self, turn: GeneratedSpan) -> str:
        """Append a sampled turn as it is; its text (what the environment reads)."""
        self.samples[-1].spans.append(turn)
        text = self.renderer.decode(turn.token_ids)
        self.conversation.append(Message("assistant", text))
        return text

    def add_observation(self, observation: Observation) -> bool:
        """Append the observation's tokens, forking if the prefix broke; False (and nothing
        added) when the result would leave no room for the next turn."""
        conversation = self.conversation + as_messages(observation)
        rendered = self.renderer.render(conversation)
        if len(rendered) >= self.max_total_tokens:  # the new sequence is `rendered`, fork or not
            return False
        prefix = self.prefix
        if rendered[: len(prefix)] == prefix:
            self.samples[-1].spans.append(ContextSpan(tuple(rendered[len(prefix) :])))
        else:
            self.samples.append(TrajectorySample([ContextSpan(tuple(rendered))]))
        self.conversation = conversation
        return True
