"""A background response with the official `openai` Python SDK, as an app would use one:
create it with `background=True`, poll it with `responses.retrieve` until it completes,
then stream its events after a sequence number with
`responses.retrieve(id, stream=True, starting_after=N)`. Prints the text, the first
streamed sequence number and `ok`.

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
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
