"""Drives a running iop edge with the official `ollama` Python client.

Usage: python ollama_client_check.py HOST_URL
Lists the models, shows one, then chats (streamed and not) and generates with every
model of the test edge: one translated for an OpenAI-compatible provider, one served by
an Ollama server, one rendered from the node's mock adapter; and embeds.
"""

import sys

import ollama


def main(host: str) -> None:
    client = ollama.Client(host=host, timeout=30)
    names = sorted(m.model for m in client.list().models)
    for name in ("openai", "ollama", "mock"):
        assert name in names, names
    shown = client.show("openai")
    assert shown.modelinfo["iop.context_length"] == 8192, shown

    for model in ("openai", "ollama", "mock"):
        reply = client.chat(model=model, messages=[{"role": "user", "content": "Say hello."}])
        assert reply.message.role == "assistant", reply
        assert reply.message.content, reply
        assert reply.done and reply.done_reason == "stop", reply
        assert reply.eval_count and reply.eval_count > 0, reply

        text, chunks, last = "", 0, None
        for chunk in client.chat(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
            stream=True,
            options={"num_predict": 5},
        ):
            chunks += 1
            text += chunk.message.content or ""
            last = chunk
        assert chunks > 2 and text, (chunks, text)
        assert last.done and last.done_reason == "length", last
        assert last.eval_count == 5, last

        generated = client.generate(model=model, prompt="Why is the sky blue?")
        assert generated.response and generated.done, generated
        print(f"{model}: {len(text)} chars streamed in {chunks} chunks, {last.eval_count} tokens")

    for model in ("openai", "ollama"):
        embedded = client.embed(model=model, input=["one text", "another text"])
        assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 8, embedded

    try:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    except ollama.ResponseError as err:
        assert err.status_code == 404, err
        assert "no-such-model" in err.error, err
    else:
        raise AssertionError("an unknown model must raise ResponseError")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
