"""Resumes a chat completion stream whose connection was cut mid-stream, with the official
`openai` Python SDK, the way a client app would: it streams through a connection that
breaks (a TCP forwarder in this script, reset after a few chunks), notes the answer's
name (`x-iop-resume`) and how many chunks it got, and sends the same request again with
`Last-Event-ID: {name}.{chunks}`. Prints the whole text and `ok`.

Usage: python resume_check.py EDGE_URL MODEL
"""

import socket
import struct
import sys
import threading
from urllib.parse import urlparse

import httpx
import openai

MESSAGES = [{"role": "user", "content": "tell me"}]


class Forwarder:
    """Forwards one TCP connection to the edge until cut (a reset, both ways)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    @staticmethod
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        self.listener.close()
        for s in self.sockets:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # Wakes the pumps blocked on it (a close alone waits for them).
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


def text_of(chunk) -> str:
    if chunk.choices and chunk.choices[0].delta.content:
        return chunk.choices[0].delta.content
    return ""


def main(edge_url: str, model: str) -> None:
    edge = urlparse(edge_url)
    forwarder = Forwarder(edge.hostname, edge.port)
    cut_client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{forwarder.port}/v1", api_key="k", max_retries=0, timeout=30
    )
    stream = cut_client.chat.completions.create(model=model, messages=MESSAGES, stream=True)
    name = stream.response.headers["x-iop-resume"]
    text, chunks, broke = [], 0, False
    try:
        for chunk in stream:
            chunks += 1
            text.append(text_of(chunk))
            if chunks == 5:
                forwarder.cut()
    except (openai.APIError, httpx.HTTPError) as err:
        broke = True
        print(f"cut after {chunks} chunks: {type(err).__name__}")
    assert broke, f"the stream was not cut (it ended after {chunks} chunks)"

    client = openai.OpenAI(base_url=f"{edge_url}/v1", api_key="k", max_retries=0, timeout=30)
    rest = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        stream=True,
        extra_headers={"Last-Event-ID": f"{name}.{chunks}"},
    )
    for chunk in rest:
        text.append(text_of(chunk))
    print("text:" + "".join(text))
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
