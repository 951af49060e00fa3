//! A client's JSON request body kept as its top-level fields in their original order, each
//! value as raw JSON text. Reading a field parses only that field; rewriting `model` for
//! the tunnel re-emits every other field byte for byte.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::error::ApiError;

/// The top-level fields of a JSON object request body.
#[derive(Debug)]
pub struct ClientRequest<'a> {
    fields: Vec<(String, &'a RawValue)>,
}

impl<'a> ClientRequest<'a> {
    /// Parses a body that must be one JSON object.
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
        serde_json::from_str::<ClientRequest>(text).map_err(|e| {
            ApiError::bad_request(
                "invalid_json",
                format!("the request body is not valid JSON: {e}"),
            )
        })
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

    /// The body with `model` set to `model` and every other field as the client sent it.
    pub fn with_model(&self, model: &str) -> Vec<u8> {
        let size: usize = self
            .fields
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum();
        let mut out = Vec::with_capacity(size + model.len() + 16);
        out.push(b'{');
        let mut wrote_model = false;
        for (i, (key, raw)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            serde_json::to_writer(&mut out, key).expect("strings serialize");
            out.push(b':');
            if key == "model" && !wrote_model {
                serde_json::to_writer(&mut out, model).expect("strings serialize");
                wrote_model = true;
            } else {
                out.extend_from_slice(raw.get().as_bytes());
            }
        }
        out.push(b'}');
        out
    }

    /// Every field parsed, for the normalized-run path.
    pub fn to_map(&self) -> Map<String, Value> {
        self.fields
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), serde_json::from_str(v.get()).ok()?)))
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
                while let Some((key, value)) = map.next_entry::<String, &'de RawValue>()? {
                    fields.push((key, value));
                }
                Ok(ClientRequest { fields })
            }
        }
        deserializer.deserialize_map(Fields)
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
    fn non_objects_and_broken_json_are_400s() {
        for body in [&b"[1,2]"[..], b"{\"model\":", b"\xff\xfe", b"42"] {
            let e = ClientRequest::parse(body).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.code, "invalid_json");
        }
    }
}
