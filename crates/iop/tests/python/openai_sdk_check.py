"""Drives a running iop edge with the official `openai` Python SDK.

Usage: python openai_sdk_check.py BASE_URL
Lists models and retrieves each (`models.retrieve`, an unknown one as NotFoundError), then
runs a non-streaming and a streaming chat completion (with usage) against every model
given by the demo: one rendered from node runs, one tunnelled.
"""

import sys

import openai


def main(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=30)
    models = sorted(m.id for m in client.models.list())
    assert "mock" in models and "mock-tunnel" in models, models
    for model in ("mock", "mock-tunnel"):
        got = client.models.retrieve(model)
        assert got.id == model and got.object == "model" and got.owned_by, got
        assert got.created > 0, got
    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError as err:
        assert err.status_code == 404, err
    else:
        raise AssertionError("retrieving an unknown model must raise NotFoundError")
    for model in ("mock", "mock-tunnel"):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
        )
        assert reply.choices[0].message.content, reply
        assert reply.choices[0].finish_reason == "stop", reply
        assert reply.usage is not None and reply.usage.completion_tokens > 0, reply.usage

        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, chunks = "", None, 0
        for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        assert chunks > 2 and text, (chunks, text)
        assert usage is not None and usage.completion_tokens > 0, usage
        print(f"{model}: {len(text)} chars streamed in {chunks} chunks, usage {usage.prompt_tokens}/{usage.completion_tokens}")

    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    except openai.NotFoundError as err:
        assert "does not exist" in str(err), err
    else:
        raise AssertionError("an unknown model must raise NotFoundError")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
