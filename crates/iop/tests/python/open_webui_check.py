"""Makes the calls Open WebUI makes to its connections, as it makes them, against iop.

Usage: python open_webui_check.py ROOT_URL KEY
With `OPENAI_API_BASE_URL=ROOT_URL/v1`: `GET /models` (Bearer key) and a streamed
`POST /chat/completions`. With `OLLAMA_BASE_URL=ROOT_URL`: `GET /api/version` (its
connection check), `GET /api/tags` and `GET /api/ps` sent with `Content-Type:
application/json` on a GET, `expires_at` read with `datetime.fromisoformat`, the models
merged by their `model` key, and a streamed `POST /api/chat`. Prints `ok` at the end.
"""

import json
import sys
from datetime import datetime

import httpx


def main(root: str, key: str) -> None:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as http:
        # The OpenAI connection.
        models = http.get(f"{root}/v1/models", headers=headers)
        assert models.status_code == 200, models.text
        ids = [m["id"] for m in models.json()["data"]]
        assert "mock" in ids, ids
        body = {"model": "mock", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        text = ""
        with http.stream("POST", f"{root}/v1/chat/completions", headers=headers, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        text += choice.get("delta", {}).get("content") or ""
        assert text, "the OpenAI connection streamed no text"

        # The Ollama connection.
        version = http.get(f"{root}/api/version", headers=headers)
        assert version.status_code == 200 and "version" in version.json(), version.text
        tags = http.get(f"{root}/api/tags", headers=headers)
        assert tags.status_code == 200, tags.text
        merged = {m["model"]: m for m in tags.json()["models"]}
        assert "mock" in merged, merged.keys()
        ps = http.get(f"{root}/api/ps", headers=headers)
        assert ps.status_code == 200, ps.text
        for m in ps.json()["models"]:
            datetime.fromisoformat(m["expires_at"])
        chat = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        content = ""
        with http.stream("POST", f"{root}/api/chat", headers=headers, json=chat) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line:
                    content += json.loads(line).get("message", {}).get("content", "")
        assert content, "the Ollama connection streamed no text"
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
