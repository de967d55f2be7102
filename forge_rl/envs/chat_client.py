"""An OpenAI-style chat endpoint served in process by forge_rl's generator, for agent code that
drives the model itself (verifiers environments, any agent written against `openai.AsyncOpenAI`).

    session = ChatSession(generate, renderer, limits)       # one per episode
    client = session.client()                                # an openai.AsyncOpenAI: no socket, no server
    reply = await client.chat.completions.create(model="policy", messages=[...])
    trajectory = await session.play(agent(client))           # the agent's reward closes it

`client()` is a real `openai.AsyncOpenAI` whose httpx transport (`ChatTransport`) answers
`POST /chat/completions` (streamed or not) and `GET /models` by calling the session: the
messages are rendered with the episode's renderer (the model's chat template, or the tiny
models' plain format), the turn is sampled by `generate` (`forge_rl.envs.runner.GenerateTurn`,
the same coroutine `run_episode` uses: on the real engine, the generator's `generate_turn`), and
`ChatRecorder` keeps each call's prompt ids, sampled ids, behaviour logprobs and per-token policy
versions. The reply carries the text (and, when asked, per-token logprobs), plus the ids and
versions as extra fields.

Calls are grouped into samples by their prompt prefix, as the interception designs of OpenEnv and
verifiers do: a call whose rendered prompt starts with an earlier sample's tokens (its prompts
and completions so far) continues that sample, the new part of the prompt as context; any other
call starts a new sample, all context, just as the trajectory builder forks when a chat template
re-renders history differently (`forge_rl.envs.trajectory`). The sampled ids are recorded as
`generate` returned them and never re-derived from the text the agent sends back. A plain
multi-turn agent (append the reply, append the next user message, call again) therefore gives one
sample; a template that rewrites earlier turns, or an agent that edits its history, forks.

The episode's limits (`forge_rl.envs.runner.EpisodeLimits`) answer as HTTP 400 errors whose
message names the limit, which `openai` raises as `BadRequestError` in the agent: a call past
`max_turns`, a prompt with no room left in `max_total_tokens` (code `context_length_exceeded`),
and the generator's own context being full. The episode then ends TRUNCATED_TURNS or
TRUNCATED_TOKENS, whatever the agent does next. Request fields that the generator cannot honour
(n > 1, stop sequences, sampling parameters: the policy samples with the generator's own
settings, which the behaviour logprobs must describe) are refused with a 400 naming the field,
never silently ignored. An exception from `generate` other than ContextExhausted (a lost
generator) is no answer to give the agent: the episode is cancelled and the exception propagates
to the rollout shell, as in `run_episode`.

Tools, as vLLM's OpenAI server serves them (`--tool-call-parser`): `tools` are written into the
prompt by the renderer (the chat template's `tools`), each reply is read by the renderer's
`tool_call_parser` (vLLM's own parser: `forge_rl.envs.tool_calls`), and a reply that made calls
carries `message.tool_calls` (id, type, function.name, function.arguments as JSON text), content
None when there is no other text, finish_reason "tool_calls". A call the model wrote badly is
returned as content, as vLLM returns it. The agent sends the calls back in an assistant message
and each result as a `tool` message with its `tool_call_id`; both are rendered by the template,
and the tool results are context, never trained. Whether the next call continues the sample is
the prefix rule above: the sampled ids are kept, and the template's rendering of the assistant
message with its tool_calls continues the sample when it reproduces them (a model that writes
its calls as its template does) and forks it when it does not (say, the template puts another
newline between the text and the call). Refused with a 400 naming the field: `tools` on a
renderer that cannot write them (the plain format; a template that ignores them) or with no
tool-call parser set, and `tool_choice` "required" or a named function, which vLLM serves by
constraining decoding to the call's schema: the policy's logprobs would then describe a
distribution the trainer cannot recompute.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from forge_rl.envs.chat_requests import MODEL_NAME, ChatRequest, ChatRequestError, parse_request
from forge_rl.envs.environment import Message
from forge_rl.envs.renderers import Renderer
from forge_rl.envs.runner import ContextExhausted, EpisodeLimits, GenerateTurn, SampledTurn, check_turn, turn_span
from forge_rl.envs.tool_calls import ParsedTurn
from forge_rl.envs.trajectory import ContextSpan, GeneratedSpan, Trajectory, TrajectorySample, TrajectoryStatus

BASE_URL = "http://forge-rl.invalid/v1"
"""The client's base URL. Never resolved: the transport answers every request in process (the
reserved .invalid domain makes a request that escaped it fail at once)."""


@dataclass
class ChatRecorder:
    """Every call's tokens, grouped into samples by prompt prefix (module docstring).

    Invariant: the generated spans of all samples are exactly the turns recorded, each after
    exactly the prompt it was sampled from; every other token is context."""

    samples: list[TrajectorySample] = field(default_factory=list)
    conversation: list[Message] = field(default_factory=list)
    """The longest conversation so far, as text: its messages and the reply."""
    num_calls: int = 0

    def record(
        self, prompt_token_ids: Sequence[int], turn: GeneratedSpan, messages: list[Message], reply: Message
    ) -> int:
        """Add a turn sampled after `prompt_token_ids`; the index of the sample it went into."""
        prompt = list(prompt_token_ids)
        index = self._continued(prompt)
        if index is None:
            self.samples.append(TrajectorySample([ContextSpan(tuple(prompt))]))
            index = len(self.samples) - 1
        else:
            known = self.samples[index].num_tokens
            if len(prompt) > known:
                self.samples[index].spans.append(ContextSpan(tuple(prompt[known:])))
        self.samples[index].spans.append(turn)
        self.num_calls += 1
        if len(messages) + 1 >= len(self.conversation):
            self.conversation = [*messages, reply]
        return index

    def _continued(self, prompt: list[int]) -> int | None:
        """The sample `prompt` extends (the longest, the latest among equals), or None."""
        best = None
        for index, sample in enumerate(self.samples):
            tokens = sample.token_ids
            if prompt[: len(tokens)] == tokens and (best is None or len(tokens) >= self.samples[best].num_tokens):
                best = index
        return best


class ChatActivity:
    """The model calls of one episode's sessions (one per agent; one for a single agent): how many
    are in flight, when the last began or ended, and what `generate` raised, if it did. An agent
    that goes env_step_timeout_s without a call in flight is timed out (`watch`)."""

    def __init__(self) -> None:
        self.calls_in_flight = 0
        self.last_activity_s = time.monotonic()
        self.lost: BaseException | None = None
        """What `generate` raised, other than ContextExhausted: the episode's end, raised by `play`."""
        self._changed = asyncio.Event()

    def touch(self, delta: int) -> None:
        self.calls_in_flight += delta
        self.last_activity_s = time.monotonic()
        self._changed.set()

    async def watch(self, task: asyncio.Future, timeout_s: float) -> bool:
        """Wait for `task`; True when it went `timeout_s` without a model call in flight."""
        while not task.done() and self.lost is None:
            self._changed.clear()
            timeout = None
            if self.calls_in_flight == 0:
                timeout = self.last_activity_s + timeout_s - time.monotonic()
                if timeout <= 0:
                    return True
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({task, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
        return False


class ChatSession:
    """One agent's chat endpoint in an episode: serves calls within `limits` and records them
    (module docstring). Sessions of one episode's agents share its `activity`."""

    def __init__(
        self, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits, activity: ChatActivity | None = None
    ):
        limits.require_resolved()
        self.generate, self.renderer, self.limits = generate, renderer, limits
        self.recorder = ChatRecorder()
        self.truncation: tuple[TrajectoryStatus, str] | None = None
        """The first limit the episode hit: its status and why."""
        self.activity = activity or ChatActivity()

    def client(self, **kwargs):
        """An `openai.AsyncOpenAI` served by this session in process (no retries: an error is an answer)."""
        import openai

        transport = ChatTransport(self)
        return openai.AsyncOpenAI(
            base_url=BASE_URL,
            api_key="forge-rl",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport, base_url=BASE_URL),
            **kwargs,
        )

    async def complete(self, body: Any) -> dict:
        """The chat completion for a request body (a JSON object); ChatRequestError for an HTTP error."""
        self.activity.touch(+1)
        try:
            return await self._complete(parse_request(body))
        finally:
            self.activity.touch(-1)

    async def _complete(self, request: ChatRequest) -> dict:
        limits, recorder = self.limits, self.recorder
        assert limits.max_total_tokens is not None and limits.max_tokens_per_turn is not None  # resolved in __init__
        if self.activity.lost is not None:
            raise ChatRequestError(f"the generator was lost: {self.activity.lost!r}", status=503)
        tool_request = self._tool_request(request)
        if recorder.num_calls >= limits.max_turns:
            reason = f"max_turns ({limits.max_turns}) reached: the episode had its {limits.max_turns} model calls"
            raise self._truncated(TrajectoryStatus.TRUNCATED_TURNS, reason, "max_turns_exceeded")
        try:
            # `tools` only when the request has some: a renderer may take none (`forge_rl.envs.renderers.Renderer`).
            tools = {"tools": request.tools} if request.tools else {}
            prompt = self.renderer.render(request.messages, **tools)
        except Exception as e:
            raise ChatRequestError(f"messages cannot be rendered: {type(e).__name__}: {e}", param="messages") from e
        room = limits.max_total_tokens - len(prompt)
        if room < 1:
            reason = (
                f"the prompt ({len(prompt)} tokens) leaves no room for a completion within max_total_tokens "
                f"({limits.max_total_tokens})"
            )
            raise self._truncated(TrajectoryStatus.TRUNCATED_TOKENS, reason, "context_length_exceeded")
        max_new_tokens = min(limits.max_tokens_per_turn, room, request.max_tokens or room)
        try:
            turn = await self.generate(prompt, max_new_tokens)
            check_turn(turn, max_new_tokens)  # a broken generate is the caller's bug: raised by play
        except ContextExhausted as full:
            raise self._truncated(TrajectoryStatus.TRUNCATED_TOKENS, str(full), "context_length_exceeded") from None
        except Exception as e:
            self.activity.lost = e
            raise ChatRequestError(f"the generator was lost: {e!r}", status=503) from None
        if tool_request is None:
            reply = ParsedTurn(self.renderer.decode(turn.token_ids))
        else:
            parser = self.renderer.tool_call_parser
            assert parser is not None  # _tool_request returns a request only when the renderer has a parser
            reply = parser.parse(turn.token_ids, tool_request)
        recorder.record(
            prompt, turn_span(turn), request.messages, Message("assistant", reply.content or "", reply.tool_calls)
        )
        if turn.finish_reason == "length" and max_new_tokens == room:
            reason = f"call {recorder.num_calls} used the last of max_total_tokens ({limits.max_total_tokens})"
            self._truncated(TrajectoryStatus.TRUNCATED_TOKENS, reason, None)
        return _completion_body(request, prompt, turn, reply, self._token_text)

    def _tool_request(self, request: ChatRequest) -> Any | None:
        """What the renderer's tool parser reads with each reply (vLLM's request), None when replies
        are not parsed for calls; ChatRequestError naming the field when tools cannot be served."""
        if not request.tools:
            return None
        renderer = self.renderer
        renders_tools = getattr(renderer, "renders_tools", None)
        if renders_tools is None or not renders_tools(request.tools):
            raise ChatRequestError(
                f"tools cannot be served: the renderer ({type(renderer).__name__}) does not write them into the prompt, "
                "so the model would never see them (the tiny models' plain format has no syntax for tools, and some "
                "chat templates ignore them). Use a chat model whose template renders tools, with "
                "--environment.renderer chat_template --environment.tool-call-parser hermes (the model's format).",
                param="tools",
            )
        if not request.reads_tool_calls:
            return None  # tool_choice "none": the tools are shown, the reply is text
        parser = getattr(renderer, "tool_call_parser", None)
        if parser is None:
            raise ChatRequestError(
                "tools cannot be served: no tool-call parser reads the model's calls out of its turns. Set "
                "--environment.tool-call-parser to the model's format (vLLM's --tool-call-parser names: hermes for "
                'Qwen2.5, Qwen3, Hermes), or pass tool_choice "none".',
                param="tools",
            )
        try:
            return parser.request(request.tool_fields | {"model": request.model})
        except ValueError as e:
            raise ChatRequestError(f"tools are refused by vLLM's request schema: {e}", param="tools") from None

    def _token_text(self, token_id: int) -> str:
        return self.renderer.decode([token_id])

    def _truncated(self, status: TrajectoryStatus, reason: str, code: str | None) -> ChatRequestError:
        if self.truncation is None:
            self.truncation = (status, reason)
        return ChatRequestError(reason, code=code)

    async def play(self, agent: Awaitable[float | None]) -> Trajectory:
        """Run the agent (a coroutine returning the episode's reward) to its end; the trajectory of
        its calls. Between its calls the agent may take `env_step_timeout_s` at most (ENV_TIMEOUT);
        an exception it raises ends the episode ENV_ERROR, unless a limit ended it first; after a
        limit its reward is not used (0.0, as for a truncated `run_episode`)."""
        task = asyncio.ensure_future(agent)
        ended = await run_watched(task, self.activity, self.limits.env_step_timeout_s)
        if ended is not None:
            return self.trajectory(*ended)
        error = task.exception()
        if error is not None and self.truncation is None:
            return self.trajectory(TrajectoryStatus.ENV_ERROR, f"the agent raised {type(error).__name__}: {error}")
        return self.outcome(None if error is not None else task.result())

    def outcome(self, reward: Any) -> Trajectory:
        """The trajectory of an agent that ran to its end with `reward`: the first limit it hit (its
        reward unused), else DONE with the reward, unless it made no call or its reward is not a
        finite number (ENV_ERROR)."""
        if self.truncation is not None:
            return self.trajectory(*self.truncation)
        if not self.recorder.samples:
            return self.trajectory(
                TrajectoryStatus.ENV_ERROR, "the agent made no chat completion call: nothing to train"
            )
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return self.trajectory(
                TrajectoryStatus.ENV_ERROR, f"the agent's reward ({reward!r}) is not a finite number"
            )
        return self.trajectory(TrajectoryStatus.DONE, final_reward=float(reward))

    def trajectory(self, status: TrajectoryStatus, error: str | None = None, final_reward: float = 0.0) -> Trajectory:
        recorder = self.recorder
        return Trajectory(
            samples=recorder.samples,
            status=status,
            final_reward=final_reward,
            turn_rewards=[],
            conversation=recorder.conversation,
            num_turns=recorder.num_calls,
            num_malformed_turns=0,
            env_latencies_s=[],
            error=error,
        )


async def run_watched(
    task: asyncio.Future, activity: ChatActivity, timeout_s: float
) -> tuple[TrajectoryStatus, str] | None:
    """Wait for an agent's `task` (its calls counted in `activity`): None once it ended by itself
    (its result or exception is the caller's to read), (ENV_TIMEOUT, why) when it went `timeout_s`
    without a model call in flight (it is cancelled). What `generate` raised is raised here."""
    try:
        timed_out = await activity.watch(task, timeout_s)
    except BaseException:
        task.cancel()
        raise
    if activity.lost is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise activity.lost
    if timed_out:
        task.cancel()  # not awaited: an agent that ignores cancellation must not hold the episode
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return (
            TrajectoryStatus.ENV_TIMEOUT,
            f"the agent took more than env_step_timeout_s ({timeout_s} s) between model calls",
        )
    return None


def _completion_body(request: ChatRequest, prompt: list[int], turn: SampledTurn, reply: ParsedTurn, token_text) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [call.as_openai() for call in reply.tool_calls]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        # vLLM's rule: "tool_calls" whenever calls were read, whatever stopped the turn.
        "finish_reason": "tool_calls" if reply.tool_calls else turn.finish_reason,
        "logprobs": None,
        # forge_rl's own fields: what was sampled, as recorded into the trajectory.
        "token_ids": list(turn.token_ids),
        "policy_versions": list(turn.policy_versions),
    }
    if request.logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode()), "top_logprobs": []}
                for t, lp in zip(turn.token_ids, turn.logprobs)
            ]
        }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(turn.token_ids),
            "total_tokens": len(prompt) + len(turn.token_ids),
        },
        "prompt_token_ids": prompt,
    }


def _stream_events(completion: dict, include_usage: bool) -> bytes:
    """The completion as server-sent events: one chunk with the whole reply (its text and its
    tool calls, each whole, with its index), one with the finish reason, the usage when asked,
    then [DONE] (what `openai`'s stream reader expects)."""
    choice = completion["choices"][0]
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if "tool_calls" in choice["message"]:
        delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(choice["message"]["tool_calls"])]
    reply = {"index": 0, "delta": delta, "finish_reason": None}
    reply |= {k: choice[k] for k in ("logprobs", "token_ids", "policy_versions")}
    end = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    chunks = [head | {"choices": [reply]}, head | {"choices": [end]}]
    if include_usage:
        chunks.append(head | {"choices": [], "usage": completion["usage"]})
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


class ChatTransport(httpx.AsyncBaseTransport):
    """httpx transport answering the OpenAI routes from a ChatSession, in process."""

    def __init__(self, session: ChatSession):
        self.session = session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/models"):
            return _json(
                200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "forge_rl"}]}
            )
        if request.method != "POST" or not path.endswith("/chat/completions"):
            served = "only POST /chat/completions and GET /models"
            return _json(404, ChatRequestError(f"{request.method} {path} is not served: {served}", status=404).body())
        try:
            body = json.loads(await request.aread() or b"null")
        except json.JSONDecodeError as e:
            return _json(400, ChatRequestError(f"the request body is not JSON: {e}").body())
        try:
            completion = await self.session.complete(body)
        except ChatRequestError as error:
            return _json(error.status, error.body())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = _stream_events(completion, include_usage)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events)
        return _json(200, completion)


def _json(status: int, body: dict) -> httpx.Response:
    return httpx.Response(status, headers={"content-type": "application/json"}, content=json.dumps(body).encode())


class ChatAgentEnvironment:
    """Agent code written against `openai.AsyncOpenAI`, as a forge_rl environment: `agent(client)`
    is a coroutine that talks to the model through `client` and returns the episode's reward.
    The rollout plays it with `play` (`forge_rl.envs.rollout.play_episode`) instead of
    reset/step: the agent drives, each of its calls is a turn.

        async def agent(client):
            reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "37*52="}])
            return float(reply.choices[0].message.content == "1924")

        make_env = lambda seed, index: ChatAgentEnvironment(agent)
    """

    def __init__(self, agent: Callable[[Any], Awaitable[float | None]]):
        self.agent = agent

    async def play(self, generate: GenerateTurn, renderer: Renderer, limits: EpisodeLimits) -> Trajectory:
        session = ChatSession(generate, renderer, limits)
        client = session.client()
        try:
            return await session.play(self.agent(client))
        finally:
            await client.close()
