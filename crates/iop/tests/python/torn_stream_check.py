"""Streams a chat completion whose provider dies mid-event, with the official `openai`
Python SDK: the SDK must raise a clean API error (the edge's error event), never trip
over a half event.

Usage: python torn_stream_check.py BASE_URL MODEL
"""

import json
import sys

import openai


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        stream=True,
    )
    chunks = 0
    try:
        for _chunk in stream:
            chunks += 1
    except openai.APIError as err:
        print(f"API error after {chunks} chunks: {err}")
        print("ok")
        return
    except json.JSONDecodeError as err:
        raise AssertionError(f"the SDK parsed a broken event after {chunks} chunks: {err}")
    raise AssertionError(f"the stream ended without an error after {chunks} chunks")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
