//! The body a tunnelled provider gets: the request (the canonical one, or the client's own
//! in an API the provider serves) with `model` rewritten to the member's upstream name and
//! every other field as the client sent it, byte for byte.
//!
//! Usage for every tunnelled stream: a streamed chat or completions request whose client
//! did not ask for usage (`stream_options.include_usage`) is sent to the provider asking
//! for it, and the tunnel request says so (`usage_injected`), so that the node removes
//! what that added from the stream the client receives and reports the usage on the side.
//! vLLM's `continuous_usage_stats` is turned off in the injected options, so the provider
//! reports usage once, in its own chunk.
//!
//! Pure: no I/O.

use serde_json::{Map, Value};

use crate::canonical::ClientRequest;

/// Whether the client asked for usage itself (`stream_options.include_usage: true`).
pub fn client_asked(request: &ClientRequest) -> bool {
    /// The one option read here, without building the client's whole object.
    #[derive(serde::Deserialize)]
    struct StreamOptions {
        include_usage: Option<serde_json::Value>,
    }
    request
        .get::<StreamOptions>("stream_options")
        .and_then(|o| o.include_usage?.as_bool())
        .unwrap_or(false)
}

/// The request body for the provider: `model` rewritten to `model` and, when `inject`,
/// `stream_options` with `include_usage: true` (and `continuous_usage_stats: false` if the
/// client set it), the client's other stream options kept.
pub fn provider_body(request: &ClientRequest, model: &str, inject: bool) -> Vec<u8> {
    let model = serde_json::to_string(model).expect("strings serialize");
    if !inject {
        return request.with_fields(&[("model", &model)]);
    }
    let mut options = request
        .get::<Map<String, Value>>("stream_options")
        .unwrap_or_default();
    options.insert("include_usage".into(), Value::Bool(true));
    if let Some(continuous) = options.get_mut("continuous_usage_stats") {
        *continuous = Value::Bool(false);
    }
    let options = Value::Object(options).to_string();
    request.with_fields(&[("model", &model), ("stream_options", &options)])
}

/// A background Responses request's body as its provider gets it: streamed, and not in
/// the background (the node keeps the answer; the edge keeps it going without a client).
pub fn in_the_foreground(body: Vec<u8>) -> Vec<u8> {
    match ClientRequest::parse(&body) {
        Ok(request) => request.with_fields(&[("stream", "true"), ("background", "false")]),
        Err(_) => body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_background_request_goes_to_its_provider_streamed_in_the_foreground() {
        let body = br#"{"model":"up","background":true,"input":"hi"}"#.to_vec();
        let out: Value = serde_json::from_slice(&in_the_foreground(body)).unwrap();
        assert_eq!(out["stream"], true);
        assert_eq!(out["background"], false);
        assert_eq!(out["input"], "hi");
    }

    fn rewrite(body: &str, inject: bool) -> String {
        let r = ClientRequest::parse(body.as_bytes()).unwrap();
        String::from_utf8(provider_body(&r, "up", inject)).unwrap()
    }

    #[test]
    fn usage_is_added_and_merged_into_the_clients_stream_options() {
        assert_eq!(
            rewrite(r#"{"model":"g","stream":true,"messages":[]}"#, true),
            r#"{"model":"up","stream":true,"messages":[],"stream_options":{"include_usage":true}}"#
        );
        assert_eq!(
            rewrite(
                r#"{"model":"g","stream_options":{"include_usage":false,"x":1},"stream":true}"#,
                true
            ),
            r#"{"model":"up","stream_options":{"include_usage":true,"x":1},"stream":true}"#
        );
        assert_eq!(
            rewrite(
                r#"{"stream_options":{"continuous_usage_stats":true},"model":"g"}"#,
                true
            ),
            r#"{"stream_options":{"continuous_usage_stats":false,"include_usage":true},"model":"up"}"#
        );
        assert_eq!(
            rewrite(r#"{"model":"g","stream_options":null}"#, true),
            r#"{"model":"up","stream_options":{"include_usage":true}}"#
        );
        // Off: only the model changes, byte for byte.
        assert_eq!(
            rewrite(r#"{"model":"g", "stream":true}"#, false),
            r#"{"model":"up","stream":true}"#
        );
    }

    #[test]
    fn only_an_explicit_true_counts_as_asked() {
        let asked = |body: &str| client_asked(&ClientRequest::parse(body.as_bytes()).unwrap());
        assert!(asked(r#"{"stream_options":{"include_usage":true}}"#));
        assert!(!asked(r#"{"stream_options":{"include_usage":false}}"#));
        assert!(!asked(r#"{"stream_options":{}}"#));
        assert!(!asked(r#"{"stream_options":null}"#));
        assert!(!asked(r#"{}"#));
    }
}
