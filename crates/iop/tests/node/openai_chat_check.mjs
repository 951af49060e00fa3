// Drives a running iop edge with the official OpenAI Node SDK (`openai` from npm):
// streamed chat completions with usage, through the SDK's async iterator and its stream
// helper, for every model of `iop demo` (one rendered from node runs, one tunnelled), and
// an unknown model as the SDK's NotFoundError.
//
// Usage: node openai_chat_check.mjs BASE_URL
import assert from "node:assert/strict";

import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "not-needed", maxRetries: 0, timeout: 30_000 });
const messages = [{ role: "user", content: "Say hello." }];

for (const model of ["mock", "mock-tunnel"]) {
  const stream = await client.chat.completions.create({
    model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let chunks = 0;
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    chunks += 1;
    assert.equal(chunk.object, "chat.completion.chunk");
    const choice = chunk.choices[0];
    if (choice?.delta?.content) text += choice.delta.content;
    if (choice?.finish_reason) finish = choice.finish_reason;
    if (chunk.usage) usage = chunk.usage;
  }
  assert.ok(chunks > 2 && text.length > 0, `${chunks} chunks: ${text}`);
  assert.equal(finish, "stop");
  assert.ok(usage && usage.completion_tokens > 0, JSON.stringify(usage));

  // The helper assembles the chunks into one completion.
  const runner = client.chat.completions.stream({ model, messages });
  let deltas = "";
  runner.on("content", (delta) => {
    deltas += delta;
  });
  const final = await runner.finalChatCompletion();
  assert.equal(final.choices[0].message.content, deltas);
  assert.ok(deltas.length > 0);
  console.log(`${model}: ${text.length} chars in ${chunks} chunks, usage ${usage.prompt_tokens}/${usage.completion_tokens}`);
}

await assert.rejects(
  client.chat.completions.create({ model: "no-such-model", messages, stream: true }),
  OpenAI.NotFoundError,
);
console.log("ok");
