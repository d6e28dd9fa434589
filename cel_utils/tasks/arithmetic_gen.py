"""Generate GPT-3 arithmetic items when neither the hub nor a mirror is reachable.

Items have the exact format of ``EleutherAI/arithmetic``: ``context = "Question: What is 98 plus 45?\\nAnswer:"``
and ``completion = " 143"`` (leading space, no other delimiter). Operands follow the GPT-3 data: n-digit
configs draw each operand uniformly from 0..10^n - 1; ``1dc`` draws three digits 1..9 and two operators
from + - * as ``(a op b) op c``. Results made here are marked ``"source": "generated"``.
"""
from __future__ import annotations

import random

ARITHMETIC_CONFIGS = ("arithmetic_1dc", "arithmetic_2da", "arithmetic_2dm", "arithmetic_2ds", "arithmetic_3da",
                      "arithmetic_3ds", "arithmetic_4da", "arithmetic_4ds", "arithmetic_5da", "arithmetic_5ds")

_WORDS = {"a": ("plus", lambda x, y: x + y), "s": ("minus", lambda x, y: x - y), "m": ("times", lambda x, y: x * y)}
_SYMBOLS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def _item(question: str, answer: int) -> dict:
    return {"context": f"Question: What is {question}?\nAnswer:", "completion": f" {answer}"}


def generate_arithmetic(config: str, n: int = 2000, seed: int = 0) -> list[dict]:
    """``n`` items of one config, reproducible from ``(config, seed)``."""
    if config not in ARITHMETIC_CONFIGS:
        raise ValueError(f"unknown arithmetic config {config!r}: choose from {', '.join(ARITHMETIC_CONFIGS)}")
    rng = random.Random(f"{config}:{seed}")
    code = config.removeprefix("arithmetic_")
    items = []
    for _ in range(n):
        if code == "1dc":
            a, b, c = (rng.randint(1, 9) for _ in range(3))
            op1, op2 = rng.choice("+-*"), rng.choice("+-*")
            items.append(_item(f"({a} {op1} {b}) {op2} {c}", _SYMBOLS[op2](_SYMBOLS[op1](a, b), c)))
        else:
            digits, op = int(code[0]), code[2]
            word, fn = _WORDS[op]
            x, y = rng.randrange(10**digits), rng.randrange(10**digits)
            items.append(_item(f"{x} {word} {y}", fn(x, y)))
    return items
