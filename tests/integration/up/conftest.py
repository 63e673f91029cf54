"""The greedy answers of a plain engine on the tiny llama model, which `kubesgl up` must give."""

from __future__ import annotations

import pytest
from up_harness import CHAT, MAX_TOKENS, PROMPTS


@pytest.fixture(scope="session")
def plain_engine_answers(tiny_model) -> dict[str, str]:
    """{prompt: greedy text}, and the chat's under "chat"."""
    from kubesgl.engine import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    with LLM(tiny_model("llama"), device="cpu", dtype="float32", max_total_tokens=4096) as llm:
        answers = {prompt: out.text for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, greedy))}
        chat_ids = llm.tokenizer.apply_chat_template(
            CHAT, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        answers["chat"] = llm.generate([list(chat_ids)], greedy)[0].text
    return answers
