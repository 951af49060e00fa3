//! Answer events as the Responses API's `response` object and its stream: `output` items
//! (reasoning, an assistant message with `output_text`, function calls) and `usage`; the
//! stream sends `response.created` and `response.in_progress`, then per item
//! `response.output_item.added`, its content part and deltas, `…done` events, and ends
//! with `response.completed` (`response.incomplete` when a limit cut the answer short)
//! or `response.failed`. Every event carries `type` and a `sequence_number` counting from
//! 0.
//!
//! Pure: the writer is fed events and returns what to send.

use iop_proto::pb;
use serde_json::{Map, Value, json};

use crate::canonical::{AnswerEvent, ApiError, Finish, FinishReason, ToolCall};
use crate::surfaces::sse::{EventWriter, SseEvent};

/// What a response says about itself besides its output.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `resp_…`
    pub id: String,
    pub created_at: u64,
    /// The model as the client named it.
    pub model: String,
    /// The request's settings, as the response object repeats them.
    pub echo: Map<String, Value>,
    /// The tools offered inside namespaces: the name the backend calls, the namespace,
    /// the name the client knows (see `request::namespaced_names`).
    pub namespaced: Vec<(String, String, String)>,
}

/// The settings of `request` a response object repeats, with the API's defaults.
pub fn echo(request: &Map<String, Value>) -> Map<String, Value> {
    let get = |key: &str, default: Value| {
        request
            .get(key)
            .filter(|v| !v.is_null())
            .cloned()
            .unwrap_or(default)
    };
    let mut echo = Map::new();
    for (key, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("temperature", Value::Null),
        ("top_p", Value::Null),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("parallel_tool_calls", json!(true)),
        ("text", json!({"format": {"type": "text"}})),
        ("reasoning", json!({"effort": null, "summary": null})),
        ("metadata", json!({})),
        ("user", Value::Null),
    ] {
        echo.insert(key.into(), get(key, default));
    }
    echo.insert("previous_response_id".into(), Value::Null);
    echo.insert("store".into(), json!(false));
    echo.insert("background".into(), json!(false));
    echo.insert("truncation".into(), json!("disabled"));
    echo
}

/// The Responses `usage` object.
pub fn usage_json(usage: &pb::Usage) -> Value {
    json!({
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_input_tokens.unwrap_or(0)},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens.unwrap_or(0)},
        "total_tokens": usage.input_tokens.saturating_add(usage.output_tokens),
    })
}

/// The item being written.
#[derive(Debug)]
enum Open {
    Message { id: String, text: String },
    Reasoning { id: String, text: String },
}

/// Builds one response from answer events.
#[derive(Debug)]
pub struct ResponseWriter {
    meta: ResponseMeta,
    /// Whether to make stream events (a JSON answer needs only the final object).
    streaming: bool,
    sequence: u64,
    output: Vec<Value>,
    open: Option<Open>,
    /// The final object, once the answer ended.
    done: Option<Value>,
}

impl ResponseWriter {
    pub fn new(meta: ResponseMeta, streaming: bool) -> Self {
        Self {
            meta,
            streaming,
            sequence: 0,
            output: Vec::new(),
            open: None,
            done: None,
        }
    }

    fn function_call(&mut self, call: ToolCall, out: &mut Vec<SseEvent>) {
        let id = self.item_id("fc");
        let call_id = if call.id.is_empty() {
            format!("call_{}", &id[3..])
        } else {
            call.id
        };
        let mut item = json!({"type": "function_call", "id": id, "call_id": call_id,
                              "name": call.name, "arguments": "", "status": "in_progress"});
        if let Some((_, namespace, name)) = self
            .meta
            .namespaced
            .iter()
            .find(|(q, _, _)| *q == call.name)
        {
            item["name"] = name.as_str().into();
            item["namespace"] = namespace.as_str().into();
        }
        self.added(out, item.clone());
        let index = self.output.len();
        if !call.arguments.is_empty() {
            let data = json!({"item_id": id, "output_index": index, "delta": call.arguments});
            self.emit(out, "response.function_call_arguments.delta", data);
        }
        let data = json!({"item_id": id, "output_index": index, "name": item["name"],
                          "arguments": call.arguments});
        self.emit(out, "response.function_call_arguments.done", data);
        item["arguments"] = Value::String(call.arguments);
        item["status"] = json!("completed");
        self.item_done(out, item);
    }

    /// Finishes the open item, if any.
    fn close(&mut self, out: &mut Vec<SseEvent>) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.output.len();
        match open {
            Open::Message { id, text } => {
                let data = json!({"item_id": id, "output_index": index, "content_index": 0,
                                  "text": text, "logprobs": []});
                self.emit(out, "response.output_text.done", data);
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                self.part(out, "response.content_part.done", &id, part.clone());
                let item = json!({"type": "message", "id": id, "status": "completed",
                                  "role": "assistant", "content": [part]});
                self.item_done(out, item);
            }
            Open::Reasoning { id, text } => {
                let data = json!({"item_id": id, "output_index": index, "content_index": 0,
                                  "text": text});
                self.emit(out, "response.reasoning_text.done", data);
                let part = json!({"type": "reasoning_text", "text": text});
                self.part(out, "response.content_part.done", &id, part.clone());
                let item = json!({"type": "reasoning", "id": id, "status": "completed",
                                  "summary": [], "content": [part]});
                self.item_done(out, item);
            }
        }
    }

    fn finish(&mut self, finish: Finish, out: &mut Vec<SseEvent>) {
        let incomplete = match finish.reason {
            FinishReason::Length => Some("max_output_tokens"),
            FinishReason::ContentFilter => Some("content_filter"),
            _ => None,
        };
        let usage = finish.usage.as_ref().map(usage_json).unwrap_or(Value::Null);
        let (status, name, details) = match incomplete {
            Some(reason) => (
                "incomplete",
                "response.incomplete",
                json!({"reason": reason}),
            ),
            None => ("completed", "response.completed", Value::Null),
        };
        let response = self.object(status, usage, details, Value::Null);
        self.emit(out, name, json!({"response": response.clone()}));
        self.done = Some(response);
    }

    fn fail(&mut self, error: &ApiError, out: &mut Vec<SseEvent>) {
        if let Some(open) = self.open.take() {
            // What was written of the open item stays visible, marked incomplete.
            let item = match open {
                Open::Message { id, text } => json!({"type": "message", "id": id,
                    "status": "incomplete", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}),
                Open::Reasoning { id, text } => json!({"type": "reasoning", "id": id,
                    "status": "incomplete", "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}]}),
            };
            self.output.push(item);
        }
        let error = json!({"code": error.code(), "message": error.message});
        let response = self.object("failed", Value::Null, Value::Null, error);
        self.emit(
            out,
            "response.failed",
            json!({"response": response.clone()}),
        );
        self.done = Some(response);
    }

    /// The response object as it stands.
    fn object(&self, status: &str, usage: Value, incomplete: Value, error: Value) -> Value {
        let mut o = self.meta.echo.clone();
        for (key, value) in [
            ("id", json!(self.meta.id)),
            ("object", json!("response")),
            ("created_at", json!(self.meta.created_at)),
            ("status", json!(status)),
            ("error", error),
            ("incomplete_details", incomplete),
            ("model", json!(self.meta.model)),
            ("output", Value::Array(self.output.clone())),
            ("usage", usage),
        ] {
            o.insert(key.into(), value);
        }
        Value::Object(o)
    }

    fn item_id(&self, prefix: &str) -> String {
        let base = self.meta.id.strip_prefix("resp_").unwrap_or(&self.meta.id);
        format!("{prefix}_{base}_{}", self.output.len())
    }

    fn added(&mut self, out: &mut Vec<SseEvent>, item: Value) {
        let index = self.output.len();
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
    }

    fn item_done(&mut self, out: &mut Vec<SseEvent>, item: Value) {
        let index = self.output.len();
        self.emit(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": item.clone()}),
        );
        self.output.push(item);
    }

    fn part(&mut self, out: &mut Vec<SseEvent>, name: &'static str, id: &str, part: Value) {
        let index = self.output.len();
        let data = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
        self.emit(out, name, data);
    }

    fn emit(&mut self, out: &mut Vec<SseEvent>, name: &'static str, data: Value) {
        if !self.streaming {
            return;
        }
        let mut data = data;
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.push(SseEvent::new(name, data));
    }
}

impl EventWriter for ResponseWriter {
    /// The events that open a stream.
    fn start(&mut self, out: &mut Vec<SseEvent>) {
        let response = self.object("in_progress", Value::Null, Value::Null, Value::Null);
        self.emit(
            out,
            "response.created",
            json!({"response": response.clone()}),
        );
        self.emit(out, "response.in_progress", json!({"response": response}));
    }

    /// The response object, once the answer ended (`None` before).
    fn finished(&self) -> Option<&Value> {
        self.done.as_ref()
    }

    fn push(&mut self, event: AnswerEvent, out: &mut Vec<SseEvent>) {
        match event {
            AnswerEvent::Started | AnswerEvent::Embeddings(_) => {}
            AnswerEvent::Text(text) => {
                if !matches!(self.open, Some(Open::Message { .. })) {
                    self.close(out);
                    let id = self.item_id("msg");
                    let item = json!({"type": "message", "id": id, "status": "in_progress",
                                      "role": "assistant", "content": []});
                    self.added(out, item);
                    let part = json!({"type": "output_text", "text": "", "annotations": []});
                    self.part(out, "response.content_part.added", &id, part);
                    self.open = Some(Open::Message {
                        id,
                        text: String::new(),
                    });
                }
                let index = self.output.len();
                if let Some(Open::Message { id, .. }) = &self.open {
                    let data = json!({"item_id": id, "output_index": index, "content_index": 0,
                                      "delta": text, "logprobs": []});
                    self.emit(out, "response.output_text.delta", data);
                }
                if let Some(Open::Message { text: all, .. }) = &mut self.open {
                    all.push_str(&text);
                }
            }
            AnswerEvent::Reasoning(text) => {
                if !matches!(self.open, Some(Open::Reasoning { .. })) {
                    self.close(out);
                    let id = self.item_id("rs");
                    let item = json!({"type": "reasoning", "id": id, "status": "in_progress",
                                      "summary": [], "content": []});
                    self.added(out, item);
                    let part = json!({"type": "reasoning_text", "text": ""});
                    self.part(out, "response.content_part.added", &id, part);
                    self.open = Some(Open::Reasoning {
                        id,
                        text: String::new(),
                    });
                }
                let index = self.output.len();
                if let Some(Open::Reasoning { id, .. }) = &self.open {
                    let data = json!({"item_id": id, "output_index": index, "content_index": 0,
                                      "delta": text});
                    self.emit(out, "response.reasoning_text.delta", data);
                }
                if let Some(Open::Reasoning { text: all, .. }) = &mut self.open {
                    all.push_str(&text);
                }
            }
            AnswerEvent::ToolCalls(calls) => {
                self.close(out);
                for call in calls {
                    self.function_call(call, out);
                }
            }
            AnswerEvent::Finished(finish) => {
                self.close(out);
                self.finish(finish, out);
            }
            AnswerEvent::Failed(error) => self.fail(&error, out),
        }
    }
}

/// The `error` event that ends a native provider's stream when its tunnel fails mid-body
/// (the sequence numbers are the provider's, so this event carries none).
pub fn error_event(error: &ApiError) -> SseEvent {
    SseEvent::new(
        "error",
        json!({"type": "error", "code": error.code(), "message": error.message, "param": error.param}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ResponseMeta {
        ResponseMeta {
            id: "resp_r1".into(),
            created_at: 7,
            model: "g".into(),
            echo: echo(&Map::new()),
            namespaced: vec![("agents__spawn".into(), "agents".into(), "spawn".into())],
        }
    }

    #[test]
    fn a_call_of_a_namespaced_tool_names_its_namespace() {
        let call = |name: &str| ToolCall {
            id: "c1".into(),
            name: name.into(),
            arguments: "{}".into(),
        };
        let calls = AnswerEvent::ToolCalls(vec![call("agents__spawn"), call("shell")]);
        let (_, body) = run(vec![calls, finished(FinishReason::ToolCalls)], false);
        let output = body["output"].as_array().unwrap();
        assert_eq!(output[0]["name"], "spawn");
        assert_eq!(output[0]["namespace"], "agents");
        assert_eq!(output[1]["name"], "shell");
        assert!(output[1].get("namespace").is_none());
    }

    fn usage() -> pb::Usage {
        pb::Usage {
            input_tokens: 3,
            output_tokens: 5,
            reasoning_tokens: Some(2),
            cached_input_tokens: None,
        }
    }

    fn run(events: Vec<AnswerEvent>, streaming: bool) -> (Vec<SseEvent>, Value) {
        let (events, response) = ResponseWriter::new(meta(), streaming).render(events, streaming);
        (events, response.expect("the answer finished"))
    }

    fn finished(reason: FinishReason) -> AnswerEvent {
        AnswerEvent::finished(reason, Some(usage()))
    }

    #[test]
    fn a_json_answer_has_reasoning_message_and_calls_with_usage() {
        let (events, r) = run(
            vec![
                AnswerEvent::Reasoning("hmm".into()),
                AnswerEvent::Text("Hel".into()),
                AnswerEvent::Text("lo".into()),
                AnswerEvent::ToolCalls(vec![ToolCall {
                    id: "call_9".into(),
                    name: "f".into(),
                    arguments: "{\"a\":1}".into(),
                }]),
                finished(FinishReason::ToolCalls),
            ],
            false,
        );
        assert!(events.is_empty());
        assert_eq!(r["object"], "response");
        assert_eq!(
            (r["id"].as_str(), r["status"].as_str()),
            (Some("resp_r1"), Some("completed"))
        );
        assert_eq!(r["model"], "g");
        assert_eq!(
            r["output"],
            json!([
                {"type": "reasoning", "id": "rs_r1_0", "status": "completed", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "hmm"}]},
                {"type": "message", "id": "msg_r1_1", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
                {"type": "function_call", "id": "fc_r1_2", "call_id": "call_9", "name": "f",
                 "arguments": "{\"a\":1}", "status": "completed"},
            ])
        );
        assert_eq!(
            r["usage"],
            json!({"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 2},
                   "total_tokens": 8})
        );
        assert_eq!(r["store"], false);
        assert_eq!(r["tools"], json!([]));
        assert_eq!(r["incomplete_details"], Value::Null);
    }

    #[test]
    fn the_stream_is_the_golden_event_sequence() {
        let (events, _) = run(
            vec![
                AnswerEvent::Text("Hi".into()),
                AnswerEvent::Text(" there".into()),
                finished(FinishReason::Stop),
            ],
            true,
        );
        let names: Vec<&str> = events.iter().map(|e| e.name).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e.data["type"], e.name);
            assert_eq!(e.data["sequence_number"], i as u64);
        }
        assert_eq!(events[0].data["response"]["status"], "in_progress");
        assert_eq!(events[0].data["response"]["output"], json!([]));
        assert_eq!(events[4].data["delta"], "Hi");
        assert_eq!(events[4].data["item_id"], "msg_r1_0");
        assert_eq!(events[6].data["text"], "Hi there");
        assert_eq!(events[8].data["item"]["content"][0]["text"], "Hi there");
        let done = &events[9].data["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["usage"]["output_tokens"], 5);
        assert_eq!(done["output"][0]["status"], "completed");
    }

    #[test]
    fn reasoning_then_calls_stream_in_item_order() {
        let (events, r) = run(
            vec![
                AnswerEvent::Reasoning("think".into()),
                AnswerEvent::ToolCalls(vec![ToolCall {
                    id: String::new(),
                    name: "f".into(),
                    arguments: "{}".into(),
                }]),
                finished(FinishReason::ToolCalls),
            ],
            true,
        );
        let names: Vec<&str> = events.iter().map(|e| e.name).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(events[8].data["output_index"], 1);
        assert_eq!(events[8].data["item"]["arguments"], "");
        assert_eq!(events[11].data["item"]["arguments"], "{}");
        // A call without an id gets one.
        assert_eq!(r["output"][1]["call_id"], "call_r1_1");
    }

    #[test]
    fn a_length_stop_is_incomplete_and_a_failure_is_failed() {
        let (events, r) = run(
            vec![
                AnswerEvent::Text("a".into()),
                finished(FinishReason::Length),
            ],
            true,
        );
        assert_eq!(events.last().unwrap().name, "response.incomplete");
        assert_eq!(r["status"], "incomplete");
        assert_eq!(
            r["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );

        let (events, r) = run(
            vec![
                AnswerEvent::Text("partial".into()),
                AnswerEvent::Failed(ApiError::upstream("broken_stream", "boom")),
            ],
            true,
        );
        let last = events.last().unwrap();
        assert_eq!(last.name, "response.failed");
        assert_eq!(r["status"], "failed");
        assert_eq!(
            r["error"],
            json!({"code": "broken_stream", "message": "boom"})
        );
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert_eq!(r["output"][0]["content"][0]["text"], "partial");
        assert_eq!(r["usage"], Value::Null);
    }

    #[test]
    fn the_request_settings_are_repeated() {
        let request = json!({"instructions": "be brief", "max_output_tokens": 9,
            "tools": [{"type": "function", "name": "f"}], "temperature": 0.5, "metadata": {"a": "b"}});
        let e = echo(request.as_object().unwrap());
        assert_eq!(e["instructions"], "be brief");
        assert_eq!(e["max_output_tokens"], 9);
        assert_eq!(e["tools"][0]["name"], "f");
        assert_eq!(e["tool_choice"], "auto");
        assert_eq!(e["metadata"], json!({"a": "b"}));
        assert_eq!(e["parallel_tool_calls"], true);
    }
}
