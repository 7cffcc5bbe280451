"""Text in and out: prompts as text or chat messages, decoded completions, stop strings.

The engine itself runs token ids; this module is the only place that calls the tokenizer.
Stop strings are matched on the text of the generated tokens, decoded incrementally: each new
token decodes a few tokens of context (so a token's leading space or a multi-byte character that
spans tokens comes out right), and only the tail of the text that a new match could end in is
searched, so a step costs the same however long the completion is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from flexgemma.engine.sequence import CompletionOutput

_CONTEXT = 4  # tokens decoded before a new one, for tokenizers whose text depends on its neighbours
_INCOMPLETE = "\ufffd"  # what a token cut inside a UTF-8 character decodes to


def is_chat(prompt) -> bool:
    """A list of chat messages ({"role": ..., "content": ...})."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def is_text_prompt(prompt) -> bool:
    return isinstance(prompt, str) or is_chat(prompt)


def text_problem(text: str) -> Optional[str]:
    """Why `text` cannot be tokenised (None: it can): a lone surrogate is no Unicode character, and
    the tokenizer would fail the whole call on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"holds a lone surrogate {text[e.start]!r} at character {e.start}: not valid Unicode (decode the "
                "source with errors='replace', or fix it)")
    return None


def _content_texts(content) -> Optional[list[str]]:
    """The strings of a message's content: a string, or a list of content parts ({"type": "text",
    "text": ...}); None when it is neither."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and content and all(isinstance(p, Mapping) for p in content):
        return [p["text"] for p in content if isinstance(p.get("text"), str)]
    return None


def messages_problem(messages) -> Optional[str]:
    """What is wrong with a list of chat messages (None: nothing), naming the message's index and field:
    a chat template would render None or 123 as text without a word."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not {"role", "content"} <= set(m):
            return f"chat message {i} ({m!r:.80}) needs a 'role' and a 'content'"
        if not isinstance(m["role"], str):
            return f"chat message {i}: 'role' is {m['role']!r:.40} ({type(m['role']).__name__}), not a string like 'user'"
        texts = _content_texts(m["content"])
        if texts is None:
            return (f"chat message {i}: 'content' is {m['content']!r:.40} ({type(m['content']).__name__}), not a "
                    "string (or a list of content parts)")
        for field, text in [("role", m["role"])] + [("content", t) for t in texts]:
            problem = text_problem(text)
            if problem:
                return f"chat message {i}: '{field}' {problem}"
    return None


def encode_prompt(tokenizer, prompt) -> tuple[Optional[list[int]], Optional[str]]:
    """(token ids, None) for a text or chat prompt, or (None, why not)."""
    if tokenizer is None:
        got = "str" if isinstance(prompt, str) else "chat messages"
        return None, (f"prompt must be a list of token ids (ints), got {got}: this model has no tokenizer (for text "
                      "prompts give model.path a checkpoint directory with tokenizer.json, or pass tokenizer= to "
                      "Engine.from_model)")
    if isinstance(prompt, str):
        problem = text_problem(prompt)
        return (None, f"prompt text {problem}") if problem else (list(tokenizer(prompt)["input_ids"]), None)
    if getattr(tokenizer, "chat_template", None) is None:
        return None, "chat messages need a tokenizer with a chat template (tokenizer_config.json chat_template)"
    problem = messages_problem(prompt)
    if problem:
        return None, problem
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids], None


def prompt_text(tokenizer, prompt) -> Optional[str]:
    if isinstance(prompt, str):
        return prompt
    if is_chat(prompt) and tokenizer is not None:
        return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    return None


def decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


class StopMatcher:
    """Decodes a completion token by token and finds the first stop string in its text."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.longest = max(len(s) for s in stop)
        self.ids: list[int] = []
        self.read = 0  # tokens whose text is in self.text
        self.text = ""
        self.match: Optional[tuple[int, str]] = None  # (where in text the stop string starts, which)

    def matched(self, generated: list[int]) -> bool:
        """Takes the tokens of `generated` not seen yet; True once a stop string has appeared."""
        for tok in generated[len(self.ids):]:
            self.ids.append(tok)
            if self.match is None:
                self._add_text()
        return self.match is not None

    def _add_text(self) -> None:
        start = max(0, self.read - _CONTEXT)
        before = decode(self.tokenizer, self.ids[start:self.read])
        after = decode(self.tokenizer, self.ids[start:])
        if after.endswith(_INCOMPLETE) and len(self.ids) - self.read < _CONTEXT:
            return  # a character cut between tokens: wait (a few tokens at most) for its next bytes
        new = after[len(before):]
        self.read = len(self.ids)
        tail_from = max(0, len(self.text) - self.longest + 1)  # a match ending in `new` starts here at the earliest
        self.text += new
        tail = self.text[tail_from:]
        hits = [(tail.find(s), s) for s in self.stop if s in tail]
        if hits:
            at, s = min(hits)
            self.match = (tail_from + at, s)

    def final_text(self, include_stop: bool) -> str:
        at, s = self.match
        return self.text[:at + (len(s) if include_stop else 0)]


def completion_text(tokenizer, seq, completion: CompletionOutput) -> CompletionOutput:
    """Fills completion.text (and stop_reason when a stop string ended it)."""
    m = seq.stop_matcher
    if m is not None and m.match is not None and completion.finish_reason == "stop":
        completion.text = m.final_text(seq.params.include_stop_str_in_output)
        completion.stop_reason = m.match[1]
    else:
        completion.text = decode(tokenizer, completion.token_ids)
    return completion
