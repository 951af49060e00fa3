// Streams one chat completion with the official OpenAI Node SDK from an edge where it
// waits first (the edge keeps it alive with SSE comments meanwhile) and prints its text, then `ok`.
//
// Usage: node openai_waiting_check.mjs BASE_URL MODEL
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "not-needed", maxRetries: 0, timeout: 60_000 });
const stream = await client.chat.completions.create({
  model: process.argv[3],
  messages: [{ role: "user", content: "hi" }],
  stream: true,
});
let text = "";
for await (const chunk of stream) {
  text += chunk.choices[0]?.delta?.content ?? "";
}
console.log(`openai-node:${text}`);
console.log("ok");
