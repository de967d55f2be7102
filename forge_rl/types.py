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

Lengths: for each completion, `token_ids`, `logprobs` and `policy_versions` all have the same
length (the number of generated tokens, EOS included when it was sampled).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.policy_versions)):
            raise ValueError(
                f"Completion fields disagree in length: token_ids={len(self.token_ids)}, "
                f"logprobs={len(self.logprobs)}, policy_versions={len(self.policy_versions)}"
            )

    @property
    def oldest_policy_version(self) -> int:
        """The version that bounds this completion's staleness (its oldest token)."""
        return min(self.policy_versions) if self.policy_versions else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Episode:
    """A prompt and its group of completions (the GRPO unit: advantages are normalized per group)."""

    episode_id: int
    """Unique id of the prompt hand-out, for accounting (trained once, or dropped with a reason)."""
    prompt_text: str
    answer: str
    """What the verifier compares against."""
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    forced_length: int | None = None
    """When set, every completion is generated exactly this long (EOS ignored): how a task imposes
    a completion-length distribution, e.g. the long tail of the async-vs-sync benchmark."""

    @property
    def oldest_policy_version(self) -> int:
        return min(c.oldest_policy_version for c in self.completions)

    @property
    def newest_policy_version(self) -> int:
        return max(max(c.policy_versions, default=0) for c in self.completions)

    @property
    def num_generated_tokens(self) -> int:
        return sum(c.num_tokens for c in self.completions)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]
