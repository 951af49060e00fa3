//! A client's JSON request body kept as its top-level fields in their original order, each
//! value as raw JSON text. Reading a field parses only that field; rewriting `model` for
//! the tunnel re-emits every other field byte for byte.
//!
//! Parsing is strict where an ambiguity could let a request mean one thing to the edge and
//! another to the backend: a top-level key given twice is refused (the edge would read the
//! first, most backends the last), and so is nesting deeper than [`MAX_JSON_DEPTH`]
//! (checked without recursion, so no depth can overflow a stack). A body with more than
//! [`MAX_JSON_CONTAINERS`] arrays and objects is refused before anything is built from it:
//! decoding builds a tree of every one of them, hundreds of bytes each, so a few megabytes
//! of tiny objects would cost the edge hundreds of megabytes.
//!
//! Pure: no I/O.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, DeserializeOwned, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::error::ApiError;

/// A field holds a value of another type (or out of the type's range) than required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrongType;

/// The top-level fields of a JSON object request body.
#[derive(Debug)]
pub struct ClientRequest<'a> {
    /// Keys are borrowed from the body unless they hold escapes.
    fields: Vec<(Cow<'a, str>, &'a RawValue)>,
}

/// Deepest nesting of arrays and objects accepted in a request body.
pub const MAX_JSON_DEPTH: usize = 64;

/// Most arrays and objects accepted in a request body, all levels together. A long agent
/// conversation has some thousands (a message, its content parts, its tool calls); 140,000
/// one-character text blocks fit in 4 MiB.
pub const MAX_JSON_CONTAINERS: usize = 50_000;

/// Refuses JSON nested deeper than `max` arrays and objects, or holding more than
/// `max_containers` of them. One pass over the bytes, no recursion; strings (and the
/// brackets inside them) are skipped.
pub fn check_shape(body: &[u8], max: usize, max_containers: usize) -> Result<(), ApiError> {
    let mut depth = 0usize;
    let mut containers = 0usize;
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => {
                // Skip to the closing quote, over escapes.
                i += 1;
                loop {
                    match memchr::memchr2(b'"', b'\\', &body[i.min(body.len())..]) {
                        Some(at) if body[i + at] == b'\\' => i += at + 2,
                        Some(at) => {
                            i += at;
                            break;
                        }
                        None => return Ok(()), // unterminated: the parser reports it
                    }
                }
            }
            b'{' | b'[' => {
                depth += 1;
                containers += 1;
                if containers > max_containers {
                    return Err(ApiError::bad_request(
                        "invalid_json",
                        format!(
                            "the request body holds more than {max_containers} JSON arrays and objects"
                        ),
                    ));
                }
                if depth > max {
                    return Err(ApiError::bad_request(
                        "invalid_json",
                        format!("the request body is nested deeper than {max} levels"),
                    ));
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// A JSON body of a fixed shape (the runs API): strict (unknown and duplicate fields are
/// errors, from the serde derive), depth-checked, and an error names the field in `param`.
pub fn parse_typed<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    check_shape(body, MAX_JSON_DEPTH, MAX_JSON_CONTAINERS)?;
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = inner.to_string();
        // A duplicate or unknown field is reported at the object that holds it.
        let field = ["duplicate field `", "unknown field `"]
            .iter()
            .find_map(|p| message.split(p).nth(1)?.split('`').next().map(String::from));
        let param = match (path.as_str(), field) {
            (".", Some(f)) => Some(f),
            (p, Some(f)) if p == f || p.ends_with(&format!(".{f}")) => Some(p.to_string()),
            (p, Some(f)) => Some(format!("{p}.{f}")),
            (".", None) => None,
            (p, None) => Some(p.to_string()),
        };
        let e = ApiError::bad_request("invalid_request", format!("invalid request: {message}"));
        match param {
            Some(p) => e.with_param(p),
            None => e,
        }
    })
}

impl<'a> ClientRequest<'a> {
    /// Parses a body that must be one JSON object with each top-level key once.
    pub fn parse(body: &'a [u8]) -> Result<Self, ApiError> {
        let text = std::str::from_utf8(body)
            .map_err(|_| ApiError::bad_request("invalid_json", "the request body is not UTF-8"))?;
        let trimmed = text.trim_start();
        if !trimmed.starts_with('{') {
            return Err(ApiError::bad_request(
                "invalid_json",
                "the request body must be a JSON object",
            ));
        }
        check_shape(body, MAX_JSON_DEPTH, MAX_JSON_CONTAINERS)?;
        let request = serde_json::from_str::<ClientRequest>(text).map_err(|e| {
            ApiError::bad_request(
                "invalid_json",
                format!("the request body is not valid JSON: {e}"),
            )
        })?;
        if let Some(key) = request.duplicate_key() {
            return Err(ApiError::bad_request(
                "duplicate_key",
                format!("`{key}` is given more than once; give each field once"),
            )
            .with_param(key));
        }
        Ok(request)
    }

    fn duplicate_key(&self) -> Option<&str> {
        let keys = self.fields.iter().map(|(k, _)| k.as_ref());
        if self.fields.len() <= 16 {
            let mut seen: Vec<&str> = Vec::with_capacity(self.fields.len());
            for key in keys {
                if seen.contains(&key) {
                    return Some(key);
                }
                seen.push(key);
            }
            return None;
        }
        let mut seen = foldhash::HashSet::default();
        keys.into_iter().find(|&key| !seen.insert(key))
    }

    /// A field that must be a `T` when present: `Ok(None)` if absent or `null`,
    /// `Err(WrongType)` if it is something else.
    pub fn typed<T: Deserialize<'a>>(&self, key: &str) -> Result<Option<T>, WrongType> {
        match self.raw(key) {
            None => Ok(None),
            Some(raw) if raw.get().trim() == "null" => Ok(None),
            Some(raw) => serde_json::from_str(raw.get())
                .map(Some)
                .map_err(|_| WrongType),
        }
    }

    pub fn raw(&self, key: &str) -> Option<&'a RawValue> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// A field parsed as `T`; `None` if absent or of another type.
    pub fn get<T: Deserialize<'a>>(&self, key: &str) -> Option<T> {
        serde_json::from_str(self.raw(key)?.get()).ok()
    }

    /// A field as a JSON value (`Null` if absent).
    pub fn value(&self, key: &str) -> Value {
        self.get::<Value>(key).unwrap_or(Value::Null)
    }

    pub fn has(&self, key: &str) -> bool {
        self.raw(key).is_some()
    }

    /// Bytes of every field's raw value.
    pub fn raw_len(&self) -> usize {
        self.fields.iter().map(|(_, v)| v.get().len()).sum()
    }

    /// The body with `model` set to `model` and every other field as the client sent it.
    #[cfg(test)]
    pub fn with_model(&self, model: &str) -> Vec<u8> {
        let model = serde_json::to_string(model).expect("strings serialize");
        self.with_fields(&[("model", &model)])
    }

    /// The body with each `(key, raw JSON)` of `set` in place of the client's field of that
    /// key (the first, where it is there) or appended after the others, and every other
    /// field as the client sent it.
    pub fn with_fields(&self, set: &[(&str, &str)]) -> Vec<u8> {
        let size: usize = self
            .fields
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .chain(set.iter().map(|(k, v)| k.len() + v.len() + 4))
            .sum();
        let mut out = Vec::with_capacity(size + 2);
        out.push(b'{');
        let mut written = vec![false; set.len()];
        let field = |out: &mut Vec<u8>, key: &str, raw: &str| {
            if out.len() > 1 {
                out.push(b',');
            }
            serde_json::to_writer(&mut *out, key).expect("strings serialize");
            out.push(b':');
            out.extend_from_slice(raw.as_bytes());
        };
        for (key, raw) in &self.fields {
            match set.iter().position(|(k, _)| k == key) {
                Some(i) if !written[i] => {
                    written[i] = true;
                    field(&mut out, key, set[i].1);
                }
                _ => field(&mut out, key, raw.get()),
            }
        }
        for (i, (key, raw)) in set.iter().enumerate() {
            if !written[i] {
                field(&mut out, key, raw);
            }
        }
        out.push(b'}');
        out
    }

    /// Every field parsed, for the normalized-run path.
    pub fn to_map(&self) -> Map<String, Value> {
        self.fields
            .iter()
            .filter_map(|(k, v)| Some((k.to_string(), serde_json::from_str(v.get()).ok()?)))
            .collect()
    }
}

impl<'de> Deserialize<'de> for ClientRequest<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = ClientRequest<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((Key(key), value)) = map.next_entry::<Key<'de>, &'de RawValue>()? {
                    fields.push((key, value));
                }
                Ok(ClientRequest { fields })
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

/// An object key, borrowed from the body when it can be (no escapes in it).
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewriting_model_keeps_everything_else_byte_for_byte() {
        let body = br#"{"messages":[{"role":"user","content":"h\u00e9llo  "}],"model":"group","temperature":0.70,"x":{"deep":[1, 2]}}"#;
        let r = ClientRequest::parse(body).unwrap();
        let out = String::from_utf8(r.with_model("up/stream")).unwrap();
        assert_eq!(
            out,
            r#"{"messages":[{"role":"user","content":"h\u00e9llo  "}],"model":"up/stream","temperature":0.70,"x":{"deep":[1, 2]}}"#
        );
    }

    #[test]
    fn set_fields_replace_in_place_or_come_last() {
        let body = br#"{"model":"group","stream_options":null,"stream":true}"#;
        let r = ClientRequest::parse(body).unwrap();
        let out = r.with_fields(&[("stream_options", r#"{"include_usage":true}"#), ("x", "1")]);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"model":"group","stream_options":{"include_usage":true},"stream":true,"x":1}"#
        );
        let r = ClientRequest::parse(b"{}").unwrap();
        assert_eq!(r.with_model("m"), br#"{"model":"m"}"#);
    }

    #[test]
    fn keys_with_escapes_are_read_as_their_text() {
        let r = ClientRequest::parse(br#"{"mo\u0064el":"m","stream":true}"#).unwrap();
        assert_eq!(r.get::<String>("model").as_deref(), Some("m"));
        assert!(ClientRequest::parse(br#"{"model":1,"mode\u006c":2}"#).is_err());
    }

    #[test]
    fn fields_parse_on_demand() {
        let r = ClientRequest::parse(br#"{"model":"m","stream":true,"max_tokens":5}"#).unwrap();
        assert_eq!(r.get::<String>("model").as_deref(), Some("m"));
        assert_eq!(r.get::<bool>("stream"), Some(true));
        assert_eq!(r.get::<u64>("max_tokens"), Some(5));
        assert_eq!(r.get::<bool>("model"), None);
        assert!(r.value("nope").is_null());
        assert_eq!(r.to_map().len(), 3);
    }

    #[test]
    fn duplicate_top_level_keys_are_refused_naming_the_key() {
        for body in [
            &br#"{"model":"group","model":"x","messages":[]}"#[..],
            br#"{"stream":false,"a":1,"stream":true}"#,
        ] {
            let e = ClientRequest::parse(body).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code()), (400, "duplicate_key"));
            assert!(e.param.is_some());
        }
        // Many fields take the hashed path.
        let mut body = String::from("{");
        for i in 0..100 {
            body.push_str(&format!("\"k{i}\":{i},"));
        }
        body.push_str("\"k7\":0}");
        let e = ClientRequest::parse(body.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("k7"));
        // The same key inside different objects is fine.
        ClientRequest::parse(br#"{"a":{"x":1},"b":{"x":2}}"#).unwrap();
    }

    #[test]
    fn a_body_of_too_many_arrays_and_objects_is_refused() {
        let block = r#"{"type":"text","text":"a"},"#;
        let many = |n: usize| {
            let blocks = block.repeat(n);
            format!(r#"{{"messages":[{}]}}"#, blocks.trim_end_matches(','))
        };
        // The top-level object and the array count too.
        ClientRequest::parse(many(MAX_JSON_CONTAINERS - 2).as_bytes()).unwrap();
        let e = ClientRequest::parse(many(MAX_JSON_CONTAINERS - 1).as_bytes()).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.message
                .contains("more than 50000 JSON arrays and objects")
        );
        // Brackets inside strings are text.
        let text = format!(r#"{{"x":"{}"}}"#, "{}".repeat(MAX_JSON_CONTAINERS));
        ClientRequest::parse(text.as_bytes()).unwrap();
    }

    #[test]
    fn deep_nesting_is_refused_without_recursion() {
        let deep = format!("{{\"x\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
        let e = ClientRequest::parse(deep.as_bytes()).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("nested deeper"), "{}", e.message);
        let ok = format!("{{\"x\":{}{}}}", "[".repeat(63), "]".repeat(63));
        ClientRequest::parse(ok.as_bytes()).unwrap();
        // A body that ends in an escape inside a string is the parser's to refuse.
        assert!(check_shape(b"\"\\", MAX_JSON_DEPTH, 1).is_ok());
        assert!(parse_typed::<serde_json::Value>(b"{\"a\":\"\\").is_err());
        // Brackets inside strings do not count, escaped quotes do not end the string.
        let s = format!("{{\"x\":\"\\\"{}\"}}", "[".repeat(1000));
        ClientRequest::parse(s.as_bytes()).unwrap();
        let typed = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        assert!(parse_typed::<serde_json::Value>(typed.as_bytes()).is_err());
    }

    #[test]
    fn typed_fields_tell_null_absent_and_wrong_apart() {
        let r = ClientRequest::parse(br#"{"a":true,"b":null,"c":"5"}"#).unwrap();
        assert_eq!(r.typed::<bool>("a"), Ok(Some(true)));
        assert_eq!(r.typed::<bool>("b"), Ok(None));
        assert_eq!(r.typed::<bool>("z"), Ok(None));
        assert_eq!(r.typed::<u64>("c"), Err(WrongType));
    }

    #[test]
    fn typed_bodies_name_the_offending_field() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Body {
            n: Option<u32>,
            inner: Option<Inner>,
        }
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Inner {
            k: String,
        }
        let param = |body: &str| parse_typed::<Body>(body.as_bytes()).unwrap_err().param;
        assert_eq!(param(r#"{"n":-1}"#).as_deref(), Some("n"));
        assert_eq!(param(r#"{"n":"5"}"#).as_deref(), Some("n"));
        assert_eq!(param(r#"{"n":1,"n":2}"#).as_deref(), Some("n"));
        assert_eq!(param(r#"{"zz":1}"#).as_deref(), Some("zz"));
        assert_eq!(param(r#"{"inner":{"k":1}}"#).as_deref(), Some("inner.k"));
    }

    #[test]
    fn non_objects_and_broken_json_are_400s() {
        for body in [&b"[1,2]"[..], b"{\"model\":", b"\xff\xfe", b"42"] {
            let e = ClientRequest::parse(body).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.code(), "invalid_json");
        }
    }
}
