"""The lora_grpo recipe's rewards, as TRL's GRPOTrainer calls them: ``reward(completions, answer=[...], **columns)``
returns one float per completion (a completion is a string, or chat messages whose last turn is the answer given).

- `correct_answer`: 1.0 when the completion is the answer exactly (surrounding spaces ignored); otherwise half the
  share of the answer's characters it has at their positions, so a nearly right sum earns something to climb on.
- `answer_format`: an answer is digits only: 0.5 when the completion is 1-3 digits and nothing else (a sum of two
  numbers below 100 has at most 3), otherwise 0.25 x the share of its characters that are digits.
"""

from __future__ import annotations


def _text(completion) -> str:
    if isinstance(completion, list):  # chat messages: the assistant's turn
        return completion[-1]["content"] if completion else ""
    return completion


def correct_answer(completions, answer, **kwargs) -> list[float]:
    out = []
    for completion, want in zip(completions, answer):
        got = _text(completion).strip()
        if got == want:
            out.append(1.0)
        else:
            hits = sum(a == b for a, b in zip(got, want))
            out.append(0.5 * hits / max(len(want), len(got), 1))
    return out


def answer_format(completions, **kwargs) -> list[float]:
    out = []
    for completion in completions:
        text = _text(completion).strip()
        if text.isdigit() and len(text) <= 3:
            out.append(0.5)
        else:
            out.append(0.25 * sum(c.isdigit() for c in text) / max(len(text), 1))
    return out


REWARDS = (correct_answer, answer_format)
