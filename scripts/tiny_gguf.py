"""Writes a tiny random-weight llama-architecture GGUF model for iop's conformance suite.

Usage: python tiny_gguf.py OUT.gguf      (needs the `gguf` and `numpy` packages)

The model answers nonsense, but it is a real model to llama.cpp: two transformer blocks, a
byte-level BPE tokenizer (GPT-2 style) and a ChatML chat template, so `llama-server` serves
chat, completions, embeddings (with `--embeddings --pooling mean`), Responses and Messages
requests with it. It is deterministic: the same file from the same script, and with
`temperature: 0` the same answer to the same prompt.

Two choices keep a real server's streams smooth and long:
- the vocabulary is printable ASCII, a few word pieces and the chat control tokens: no raw
  byte tokens, whose partial UTF-8 the server would hold back (streams stall for seconds);
- the output rows of the control tokens are zero while every other token's logit is random,
  so a greedy answer never ends early on an end-of-turn token: it runs to `max_tokens`.
"""

import sys

import gguf
import numpy as np

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_LAYER = 2
N_FF = 128
CONTEXT = 4096
HEAD_DIM = N_EMBD // N_HEAD

SPACE = "\u0120"  # GPT-2's byte-level stand-in for " "
NEWLINE = "\u010a"  # ... and for "\n"

WORDS = """the of and to in is it you that he was for on are with as his they be at one
have this from or had by word but what some we can out other were all there when up use
your how said an each she which do their time if will way about many then them write would
like so these her long make thing see him two has look more day could go come did number
sound no most people my over know water than call first who may down side been now find
hello world model node edge token stream answer server test""".split()

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vocabulary():
    """Tokens, their types and the merges that build every multi-character token."""
    tokens = list(CONTROL)
    types = [gguf.TokenType.CONTROL] * len(CONTROL)
    seen = set(tokens)

    def add(token):
        if token not in seen:
            seen.add(token)
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)

    for code in range(33, 127):
        add(chr(code))
    add(SPACE)
    add(NEWLINE)
    merges = []
    merged = set()
    for word in WORDS:
        for piece in (SPACE + word, word):
            for end in range(2, len(piece) + 1):
                left, right = piece[: end - 1], piece[end - 1]
                if (left, right) not in merged:
                    merged.add((left, right))
                    merges.append(f"{left} {right}")
                add(piece[:end])
    return tokens, types, merges


def main(path):
    rng = np.random.default_rng(14)
    tokens, types, merges = vocabulary()
    n_vocab = len(tokens)

    def weight(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("iop-tiny-random")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    w.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD, scale=1.0))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(N_HEAD * HEAD_DIM, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(N_HEAD_KV * HEAD_DIM, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(N_EMBD, N_HEAD * HEAD_DIM))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    output = weight(n_vocab, N_EMBD, scale=1.0)
    output[: len(CONTROL)] = 0.0  # never chosen: see the module doc
    w.add_tensor("output.weight", output)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{path}: {n_vocab} tokens, {len(merges)} merges, {N_LAYER} blocks of width {N_EMBD}")


if __name__ == "__main__":
    main(sys.argv[1])
