"""Benchmark workloads: seeded, offline generators of request sessions.

A workload is a list of ``Session``s. A session is one or more ``Turn``s sent in order, one request
each; a turn goes out only after the previous turn's reply and its think time. Only ``multi-turn``
has sessions of several turns. Lengths are in tokens, approximately: text is drawn from ``WORDS``
(about one token per word) plus a few tokens of formatting.

Each workload has a natural size (``groups * prompts_per_group`` for ``shared-prefix``, ...). Asked
for more requests, its structure repeats with fresh text (more problems, more questions, more
sessions); the shared blocks (group system prompts, subject example blocks, the tree's prefix) stay
the same. Same parameters and seed, same sessions, on every machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from radixrelay.bench.words import WORDS


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int
    think_time: float = 0.0     # seconds between the previous turn's reply and this turn


@dataclass(frozen=True)
class Session:
    label: str                  # the shared structure it belongs to: "group-2", "problem-5", ...
    system: str | None
    turns: tuple[Turn, ...]


class Workload(Protocol):
    def natural_size(self) -> int: ...
    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]: ...


def words(rng: np.random.Generator, n: int) -> str:
    """About ``n`` tokens of text: ``n`` words drawn uniformly from ``WORDS``."""
    return " ".join(rng.choice(WORDS, size=max(n, 0)).tolist())


_TOKEN_PATTERN = re.compile(r"\w+|[^\w\s]")


def estimate_tokens(text: str) -> int:
    """A tokenizer-free token count: words and punctuation marks (close for English prose)."""
    return len(_TOKEN_PATTERN.findall(text))


def _validate(obj: object, *at_least_one: str) -> None:
    """Every number of ``obj`` (a workload dataclass) >= 0; those named >= 1."""
    for field in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, field.name)
        low = 1 if field.name in at_least_one else 0
        if isinstance(value, (int, float)) and not value >= low:
            raise ValueError(f"{field.name} must be >= {low}, got {value}")


def _single(label: str, system: str | None, user: str, max_tokens: int) -> Session:
    return Session(label, system, (Turn(user, max_tokens),))


# -- workloads ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedPrefix:
    """``groups`` long system prompts, each shared by ``prompts_per_group`` different questions;
    requests of all groups arrive interleaved (seeded shuffle)."""
    groups: int = 8
    prompts_per_group: int = 16
    system_len: int = 1024
    question_len: int = 64
    output_len: int = 128

    def __post_init__(self) -> None:
        _validate(self, "groups", "prompts_per_group", "output_len")

    def natural_size(self) -> int:
        return self.groups * self.prompts_per_group

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        systems = [words(rng, self.system_len) for _ in range(self.groups)]
        sessions = []
        for i in range(num_requests):
            group = (i // self.prompts_per_group) % self.groups
            sessions.append(_single(f"group-{group}", systems[group],
                                    words(rng, self.question_len), self.output_len))
        return [sessions[i] for i in rng.permutation(num_requests)]


@dataclass(frozen=True)
class ShareGPTLike:
    """Single chat turns with ShareGPT's length profile: prompt and output lengths drawn from
    log-normal distributions whose means default to ShareGPT's published averages (161 prompt and
    338 output tokens, vLLM paper, Kwon et al. 2023), clipped to [min_len, max_*]. With ``path``, a
    local ShareGPT JSON file gives the prompts instead (the first human turn of each
    conversation; output length: the first reply's estimated token count)."""
    input_mean: float = 161.0
    output_mean: float = 338.0
    sigma: float = 1.0
    min_len: int = 4
    max_input: int = 1024
    max_output: int = 1024
    path: str | None = None

    def __post_init__(self) -> None:
        _validate(self, "min_len", "max_input", "max_output")
        if self.min_len > min(self.max_input, self.max_output):
            raise ValueError("min_len must be <= max_input and max_output")

    def natural_size(self) -> int:
        return 100

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        if self.path is not None:
            return self._from_file(Path(self.path), num_requests, rng)
        inputs = self._lognormal(rng, self.input_mean, self.max_input, num_requests)
        outputs = self._lognormal(rng, self.output_mean, self.max_output, num_requests)
        return [_single("sharegpt", None, words(rng, int(n_in)), int(n_out))
                for n_in, n_out in zip(inputs, outputs)]

    def _lognormal(self, rng: np.random.Generator, mean: float, cap: int, n: int) -> np.ndarray:
        mu = math.log(max(mean, 1.0)) - self.sigma ** 2 / 2      # so that E[X] = mean
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, size=n)), self.min_len, cap)

    def _from_file(self, path: Path, n: int, rng: np.random.Generator) -> list[Session]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read ShareGPT file {path}: {exc}") from None
        pairs = []
        for item in data if isinstance(data, list) else []:
            turns = item.get("conversations") if isinstance(item, dict) else None
            if not isinstance(turns, list) or len(turns) < 2 or not all(
                    isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
                continue
            prompt, reply = turns[0]["value"], turns[1]["value"]
            n_in, n_out = estimate_tokens(prompt), estimate_tokens(reply)
            if self.min_len <= n_in <= self.max_input and n_out >= self.min_len:
                pairs.append((prompt, min(n_out, self.max_output)))
        if not pairs:
            raise ValueError(f"{path}: no usable conversations (a JSON list of "
                             "{'conversations': [{'from', 'value'}, ...]} is expected)")
        picks = rng.choice(len(pairs), size=n, replace=n > len(pairs))
        return [_single("sharegpt", None, *pairs[i]) for i in picks]


@dataclass(frozen=True)
class MultiTurn:
    """Chat sessions of ``turns`` turns over one system prompt each; every turn sends the whole
    history so far (the server's real replies included) plus a new user message. Sessions start
    by the arrival process; think times between turns are exponential with mean ``think_time``.
    With ``history_len`` > 0, each session's first user message starts with a document of
    ``history_len`` tokens (its own text), so that histories are long from the second turn on:
    the benchmark of KV tiers, where many sessions' KV exceeds GPU memory (e.g. ``sessions=64
    turns=4 history_len=4000``: every later turn has a history of 4K+ tokens)."""
    sessions: int = 16
    turns: int = 4
    system_len: int = 256
    turn_len: int = 64
    output_len: int = 64
    think_time: float = 1.0
    history_len: int = 0

    def __post_init__(self) -> None:
        _validate(self, "sessions", "turns", "output_len")

    def natural_size(self) -> int:
        return self.sessions * self.turns

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        sessions = []
        for start in range(0, num_requests, self.turns):
            # no draw for the document without one: history_len=0 gives the same text as ever
            document = f"{words(rng, self.history_len)}\n\n" if self.history_len else ""
            turns = tuple(
                Turn((document if k == 0 else "") + words(rng, self.turn_len), self.output_len,
                     float(rng.exponential(self.think_time)) if k and self.think_time else 0.0)
                for k in range(min(self.turns, num_requests - start)))
            sessions.append(Session(f"session-{len(sessions)}", words(rng, self.system_len), turns))
        return sessions


@dataclass(frozen=True)
class FewShot:
    """MMLU-style k-shot multiple choice: each of ``subjects`` has one block of ``shots`` worked
    examples shared by all its questions; requests of all subjects interleave."""
    subjects: int = 4
    questions_per_subject: int = 32
    shots: int = 5
    example_len: int = 64
    question_len: int = 48
    output_len: int = 4

    def __post_init__(self) -> None:
        _validate(self, "subjects", "questions_per_subject", "output_len")

    def natural_size(self) -> int:
        return self.subjects * self.questions_per_subject

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        blocks = []
        for _ in range(self.subjects):
            header = ("The following are multiple choice questions (with answers) about "
                      f"{words(rng, 2)}.\n\n")
            blocks.append(header + "".join(
                self._question(rng, self.example_len) + f" {'ABCD'[int(rng.integers(4))]}\n\n"
                for _ in range(self.shots)))
        sessions = []
        for i in range(num_requests):
            subject = (i // self.questions_per_subject) % self.subjects
            sessions.append(_single(f"subject-{subject}", None,
                                    blocks[subject] + self._question(rng, self.question_len),
                                    self.output_len))
        return [sessions[i] for i in rng.permutation(num_requests)]

    @staticmethod
    def _question(rng: np.random.Generator, length: int) -> str:
        # ~16 tokens of choices and formatting around the question's words
        choices = "".join(f"\n{letter}. {words(rng, 2)}" for letter in "ABCD")
        return f"Question: {words(rng, length - 16)}{choices}\nAnswer:"


@dataclass(frozen=True)
class Tree:
    """Tree-shaped sharing (e.g. best-of-n reasoning): one few-shot prefix shared by every
    request, ``problems`` problems under it, and ``samples`` requests per problem sent together
    (consecutive arrivals)."""
    problems: int = 8
    samples: int = 4
    prefix_len: int = 512
    problem_len: int = 128
    output_len: int = 128

    def __post_init__(self) -> None:
        _validate(self, "problems", "samples", "output_len")

    def natural_size(self) -> int:
        return self.problems * self.samples

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        prefix = words(rng, self.prefix_len)
        sessions: list[Session] = []
        for problem in range(math.ceil(num_requests / self.samples)):
            text = f"{prefix}\n\nProblem: {words(rng, self.problem_len)}\nSolution:"
            count = min(self.samples, num_requests - len(sessions))
            sessions.extend(_single(f"problem-{problem}", None, text, self.output_len)
                            for _ in range(count))
        return sessions


@dataclass(frozen=True)
class Random:
    """Unrelated prompts: lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        _validate(self, "output_len")
        if self.range_ratio >= 1:
            raise ValueError("range_ratio must be in [0, 1)")

    def natural_size(self) -> int:
        return 100

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        def lengths(mean: int) -> np.ndarray:
            low, high = mean * (1 - self.range_ratio), mean * (1 + self.range_ratio)
            return np.maximum(np.rint(rng.uniform(low, high, size=num_requests)), 1).astype(int)

        inputs, outputs = lengths(self.input_len), lengths(self.output_len)
        return [_single("random", None, words(rng, int(a)), int(b)) for a, b in zip(inputs, outputs)]


@dataclass(frozen=True)
class MultiTenant:
    """``tenants`` tenants, each with its own long context (a system prompt of ``context_len`` tokens),
    asked questions one at a time: each request's tenant is drawn by Zipf popularity (tenant k with
    weight 1 / (k + 1) ** ``zipf``), so a few tenants are hot and many are cold. Across replicas behind
    a router, what decides throughput is whether a tenant's questions reach the replica holding its
    context (the workload's label is the tenant)."""
    tenants: int = 150
    context_len: int = 6000
    question_len: int = 64
    output_len: int = 128
    zipf: float = 1.1

    def __post_init__(self) -> None:
        _validate(self, "tenants", "output_len")

    def natural_size(self) -> int:
        return 4 * self.tenants

    def popularity(self) -> np.ndarray:
        weights = 1.0 / np.arange(1, self.tenants + 1) ** self.zipf
        return weights / weights.sum()

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        contexts = [f"Tenant {t}. " + words(rng, self.context_len) for t in range(self.tenants)]
        picks = rng.choice(self.tenants, size=num_requests, p=self.popularity())
        return [_single(f"tenant-{t}", contexts[t], words(rng, self.question_len), self.output_len)
                for t in picks.tolist()]


@dataclass(frozen=True)
class Agent:
    """Agent sessions over one tool-schema system prompt of ``schema_len`` tokens that every session
    shares (the tools an agent framework sends with each call). A session's first turn is its task; each
    later turn appends the model's previous reply (its tool call, ``call_len`` tokens out) and a tool
    result of ``result_len`` tokens, after a tool latency exponential with mean ``tool_time`` seconds, so
    later turns resend a growing history whose prefix the cache holds. Sessions start by the arrival
    process."""
    sessions: int = 32
    turns: int = 6
    schema_len: int = 6000
    task_len: int = 120
    result_len: int = 300
    call_len: int = 48
    tool_time: float = 0.5

    def __post_init__(self) -> None:
        _validate(self, "sessions", "turns", "call_len")

    def natural_size(self) -> int:
        return self.sessions * self.turns

    def generate(self, num_requests: int, rng: np.random.Generator) -> list[Session]:
        schema = "You can call these tools; answer with one call at a time.\n" + words(rng, self.schema_len)
        sessions = []
        for start in range(0, num_requests, self.turns):
            turns = tuple(
                Turn(f"Task: {words(rng, self.task_len)}" if k == 0
                     else f"<tool_response>\n{words(rng, self.result_len)}\n</tool_response>",
                     self.call_len, float(rng.exponential(self.tool_time)) if k and self.tool_time else 0.0)
                for k in range(min(self.turns, num_requests - start)))
            sessions.append(Session(f"agent-{len(sessions)}", schema, turns))
        return sessions


WORKLOADS: dict[str, type] = {
    "shared-prefix": SharedPrefix, "sharegpt-like": ShareGPTLike, "multi-turn": MultiTurn,
    "few-shot": FewShot, "tree": Tree, "random": Random, "multi-tenant": MultiTenant, "agent": Agent,
}


def make_workload(name: str, params: dict[str, str]) -> Workload:
    """The workload ``name`` with ``params`` (strings, from ``--param KEY=VALUE``) converted to
    its fields' types; unknown names and keys raise ValueError listing the valid ones."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name]
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, text in params.items():
        field = key.replace("-", "_")
        if field not in hints:
            raise ValueError(f"workload {name!r} has no parameter {key!r}; "
                             f"its parameters: {', '.join(hints)}")
        kind = hints[field]
        try:
            values[field] = int(text) if kind is int else float(text) if kind is float else text
        except ValueError:
            raise ValueError(f"parameter {key!r} of {name!r}: {text!r} is not a valid "
                             f"{kind.__name__}") from None
    return cls(**values)


def describe_workloads() -> str:
    """One line per workload: its name and parameters with defaults (for ``--help``)."""
    lines = []
    for name, cls in WORKLOADS.items():
        fields = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))
        lines.append(f"  {name}: {fields}")
    return "\n".join(lines)
