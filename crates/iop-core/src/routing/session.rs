//! The session key of a request: what a client already sends to name its conversation,
//! looked up in this order (the first that is there and not empty wins):
//!
//! 1. the `x-session-id` header;
//! 2. the body's `session_id`, then `user` (OpenAI);
//! 3. the body's `prompt_cache_key` (OpenAI's cache hint; Codex sends its conversation id);
//! 4. the body's `metadata.user_id` (Anthropic; Claude Code puts its session in it);
//! 5. an agent's own session header: `session_id` (Codex), `x-claude-code-session-id`.
//!
//! Only the key's hash is kept (it steers; it is never logged or stored). Pure.

use http::HeaderMap;
use serde_json::Value;

use crate::canonical::ClientRequest;

/// The header a client may send to name its session for routing.
pub const SESSION_HEADER: &str = "x-session-id";

/// Agents' own session headers, read after every body field.
const AGENT_HEADERS: &[&str] = &["session_id", "x-claude-code-session-id"];

/// The longest key read (longer ones are cut: a key only needs to be distinct).
const MAX_KEY_BYTES: usize = 512;

/// The session key of a request with these `headers` and `body` (the client's own
/// request, in its own API), if it names one.
pub fn session_key<'a>(headers: &'a HeaderMap, body: &'a ClientRequest<'a>) -> Option<String> {
    header(headers, SESSION_HEADER)
        .or_else(|| body_string(body, "session_id"))
        .or_else(|| body_string(body, "user"))
        .or_else(|| body_string(body, "prompt_cache_key"))
        .or_else(|| {
            body.value("metadata")
                .get("user_id")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(String::from)
        })
        .or_else(|| AGENT_HEADERS.iter().find_map(|h| header(headers, h)))
        .map(|mut key| {
            if key.len() > MAX_KEY_BYTES {
                let mut end = MAX_KEY_BYTES;
                while !key.is_char_boundary(end) {
                    end -= 1;
                }
                key.truncate(end);
            }
            key
        })
}

/// The hash routing uses for a session key.
pub fn hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), 0x696f_702d_7365_7373)
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
}

fn body_string(body: &ClientRequest, field: &str) -> Option<String> {
    body.get::<String>(field).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(headers: &[(&str, &str)], body: &str) -> Option<String> {
        let mut map = HeaderMap::new();
        for (n, v) in headers {
            map.insert(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        let body = ClientRequest::parse(body.as_bytes()).unwrap();
        session_key(&map, &body)
    }

    #[test]
    fn sources_in_order() {
        let all =
            r#"{"session_id":"s","user":"u","prompt_cache_key":"p","metadata":{"user_id":"m"}}"#;
        assert_eq!(key(&[("x-session-id", "h")], all).as_deref(), Some("h"));
        assert_eq!(key(&[], all).as_deref(), Some("s"));
        assert_eq!(
            key(&[], r#"{"user":"u","prompt_cache_key":"p"}"#).as_deref(),
            Some("u")
        );
        assert_eq!(
            key(&[("session_id", "codex")], r#"{"prompt_cache_key":"p"}"#).as_deref(),
            Some("p")
        );
        assert_eq!(
            key(&[], r#"{"metadata":{"user_id":"user_x_session_1"}}"#).as_deref(),
            Some("user_x_session_1")
        );
        assert_eq!(
            key(&[("session_id", "codex")], "{}").as_deref(),
            Some("codex")
        );
        assert_eq!(
            key(&[("x-claude-code-session-id", "cc")], "{}").as_deref(),
            Some("cc")
        );
    }

    #[test]
    fn empty_or_absent_is_none_and_long_keys_are_cut() {
        assert_eq!(key(&[("x-session-id", " ")], r#"{"user":""}"#), None);
        assert_eq!(key(&[], r#"{"user":5}"#), None);
        let long = "é".repeat(400);
        let got = key(&[], &format!(r#"{{"user":"{long}"}}"#)).unwrap();
        assert!(got.len() <= MAX_KEY_BYTES && got.len() >= MAX_KEY_BYTES - 1);
    }
}
