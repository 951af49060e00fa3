"""Drives a running iop edge with the official SDKs of the Responses and Messages APIs.

Usage: python apis_sdk_check.py BASE_URL
With the `openai` SDK: `client.responses.create` without and with streaming; with the
`anthropic` SDK: `client.messages.create` without and with streaming (and the SDK's
stream helper) and `client.messages.count_tokens`, against every model of the demo: one rendered from node runs, one whose
chat answer is translated from a tunnelled provider.
"""

import sys

import anthropic
import openai


def check_responses(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=30)
    reply = client.responses.create(model=model, input="Say hello.", max_output_tokens=64)
    assert reply.status == "completed", reply
    assert reply.output_text, reply
    assert reply.usage is not None and reply.usage.output_tokens > 0, reply.usage

    stream = client.responses.create(model=model, input="Say hello.", stream=True)
    kinds, text, final = [], "", None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert text and final is not None and final.output_text == text, (text, final)
    assert final.usage is not None and final.usage.output_tokens > 0, final.usage

    # The SDK's stream helper checks the events' identities and order strictly.
    with client.responses.stream(model=model, input="Say hello.") as helper:
        for _ in helper:
            pass
        assembled = helper.get_final_response()
    assert assembled.output_text == text, (assembled, text)
    print(f"responses {model}: {len(text)} chars in {len(kinds)} events, usage {final.usage.input_tokens}/{final.usage.output_tokens}")


def check_messages(base_url: str, model: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="not-needed", max_retries=0, timeout=30)
    message = client.messages.create(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert message.stop_reason in ("end_turn", "max_tokens"), message
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text, message
    assert message.usage.output_tokens > 0, message.usage

    events = []
    for event in client.messages.create(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "Say hello."}], stream=True
    ):
        events.append(event.type)
    assert events[0] == "message_start" and events[-1] == "message_stop", events

    with client.messages.stream(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "Say hello."}]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed and streamed == "".join(b.text for b in final.content if b.type == "text"), final
    assert final.usage.output_tokens > 0, final.usage
    print(f"messages {model}: {len(streamed)} chars, usage {final.usage.input_tokens}/{final.usage.output_tokens}")

    counted = client.messages.count_tokens(model=model, messages=[{"role": "user", "content": "Say hello."}])
    assert counted.input_tokens > 0, counted

    try:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    except anthropic.NotFoundError as err:
        assert "does not exist" in str(err), err
    else:
        raise AssertionError("an unknown model must raise NotFoundError")


def main(base_url: str) -> None:
    # The Anthropic SDK appends /v1/messages to its base URL; the OpenAI SDK's includes /v1.
    root = base_url.removesuffix("/v1")
    for model in ("mock", "mock-tunnel"):
        check_responses(base_url, model)
        check_messages(root, model)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
