"""Reward functions in TRL's form: reward(prompts, completions, completion_ids, **columns) -> floats.

`task.reward` is a Hydra `_target_` that instantiates one of these (or a user's own callable). The
token-level ones are verifiable on random-weight models, which know nothing:
- TargetTokens: the share of completion tokens inside a target id range (a random model hits it
  with probability width / vocab; the policy learns to emit it more).
- CopyTail: the share of the first k completion tokens that copy the prompt's last k tokens, in
  order (reads the dataset column `prompt_token_ids`).
- CharacterShare: the share of the completion's text made of given characters (a text-level reward:
  it reads the decoded completion, so it needs a tokenizer, which the tiny models ship).
AnswerMatch is for real checkpoints: the completion's final answer (\\boxed{...}, `#### x`, or its
last number) equals the record's `answer` field (a JSONL workload's column).
"""

from __future__ import annotations

import re
from typing import Optional


class TargetTokens:
    """1/len x #{completion tokens t with low <= t < high}."""

    def __init__(self, low: int = 3, high: int = 67):
        if not 0 <= low < high:
            raise ValueError(f"TargetTokens needs 0 <= low < high, got low={low} high={high}")
        self.low, self.high = int(low), int(high)
        self.__name__ = "target_tokens"

    def __call__(self, prompts=None, completions=None, completion_ids=None, **_) -> list[float]:
        return [sum(self.low <= t < self.high for t in ids) / max(len(ids), 1) for ids in completion_ids]


class CopyTail:
    """Share of i < k with completion[i] == prompt[-k + i] (prompt ids from `prompt_token_ids`)."""

    def __init__(self, k: int = 4):
        if k < 1:
            raise ValueError(f"CopyTail needs k >= 1, got {k}")
        self.k = int(k)
        self.__name__ = "copy_tail"

    def __call__(self, prompts=None, completions=None, completion_ids=None, prompt_token_ids=None, **_) -> list[float]:
        if prompt_token_ids is None:
            raise ValueError("CopyTail needs the dataset column 'prompt_token_ids' (task=grpo provides it)")
        out = []
        for p, c in zip(prompt_token_ids, completion_ids):
            tail = list(p)[-self.k:]
            out.append(sum(a == b for a, b in zip(c[: len(tail)], tail)) / len(tail))
        return out


class CharacterShare:
    """#{characters of the completion's text in `characters`} / #{its characters} (0 for an empty text)."""

    def __init__(self, characters: str = "aeiou"):
        if not isinstance(characters, str) or not characters:
            raise ValueError(f"CharacterShare needs a non-empty string of characters, got {characters!r}")
        self.characters = frozenset(characters)
        self.__name__ = "character_share"

    def __call__(self, prompts=None, completions=None, completion_ids=None, **_) -> list[float]:
        if completions is None:
            raise ValueError("CharacterShare scores the completions' text: TRL passes it as `completions`")
        out = []
        for text in completions:
            text = text if isinstance(text, str) else text[-1]["content"]  # a chat completion: its message
            out.append(sum(ch in self.characters for ch in text) / len(text) if text else 0.0)
        return out


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> Optional[str]:
    """The last \\boxed{...}, else the text after the last '####', else the last number; None if none."""
    for pattern in (_BOXED, _HASHES, _NUMBER):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    return None


def normalise(answer) -> str:
    s = str(answer).strip().rstrip(".").replace(",", "").replace("$", "").strip()
    try:
        f = float(s)
        return str(int(f)) if f == int(f) else str(f)
    except ValueError:
        return s.lower()


class AnswerMatch:
    """1.0 when the completion's final answer equals the record's `answer` (also in #### / boxed form)."""

    def __init__(self):
        self.__name__ = "answer_match"

    def __call__(self, prompts=None, completions=None, completion_ids=None, answer=None, **_) -> list[float]:
        if answer is None:
            raise ValueError("AnswerMatch needs an 'answer' field in each JSONL record (workload=jsonl)")
        out = []
        for text, want in zip(completions, answer):
            text = text if isinstance(text, str) else text[-1]["content"]
            got = final_answer(text)
            ref = final_answer(str(want)) or str(want)
            out.append(float(got is not None and normalise(got) == normalise(ref)))
        return out
