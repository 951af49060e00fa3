"""Drives a running iop edge with the official `ollama` Python client.

Usage: python ollama_client_check.py HOST_URL --chat M1,M2 --embed M1 [--context M1=N]
Lists the models and shows each, then chats (streamed and not) and generates with every
`--chat` model, embeds with every `--embed` model, and checks the context length a group's
config gives (`--context`). The Ollama API test edge has one model translated for an
OpenAI-compatible provider, one served by an Ollama server and one rendered from the node's
mock adapter; `iop demo` has one of the first kind and one of the last.
"""

import argparse

import ollama


def main(host: str, chat: list[str], embed: list[str], context: dict[str, int]) -> None:
    client = ollama.Client(host=host, timeout=30)
    names = sorted(m.model for m in client.list().models)
    for name in chat + embed:
        assert name in names, names
        client.show(name)  # a ResponseError for a model the edge does not show
    for name, length in context.items():
        shown = client.show(name)
        assert shown.modelinfo["iop.context_length"] == length, shown

    for model in chat:
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

    for model in embed:
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
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("--chat", required=True, type=lambda v: v.split(","))
    parser.add_argument("--embed", default=[], type=lambda v: v.split(","))
    parser.add_argument("--context", action="append", default=[])
    args = parser.parse_args()
    lengths = {name: int(n) for name, n in (c.split("=") for c in args.context)}
    main(args.host, args.chat, args.embed, lengths)
