"""vLLM's and OpenAI's request fields through the real `openai` client: each has its effect,
and its bounds are refused with 400."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.live_server import MODEL, LiveServer, live_server, openai_client

PROMPT = "List three primary colors:"
SAY_HI = [{"role": "user", "content": "Say hi."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as running:
        yield running


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai_client(server)


def complete(client: openai.OpenAI, prompt: str = PROMPT, **fields: Any) -> Any:
    """A greedy completion of 16 tokens; `fields` may be vLLM's (sent in the body as they are)."""
    body = {"max_tokens": 16, "temperature": 0, **fields}
    standard = {k: body.pop(k) for k in list(body) if k in ("max_tokens", "temperature", "n", "logprobs", "echo")}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=body, **standard)


def token_id(text: str, server: LiveServer) -> int:
    [token] = server.engine.tokenizer.encode(text, add_special_tokens=False)
    return token


def test_min_tokens_lengthens_an_answer_that_ends_early(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=SAY_HI, max_tokens=60, temperature=0)
    assert plain.choices[0].finish_reason == "stop"
    ends = plain.usage.completion_tokens
    longer = client.chat.completions.create(
        model=MODEL, messages=SAY_HI, max_tokens=60, temperature=0, extra_body={"min_tokens": ends + 10}
    )
    assert longer.usage.completion_tokens >= ends + 10


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, server: LiveServer) -> None:
    plain = complete(client, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    banned = token_id(first, server)
    without = complete(client, logprobs=0, logit_bias={str(banned): -100})
    assert first not in without.choices[0].logprobs.tokens
    forced = token_id(" banana", server)
    only = complete(client, max_tokens=5, logit_bias={str(forced): 100})
    assert only.choices[0].text == " banana" * 5


def test_penalties_cut_repetition(client: openai.OpenAI) -> None:
    def repeated_tokens(**fields: Any) -> int:
        tokens = complete(client, max_tokens=32, logprobs=0, **fields).choices[0].logprobs.tokens
        return len(tokens) - len(set(tokens))

    plain = repeated_tokens()
    assert plain >= 5
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert repeated_tokens(**penalty) < plain, penalty


def test_min_p_one_keeps_only_the_most_likely_token(client: openai.OpenAI) -> None:
    greedy = complete(client).choices[0].text
    hot = [complete(client, temperature=1.5, seed=seed).choices[0].text for seed in range(2)]
    assert greedy not in hot
    assert all(complete(client, temperature=1.5, seed=seed, min_p=1.0).choices[0].text == greedy for seed in range(2))


def test_allowed_token_ids_are_the_only_ones(client: openai.OpenAI, server: LiveServer) -> None:
    allowed = [token_id(word, server) for word in (" red", " blue")]
    reply = complete(client, max_tokens=6, allowed_token_ids=allowed)
    assert set(re.findall(r"\S+", reply.choices[0].text)) <= {"red", "blue"}


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        {"guided_json": PERSON},
        {"structured_outputs": {"json": PERSON}},
    ],
    ids=["response_format", "guided_json", "structured_outputs"],
)
def test_json_schema_output_parses_and_validates(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=60,
        temperature=0.7,
        seed=1,
        extra_body=fields,
    )
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and type(person["age"]) is int
    assert reply.choices[0].finish_reason == "stop"


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Give me some data."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    date = complete(client, "The date today is", max_tokens=20, guided_regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text)
    picked = complete(client, "Is the sky green?", temperature=1.0, seed=3, guided_choice=["yes", "no"])
    assert picked.choices[0].text in ("yes", "no")


def test_echo_and_the_sampled_tokens_logprob(client: openai.OpenAI) -> None:
    plain = complete(client, max_tokens=4)
    echoed = complete(client, max_tokens=4, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    entries = complete(client, max_tokens=4, logprobs=0).choices[0].logprobs
    assert [list(top) for top in entries.top_logprobs] == [[token] for token in entries.tokens]
    assert [top[t] for top, t in zip(entries.top_logprobs, entries.tokens, strict=True)] == entries.token_logprobs


def test_chat_continues_the_final_message_and_echoes_it(client: openai.OpenAI) -> None:
    start = "The three primary colors are"
    messages = [{"role": "user", "content": "Name the primary colors."}, {"role": "assistant", "content": start}]
    continued = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    text = continued.choices[0].message.content
    assert text.startswith(start) and len(text) > len(start)
    assert "<|im_start|>" not in text


def test_usage_counts_a_prompt_once_and_streams_continuously(client: openai.OpenAI) -> None:
    one = complete(client, max_tokens=2)
    three = complete(client, max_tokens=2, n=3)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens == 5
    assert three.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    )
    assert all(chunk.usage is not None for chunk in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.choices] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"min_tokens": 17}, "min_tokens"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"suffix": "?"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ],
)
def test_bounds_are_refused(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, **fields)
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_echo_with_logprobs_gives_the_prompts_logprobs(client: openai.OpenAI, server: LiveServer) -> None:
    plain = complete(client, max_tokens=3, logprobs=2)
    echoed = complete(client, max_tokens=3, logprobs=2, echo=True)
    entries, prompt = echoed.choices[0].logprobs, server.engine.tokenizer.encode(PROMPT)
    assert len(entries.tokens) == len(prompt) + 3
    assert entries.token_logprobs[0] is None and entries.top_logprobs[0] is None
    assert all(lp is not None and lp < 0 for lp in entries.token_logprobs[1 : len(prompt)])
    assert entries.tokens[len(prompt) :] == plain.choices[0].logprobs.tokens
    assert entries.text_offset[len(prompt)] == len(PROMPT)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True
    )
    tokens = [token for chunk in streamed if chunk.choices for token in chunk.choices[0].logprobs.tokens]
    assert tokens == entries.tokens
