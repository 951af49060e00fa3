"""A background response with the official `openai` Python SDK, as an app would use one:
create it with `background=True`, poll it with `responses.retrieve` until it completes,
then stream its events after a sequence number with
`responses.retrieve(id, stream=True, starting_after=N)`; then create one streamed in the
background, leave after a few events and come back for the rest. Prints the texts, the
first streamed sequence number and `ok`.

Usage: python background_check.py BASE_URL MODEL
"""

import sys
import time

import openai


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=30)
    created = client.responses.create(model=model, input="tell me", background=True)
    assert created.status == "queued", created
    deadline = time.monotonic() + 30
    while True:
        now = client.responses.retrieve(created.id)
        assert now.id == created.id, now
        if now.status == "completed":
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.1)
    print("text:" + now.output_text)
    first = None
    for event in client.responses.retrieve(created.id, stream=True, starting_after=3):
        if first is None:
            first = event.sequence_number
        last = event.type
    print(f"first:{first}")
    print(f"last:{last}")

    # Streamed in the background: the client reads a few events, notes the response's id
    # and the last sequence number, leaves, and comes back for the rest.
    text, response_id, seq = [], None, None
    stream = client.responses.create(model=model, input="tell me", background=True, stream=True)
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        seq = event.sequence_number
        if len(text) == 3:
            break
    stream.close()
    assert response_id and response_id.startswith("resp_"), response_id
    for event in client.responses.retrieve(response_id, stream=True, starting_after=seq):
        if event.type == "response.output_text.delta":
            text.append(event.delta)
    print("streamed:" + "".join(text))
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
