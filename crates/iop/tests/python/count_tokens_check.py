"""Counts a prompt's tokens with the `anthropic` SDK's `client.messages.count_tokens`.

Usage: python count_tokens_check.py ROOT_URL MODEL [EXPECTED]
Counts a conversation with a system prompt and a tool; the count must be positive, and
equal EXPECTED when given. Prints `tokens N` and then `ok`.
"""

import sys

import anthropic


def main(root: str, model: str, expected: str | None) -> None:
    client = anthropic.Anthropic(base_url=root, api_key="not-needed", max_retries=0, timeout=60)
    count = client.messages.count_tokens(
        model=model,
        system="You are terse.",
        messages=[{"role": "user", "content": "How many tokens is this question?"}],
        tools=[
            {
                "name": "lookup",
                "description": "Look a word up",
                "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
            }
        ],
    )
    assert count.input_tokens > 0, count
    if expected is not None:
        assert count.input_tokens == int(expected), (count.input_tokens, expected)
    print(f"tokens {count.input_tokens}")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
