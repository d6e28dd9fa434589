"""Turn task items into tokenized requests, in the ``plain`` or ``chat`` prompt format.

``plain`` is lm-eval's format: an optional description, then exemplars ``text + answer`` joined by the task's few-shot
delimiter (lm-eval's default ``"\\n\\n"``), then the item's text; the
answer continues the prompt directly (its delimiter is part of the answer string). Like lm-eval, a BOS token starts the
prompt when the tokenizer adds one by default (:func:`resolve_bos`; the ``bos`` run setting overrides it); trailing spaces of the context move to the continuation and
the pair is tokenized as one string (lm-eval's ``_encode_pair``).

``chat`` wraps the same content in the model's chat template: each exemplar becomes a user turn and an
assistant turn (lm-eval's ``fewshot_as_multiturn``), the item a final user turn, and the answer (without
its leading space) is what the assistant says. SmolLM3 and other reasoning models are asked for their
non-thinking mode (``enable_thinking=False``).

Tokenization happens once per run; the evaluators only ever see token ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cel_utils.tasks.specs import Item, TaskSpec

FORMATS = ("plain", "chat")


@dataclass(frozen=True)
class Request:
    """A scored item: one context and the continuations whose log-likelihoods decide it."""

    item_id: str
    context: tuple[int, ...]
    continuations: tuple[tuple[int, ...], ...]  # one for greedy-match tasks, one per choice otherwise
    gold: int
    choice_chars: tuple[int, ...]  # length in characters of each choice (without delimiter), for acc_norm
    # (lm-eval's convention)
    prompt: str
    answers: tuple[str, ...]

    @property
    def n_tokens(self) -> int:
        """Prompt and answer tokens (a cost unit for reports)."""
        return len(self.context) + sum(map(len, self.continuations))


@dataclass(frozen=True)
class GenRequest:
    """A generation item (MBPP): a context to continue greedily, and the tests the result must pass."""

    item_id: str
    context: tuple[int, ...]
    prompt: str
    stop: str | None
    tests: tuple[str, ...]
    setup: str
    prefix: str  # text already in the context that belongs to the answer (the chat variant's code fence)
    doc: dict | None = field(default=None, repr=False, compare=False)  # the row, for a task's own generation scorer

    @property
    def n_tokens(self) -> int:
        """Prompt tokens (what is generated is not known beforehand)."""
        return len(self.context)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown prompt format {fmt!r}: choose 'plain' (lm-eval prompts) or 'chat' (chat template)")


BOS_POLICIES = ("auto", "always", "never")


def resolve_bos(tokenizer, policy: str = "auto") -> bool:
    """Whether plain prompts start with the BOS token: ``auto`` does what the tokenizer does by default (its
    ``add_special_tokens``), as lm-evaluation-harness does: Llama-3.x and Gemma add one, SmolLM2 and Qwen do not."""
    if policy not in BOS_POLICIES:
        raise ValueError(f"unknown bos policy {policy!r}: choose from {', '.join(BOS_POLICIES)}")
    if policy != "auto" or not tokenizer.bos_token:
        return policy == "always" and bool(tokenizer.bos_token)
    with_special = tokenizer("a", add_special_tokens=True).input_ids
    return bool(with_special) and with_special[0] == tokenizer.bos_token_id != tokenizer("a", add_special_tokens=False).input_ids[0]


def _texts(task: TaskSpec, doc: dict, fmt: str) -> tuple[str, str]:
    if fmt == "chat" and task.chat_doc_to_text is not None:
        return task.chat_doc_to_text(doc), task.chat_doc_to_target(doc)
    return task.doc_to_text(doc), task.doc_to_target(doc)


def render_context(task: TaskSpec, doc: dict, fewshot: list[Item], fmt: str, tokenizer, bos: bool = False) -> str:
    """The full prompt text for one item, exemplars included; ``bos`` starts a plain prompt with the BOS token (a chat
    template writes its own)."""
    _check_format(fmt)
    if fmt == "plain":
        shots = [task.exemplar(ex.doc) for ex in fewshot]
        description = task.description(doc) if callable(task.description) else task.description
        text = description + task.fewshot_delimiter.join(shots + [task.doc_to_text(doc)])
        return (tokenizer.bos_token + text) if bos else text
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt format 'chat' needs a tokenizer with a chat template; this model has none, use 'plain'")
    messages = []
    for ex in fewshot:
        user, answer = _texts(task, ex.doc, fmt)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.lstrip(" ")}]
    messages.append({"role": "user", "content": _texts(task, doc, fmt)[0]})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return text + task.chat_prefix  # a generation task's opening of the answer (a code fence); "" for the others


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_pair(tokenizer, context: str, continuation: str, moved: str | None = " ") -> tuple[list[int], list[int]]:
    """lm-eval's pairing: move the context's trailing spaces (the characters in ``moved``; None: any whitespace, as
    lm-eval 0.4.13 does) into the continuation, tokenize the whole."""
    n_spaces = len(context) - len(context.rstrip(moved))
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = _encode(tokenizer, context + continuation)
    context_ids = _encode(tokenizer, context)
    return context_ids, whole[len(context_ids):]


def build_requests(task: TaskSpec, items: list[Item], fewshot: list[Item], tokenizer, fmt: str = "plain",
                   bos: bool = False) -> list[Request]:
    """Tokenized log-likelihood requests for a greedy-match or multiple-choice task."""
    requests = []
    for item in items:
        context = render_context(task, item.doc, fewshot, fmt, tokenizer, bos)
        choices, gold = task.answers(item.doc)
        if fmt == "chat":  # the assistant's turn starts fresh: no delimiter, no leading space
            answers = [c.lstrip(" ") for c in choices]
            context_ids = _encode(tokenizer, context)
            continuations = [_encode(tokenizer, a) for a in answers]
        else:
            answers = [task.target_delimiter + c for c in choices]
            pairs = [encode_pair(tokenizer, context, a, task.moved_whitespace) for a in answers]
            context_ids = pairs[0][0]
            continuations = [cont for _, cont in pairs]
        if not context_ids or not all(continuations):
            raise ValueError(f"{task.name} item {item.id}: empty context or answer after tokenization")
        requests.append(Request(item_id=item.id, context=tuple(context_ids), continuations=tuple(map(tuple, continuations)),
                                gold=gold, choice_chars=tuple(len(c) for c in choices), prompt=context,
                                answers=tuple(answers)))
    return requests


def reference_requests(task: TaskSpec, items: list[Item], fewshot: list[Item], tokenizer, fmt: str = "plain",
                       bos: bool = False) -> list[Request]:
    """A generation task's reference solutions as teacher-forced requests: the prompt the model continues, and the
    reference answer as its one continuation (what attribution screens a generation task by)."""
    requests = []
    for item in items:
        context = render_context(task, item.doc, fewshot, fmt, tokenizer, bos)
        answer = _texts(task, item.doc, fmt)[1].removeprefix(task.chat_prefix if fmt == "chat" else "")
        context_ids, continuation = (encode_pair(tokenizer, context, answer, task.moved_whitespace) if fmt == "plain"
                                     else (_encode(tokenizer, context), _encode(tokenizer, answer)))
        requests.append(Request(item_id=item.id, context=tuple(context_ids), continuations=(tuple(continuation),),
                                gold=0, choice_chars=(len(answer),), prompt=context, answers=(answer,)))
    return requests


def build_gen_requests(task: TaskSpec, items: list[Item], fewshot: list[Item], tokenizer, fmt: str = "plain",
                       bos: bool = False) -> list[GenRequest]:
    """Tokenized generation requests (MBPP): the prompt to continue, where to stop, and the tests to run."""
    requests = []
    for item in items:
        context = render_context(task, item.doc, fewshot, fmt, tokenizer, bos)
        requests.append(GenRequest(
            item_id=item.id, context=tuple(_encode(tokenizer, context)), prompt=context,
            stop=task.chat_stop if fmt == "chat" else task.stop, tests=tuple(item.doc.get("test_list", ())),
            setup=item.doc.get("test_setup_code", ""), prefix=task.chat_prefix if fmt == "chat" else "", doc=item.doc))
    return requests
