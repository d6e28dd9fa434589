"""Prompt strings, answer strings and row validation, checked against hand-written lm-eval forms."""
import pytest

from cel_utils.tasks.prompts import build_gen_requests, build_requests, encode_pair, render_context
from cel_utils.tasks.catalog import get_task
from cel_utils.tasks.specs import Item, hellaswag_clean, validate_item

BOOLQ = {"question": "is the sky blue", "passage": "The sky is blue.", "answer": True}
HELLASWAG = {"ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow.",
             "ctx_b": "then", "ctx": "...", "endings": [", the man continues.", " [title] Get a scraper.  Done",
                                                        "x", "y"], "source_id": "s", "split": "val",
             "split_type": "indomain", "label": "1"}
ARITH = {"context": "Question: What is 98 plus 45?\nAnswer:", "completion": " 143"}
MBPP = {"task_id": 11, "text": "Write a function to add.", "code": "def add(a, b):\r\n  return a + b",
        "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
        "test_setup_code": "", "challenge_test_list": []}


def test_boolq_prompt_and_choices():
    task = get_task("boolq")
    assert task.doc_to_text(BOOLQ) == "The sky is blue.\nQuestion: is the sky blue?\nAnswer:"
    assert task.doc_to_choices(BOOLQ) == ["no", "yes"] and task.target_delimiter == " "
    assert task.doc_to_gold(BOOLQ) == 1
    assert task.doc_to_gold({**BOOLQ, "answer": False}) == 0


def test_hellaswag_preprocessing_follows_lm_eval():
    task = get_task("hellaswag")
    assert task.doc_to_text(HELLASWAG) == "Removing ice from car: Then, the man writes over the snow. Then"
    # lm-eval strips first, so a leading " [title]" loses its space and becomes a plain tag
    assert hellaswag_clean(" [title] Get a scraper.  Done") == " Get a scraper. Done"
    assert hellaswag_clean("Clean the car [title] Get a scraper.") == "Clean the car. Get a scraper."
    assert hellaswag_clean("[header] How to x [step] Do it.") == " How to x Do it."
    assert task.doc_to_choices(HELLASWAG)[1] == " Get a scraper. Done"
    assert task.doc_to_gold(HELLASWAG) == 1
    wikihow = {**HELLASWAG, "ctx_a": "A [step] B", "ctx_b": ""}
    assert task.doc_to_text(wikihow) == "Removing ice from car: A B"  # trailing space of empty ctx_b stripped


def test_mbpp_prompt_follows_lm_eval():
    task = get_task("mbpp")
    assert task.doc_to_text(MBPP) == (
        "You are an expert Python programmer, and here is your task: Write a function to add. Your code should "
        "pass these tests:\n\nassert add(1, 2) == 3\nassert add(0, 0) == 0\nassert add(-1, 1) == 0\n[BEGIN]\n")
    assert task.doc_to_target(MBPP) == "def add(a, b):\r\n  return a + b\n[DONE]"


def test_plain_fewshot_joins_exemplars_with_blank_lines(tokenizer):
    task = get_task("arithmetic")
    shots = [Item("a", {"context": "Question: What is 1 plus 1?\nAnswer:", "completion": " 2"})]
    text = render_context(task, ARITH, shots, "plain", tokenizer)
    assert text == "Question: What is 1 plus 1?\nAnswer: 2\n\nQuestion: What is 98 plus 45?\nAnswer:"


def test_arithmetic_target_keeps_its_single_leading_space(tokenizer):
    task = get_task("arithmetic")
    (request,) = build_requests(task, [Item("x", ARITH)], [], tokenizer, "plain")
    assert tokenizer.decode(list(request.context) + list(request.continuations[0])) == ARITH["context"] + " 143"
    assert tokenizer.decode(list(request.continuations[0])) == " 143"


def test_encode_pair_moves_trailing_spaces_into_the_answer(tokenizer):
    context, continuation = encode_pair(tokenizer, "Answer: ", "yes")
    assert tokenizer.decode(context) == "Answer:"
    assert tokenizer.decode(continuation) == " yes"


def test_choice_requests_share_the_context(tokenizer):
    task = get_task("hellaswag")
    (request,) = build_requests(task, [Item("h", HELLASWAG)], [], tokenizer, "plain")
    assert len(request.continuations) == 4
    assert request.choice_chars == (20, 20, 1, 1)  # lm-eval: len(choice), the delimiter not counted
    assert request.answers[1] == "  Get a scraper. Done"
    assert tokenizer.decode(list(request.context)) == task.doc_to_text(HELLASWAG)


def test_chat_format_wraps_the_same_content(tokenizer):
    task = get_task("boolq")
    shots = [Item("s", {**BOOLQ, "answer": False})]
    (request,) = build_requests(task, [Item("b", BOOLQ)], shots, tokenizer, "chat")
    assert request.prompt.count("<|im_start|>user\n") == 2
    assert "<|im_start|>assistant\nno<|im_end|>" in request.prompt  # the exemplar's answer, no leading space
    assert request.prompt.endswith("<|im_start|>assistant\n")
    assert [tokenizer.decode(list(c)) for c in request.continuations] == ["no", "yes"]


def test_mbpp_chat_variant_opens_a_code_fence(tokenizer):
    task = get_task("mbpp")
    (request,) = build_gen_requests(task, [Item("11", MBPP)], [], tokenizer, "chat")
    assert request.prompt.endswith("<|im_start|>assistant\n```python\n")
    assert request.stop == "```"
    (plain,) = build_gen_requests(task, [Item("11", MBPP)], [], tokenizer, "plain")
    assert plain.stop == "[DONE]" and plain.prompt.endswith("[BEGIN]\n")


def test_unknown_format_and_task():
    with pytest.raises(ValueError, match="unknown prompt format"):
        render_context(get_task("boolq"), BOOLQ, [], "fancy", None)
    with pytest.raises(ValueError, match="unknown task 'boolqq'"):
        get_task("boolqq")


@pytest.mark.parametrize("task,doc,message", [
    ("boolq", {"question": "q", "passage": "p"}, "missing field 'answer'"),
    ("boolq", {"question": "q", "passage": "p", "answer": "yes"}, "field 'answer' should be bool"),
    ("hellaswag", {**HELLASWAG, "label": "4"}, "out of range"),
    ("hellaswag", {**HELLASWAG, "label": 1}, "field 'label' should be str"),
    ("hellaswag", {**HELLASWAG, "endings": ["a", "b"]}, "has 2 endings"),
    ("mbpp", {**MBPP, "task_id": "11"}, "field 'task_id' should be int"),
    ("arithmetic", {"context": "Q"}, "missing field 'completion'"),
])
def test_malformed_rows_are_rejected_with_the_row_named(task, doc, message):
    with pytest.raises(ValueError, match=message) as error:
        validate_item(get_task(task), Item("row-7", doc))
    assert "row-7" in str(error.value)


def test_bos_follows_the_tokenizers_default_unless_told(tokenizer):
    import copy

    from tokenizers.processors import TemplateProcessing

    from cel_utils.tasks.prompts import resolve_bos

    task = get_task("arithmetic_2da")
    assert resolve_bos(tokenizer, "auto") is False  # SmolLM2 adds no BOS: its prompts are unchanged
    (plain,) = build_requests(task, [Item("x", ARITH)], [], tokenizer, "plain", resolve_bos(tokenizer, "auto"))
    adds = copy.deepcopy(tokenizer)  # a tokenizer that adds BOS by default, as Llama-3's and Gemma's do
    adds.bos_token = "<|endoftext|>"
    adds._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                       special_tokens=[("<|endoftext|>", adds.bos_token_id)])
    assert resolve_bos(adds, "auto") is True and resolve_bos(adds, "never") is False
    (with_bos,) = build_requests(task, [Item("x", ARITH)], [], adds, "plain", resolve_bos(adds, "auto"))
    assert with_bos.context == (adds.bos_token_id,) + plain.context and with_bos.continuations == plain.continuations
    assert resolve_bos(tokenizer, "always") is True
    with pytest.raises(ValueError, match="unknown bos policy"):
        resolve_bos(tokenizer, "sometimes")
