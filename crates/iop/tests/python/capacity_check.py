"""Streams many chat completions at once through a running iop edge with the official
`openai` Python SDK, the way applications do: each stream is iterated to its end, and the
SDK closes it at `data: [DONE]`.

Usage: python capacity_check.py BASE_URL MODEL REQUESTS CONCURRENCY
Prints one JSON line: {"completed": N, "failed": {"<status or error>": count, ...}}.
Exits 1 if any request failed.
"""

import json
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai


def one(client: openai.OpenAI, model: str, i: int) -> str:
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"request {i}"}],
            stream=True,
        )
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        if not text or finish is None:
            return f"incomplete: {finish!r} after {len(text)} chars"
        return "ok"
    except openai.APIStatusError as err:
        return f"{err.status_code} {err.response.headers.get('x-iop-error', '')}".strip()
    except openai.APIError as err:
        return f"{type(err).__name__}: {err}"


def main(base_url: str, model: str, requests: int, concurrency: int) -> int:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=60)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda i: one(client, model, i), range(requests)))
    outcomes = Counter(results)
    completed = outcomes.pop("ok", 0)
    print(json.dumps({"completed": completed, "failed": dict(outcomes)}))
    return 0 if completed == requests else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
