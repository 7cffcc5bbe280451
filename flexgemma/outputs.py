"""outputs_to_dataset: a generate() call's rollouts as a table, one row per completion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union


def output_rows(outputs) -> list[dict]:
    """One dict per completion of every RequestOutput (n completions give n rows)."""
    rows = []
    for out in outputs:
        completions = out.outputs or []
        if not completions:  # an invalid request's output: one row with its error
            rows.append(_row(out, 0, out.token_ids, out.logprobs, out.finish_reason, out.text))
        for c in completions:
            rows.append(_row(out, c.index, c.token_ids, c.logprobs, c.finish_reason, c.text))
    return rows


def _row(out, index: int, token_ids, logprobs, finish_reason, text) -> dict:
    return {"request_index": out.index, "completion_index": index, "prompt": out.prompt,
            "prompt_token_ids": list(out.prompt_token_ids), "text": text, "token_ids": list(token_ids),
            "logprobs": [float(x) for x in logprobs], "finish_reason": finish_reason, "error": out.error}


def outputs_to_dataset(outputs, path: Optional[Union[str, Path]] = None):
    """The rows of `outputs` (see output_rows) as a datasets.Dataset when the `datasets` package is
    installed, else as the list of dicts. With `path`, writes them as JSONL there and returns the path."""
    rows = output_rows(outputs)
    if path is not None:
        path = Path(path)
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return path
    try:
        import datasets
    except ImportError:
        return rows
    return datasets.Dataset.from_list(rows)
