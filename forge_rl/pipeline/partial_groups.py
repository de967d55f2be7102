"""Groups generated a segment at a time and not yet finished (`PartialGroup`): what a dead
generator leaves for a live one to continue (`generator.segment_tokens`), and what a checkpoint
holds of them for a resume to continue, with the checks a resume makes before it takes them."""

from __future__ import annotations

import dataclasses

from forge_rl.types import Completion, completion_from_dict, completion_to_dict


@dataclasses.dataclass
class PartialGroup:
    """A group generated a segment at a time (`Rollouts._generate_in_segments`): its completions
    so far and which of them are finished."""

    completions: list[Completion]
    finished: list[bool]
    after_resume: bool = False
    """Restored from a checkpoint (`Rollouts.load_state_dict`), not left by a dead generator."""

    def to_dict(self, episode_id: int) -> dict:
        """Plain lists and numbers (`forge_rl.core.checkpoint.ControllerState.partial_groups`)."""
        return {
            "episode_id": episode_id,
            "completions": [completion_to_dict(c) for c in self.completions],
            "finished": list(self.finished),
        }

    @classmethod
    def from_dict(cls, data: dict) -> PartialGroup:
        """Inverse of `to_dict`, as restored: `after_resume`."""
        completions = [completion_from_dict(c) for c in data["completions"]]
        if len(completions) != len(data["finished"]):
            raise ValueError(f"{len(completions)} completions but {len(data['finished'])} finished flags")
        return cls(completions, [bool(done) for done in data["finished"]], after_resume=True)


def restored_partial_groups(
    saved: list[dict],
    reissue: list[int],
    vocab_size: int | None = None,
    saved_tokenizer: str | None = None,
    tokenizer: str | None = None,
) -> dict[int, PartialGroup]:
    """A checkpoint's partial groups (`ControllerState.partial_groups`) by prompt, to be continued
    by a run whose model has `vocab_size` token ids and whose tokenizer's fingerprint is
    `tokenizer` (`forge_rl.tasks.tokenizer`). ValueError saying why not: they were sampled under
    another tokenizer, or a group is malformed, holds a token id outside the vocabulary, or has a
    prompt the checkpoint does not re-issue (naming the group)."""
    if saved and None not in (saved_tokenizer, tokenizer) and saved_tokenizer != tokenizer:
        raise ValueError(
            f"its {len(saved)} partial groups were sampled under another tokenizer (fingerprint {saved_tokenizer}; "
            f"the model directory's is {tokenizer}), so their token ids would not continue these prompts"
        )
    reissued, groups = set(reissue), {}
    for number, data in enumerate(saved):
        try:
            episode_id = int(data["episode_id"])
            if episode_id not in reissued:
                raise ValueError(f"its prompt {episode_id} is not among the checkpoint's prompts to re-issue")
            group = PartialGroup.from_dict(data)
            for completion in group.completions:
                lengths = {len(completion.token_ids), len(completion.logprobs), len(completion.policy_versions)}
                if len(lengths) != 1:
                    raise ValueError("a completion's token_ids, logprobs and policy_versions differ in length")
                outside = [t for t in completion.token_ids if vocab_size is not None and not 0 <= t < vocab_size]
                if outside and vocab_size is not None:  # ids lie outside a known vocabulary only
                    raise ValueError(f"token id {outside[0]} is outside the model's vocabulary (0 to {vocab_size - 1})")
            groups[episode_id] = group
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"partial group {number} is malformed ({type(e).__name__}: {e})") from None
    return groups


def partial_groups_problem(
    saved: list[dict], reissue: list[int], vocab_size: int, saved_tokenizer: str | None, tokenizer: str | None
) -> str | None:
    """Why `restored_partial_groups` refuses these groups, or None when it takes them: what a
    resume checks before anything starts (`forge_rl.run.run_dir`)."""
    try:
        restored_partial_groups(saved, reissue, vocab_size, saved_tokenizer, tokenizer)
    except ValueError as e:
        return str(e)
    return None


def saved_partial_tokens(saved: list[dict]) -> int:
    """The token ids a checkpoint's partial groups hold, counting what can be read of malformed ones."""

    def count(completion) -> int:
        token_ids = completion.get("token_ids") if isinstance(completion, dict) else None
        return len(token_ids) if isinstance(token_ids, list) else 0

    return sum(
        count(c)
        for group in saved
        if isinstance(group, dict) and isinstance(group.get("completions"), list)
        for c in group["completions"]
    )
