//! Property tests of every surface's decoder: whatever JSON a client sends (within the
//! size limit), decoding never panics, and a refusal is a 4xx in the API's own error
//! shape; a request decoded into a translation has a canonical form that is a valid
//! OpenAI request.

use proptest::prelude::*;
use serde_json::{Map, Value, json};

use super::*;
use crate::canonical::Canonical;
use crate::surfaces::ollama::Endpoint;

/// Field names the decoders read, so generated requests reach past the first check.
const KEYS: &[&str] = &[
    "model",
    "messages",
    "input",
    "prompt",
    "stream",
    "max_tokens",
    "max_output_tokens",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "system",
    "instructions",
    "options",
    "role",
    "content",
    "type",
    "text",
    "name",
    "arguments",
    "images",
    "format",
    "think",
    "stop",
    "stop_sequences",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stream_options",
    "include_usage",
    "response_format",
    "metadata",
    "thinking",
    "keep_alive",
    "raw",
    "function",
    "parameters",
    "tool_calls",
    "tool_call_id",
    "source",
    "image_url",
    "url",
    "input_schema",
    "call_id",
    "output",
    "id",
    "num_predict",
    "adapter",
    "target",
    "node",
    "session_id",
    "background",
];

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(KEYS).prop_map(String::from),
        1 => "[a-z_]{1,8}",
    ]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-1e6f64..1e6).prop_map(|f| json!(f)),
        proptest::sample::select(
            &[
                "user",
                "assistant",
                "system",
                "tool",
                "text",
                "g",
                "function",
                "json",
                ""
            ][..]
        )
        .prop_map(|s| json!(s)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..6)
                .prop_map(|fields| Value::Object(fields.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A request object: mostly fields the APIs have, `model` usually a string.
fn request() -> impl Strategy<Value = Value> {
    (prop::collection::vec((key(), json()), 0..8), any::<bool>()).prop_map(|(fields, model)| {
        let mut object: Map<String, Value> = fields.into_iter().collect();
        if model {
            object.insert("model".into(), json!("g"));
        }
        Value::Object(object)
    })
}

const SURFACES: [Surface; 9] = [
    Surface::OpenAi(Operation::Chat),
    Surface::OpenAi(Operation::Completion),
    Surface::OpenAi(Operation::Embedding),
    Surface::Responses,
    Surface::Messages,
    Surface::Ollama(Endpoint::Chat),
    Surface::Ollama(Endpoint::Generate),
    Surface::Ollama(Endpoint::Embed),
    Surface::Ollama(Endpoint::Embeddings),
];

/// Checks one body against every surface (and the runs API).
fn check(body: &[u8]) -> Result<(), TestCaseError> {
    for surface in SURFACES {
        match surface.decode(body, &HeaderMap::new()) {
            // (A request answered at once is never dispatched: its canonical form is unused.)
            Ok(decoded) if decoded.immediate.is_some() => {}
            Ok(decoded) => {
                if let Canonical::Translated(bytes) = &decoded.canonical {
                    let canonical = crate::canonical::ClientRequest::parse(bytes);
                    prop_assert!(canonical.is_ok(), "{surface:?}: {canonical:?}");
                    let valid = openai::validate(&canonical.unwrap(), decoded.op);
                    prop_assert!(
                        valid.is_ok(),
                        "{surface:?}: {valid:?} for {}",
                        String::from_utf8_lossy(bytes)
                    );
                }
            }
            Err(e) => {
                prop_assert!(e.status.is_client_error(), "{surface:?}: {e:?}");
                let shaped = surface.error_shape().body(&e);
                let message = match surface.error_shape() {
                    ErrorShape::OpenAi => shaped["error"]["message"].as_str(),
                    ErrorShape::Anthropic => shaped["error"]["message"].as_str(),
                    ErrorShape::Ollama => shaped["error"].as_str(),
                };
                prop_assert!(
                    message.is_some_and(|m| !m.is_empty()),
                    "{surface:?}: {shaped}"
                );
            }
        }
    }
    if let Err(e) = runs::decode(body) {
        prop_assert!(e.status.is_client_error(), "runs: {e:?}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn any_json_request_decodes_or_is_a_4xx_in_its_apis_shape(body in request()) {
        check(serde_json::to_string(&body).unwrap().as_bytes())?;
    }

    #[test]
    fn any_bytes_decode_or_are_a_4xx(body in prop::collection::vec(any::<u8>(), 0..256)) {
        check(&body)?;
    }
}

#[test]
fn a_body_nested_to_the_limit_and_beyond_is_refused_without_recursion() {
    let deep = format!(
        "{{\"model\":\"g\",\"messages\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    for surface in SURFACES {
        let e = surface
            .decode(deep.as_bytes(), &HeaderMap::new())
            .unwrap_err();
        assert_eq!(e.status, 400, "{surface:?}");
    }
}
