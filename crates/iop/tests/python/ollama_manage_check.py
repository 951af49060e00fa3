"""Manages the fleet's Ollama models through a running iop edge with the official `ollama`
Python client, as an admin would with Ollama itself.

Usage: python ollama_manage_check.py HOST_URL ADMIN_KEY
Pulls a model (not streamed, then another streamed, whose progress must rise to a last
`success`), finds it in the model list and chats with it, copies, creates from it with a
system prompt, and deletes; the edge's fleet has Ollama providers on two nodes.
"""

import argparse

import ollama


def main(host: str, key: str) -> None:
    client = ollama.Client(host=host, timeout=60, headers={"Authorization": f"Bearer {key}"})

    assert client.pull("py:1b").status == "success"

    statuses, seen = [], {}
    for progress in client.pull("py-stream:1b", stream=True):
        statuses.append(progress.status)
        if progress.digest and progress.completed is not None:
            # Two targets pull the same layer: each one's progress rises on its own, so
            # the furthest seen never goes back.
            seen[progress.digest] = max(seen.get(progress.digest, 0), progress.completed)
    # Progress is coalesced (a few lines a second per target), so a short step such as
    # `pulling manifest` may not show; the layers' progress and the outcome do.
    assert statuses[-1] == "success", statuses
    assert seen and all(done > 0 for done in seen.values()), seen

    names = [m.model for m in client.list().models]
    assert "py:1b" in names and "py-stream:1b" in names, names
    reply = client.chat(model="py:1b", messages=[{"role": "user", "content": "Say hello."}])
    assert reply.message.content, reply

    assert client.copy("py:1b", "py-copy:1b").status == "success"
    created = client.create(model="py-brief", from_="py:1b", system="Be brief.")
    assert created.status == "success", created
    assert "py-brief" in [m.model for m in client.list().models]

    assert client.delete("py-copy:1b").status == "success"
    assert "py-copy:1b" not in [m.model for m in client.list().models]
    try:
        client.delete("py-copy:1b")
        raise AssertionError("deleting a model nobody holds succeeded")
    except ollama.ResponseError as e:
        assert e.status_code == 404, e
    print("ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("key")
    args = parser.parse_args()
    main(args.host, args.key)
