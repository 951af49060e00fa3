//! Ollama API requests (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`,
//! `/api/show`) as the edge reads them: typed, with every field the edge reads checked
//! (a wrong one is a 400 naming it) and everything else left for Ollama members. What
//! they become for other members is [`super::translate`].
//!
//! Pure.

use serde::Deserialize;
use serde::de::{DeserializeOwned, Deserializer};
use serde_json::{Map, Value, json};

use crate::canonical::ApiError;
use crate::canonical::json::parse_typed;

/// `null` reads as the type's default (clients send `"images": null` and the like).
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// `think`: on/off, or a level.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Think {
    On(bool),
    Level(String),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ToolFunction {
    #[serde(default, deserialize_with = "nullable")]
    pub name: String,
    /// An object (Ollama's shape).
    #[serde(default, deserialize_with = "nullable")]
    pub arguments: Value,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ToolCall {
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
    #[serde(default, deserialize_with = "nullable")]
    pub function: ToolFunction,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default, deserialize_with = "nullable")]
    pub content: String,
    #[serde(default, deserialize_with = "nullable")]
    pub images: Vec<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, deserialize_with = "nullable")]
    pub tool_name: String,
    #[serde(default, deserialize_with = "nullable")]
    pub tool_call_id: String,
}

/// What `/api/chat` and `/api/generate` share: the model, whether to stream, the output
/// format, the generation options, thinking and `keep_alive`.
#[derive(Debug, Clone, Deserialize)]
pub struct Generation {
    pub model: String,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub format: Option<Value>,
    #[serde(default)]
    pub options: Option<Map<String, Value>>,
    #[serde(default)]
    pub think: Option<Think>,
    /// Read only to answer a load or unload request (no messages, no prompt).
    #[serde(default)]
    pub keep_alive: Option<Value>,
}

impl Generation {
    /// Streams unless the client said `"stream": false` (Ollama's default).
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(true)
    }

    pub fn options(&self) -> Result<Options, ApiError> {
        Options::read(self.options.as_ref())
    }
}

/// A request of `/api/chat` (`T` = [`Chat`]) or `/api/generate` ([`Generate`]): what both
/// share, and the endpoint's own fields.
#[derive(Debug, Clone)]
pub struct Generating<T> {
    pub generation: Generation,
    pub fields: T,
}

impl<T: DeserializeOwned> Generating<T> {
    /// Reads the shared fields, then the endpoint's own; an error names the field.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        Ok(Self {
            generation: parse(body)?,
            fields: parse(body)?,
        })
    }
}

/// `POST /api/chat`.
pub type ChatRequest = Generating<Chat>;
/// `POST /api/generate`.
pub type GenerateRequest = Generating<Generate>;

/// The fields of `/api/chat` beyond [`Generation`].
#[derive(Debug, Clone, Deserialize)]
pub struct Chat {
    #[serde(default, deserialize_with = "nullable")]
    pub messages: Vec<Message>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
}

/// The fields of `/api/generate` beyond [`Generation`].
#[derive(Debug, Clone, Deserialize)]
pub struct Generate {
    #[serde(default, deserialize_with = "nullable")]
    pub prompt: String,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub system: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub images: Vec<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub raw: bool,
}

/// `input` of `/api/embed`: one text or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum EmbedInput {
    One(String),
    Many(Vec<String>),
}

/// `POST /api/embed`.
#[derive(Debug, Clone, Deserialize)]
pub struct EmbedRequest {
    pub model: String,
    pub input: EmbedInput,
    #[serde(default)]
    pub dimensions: Option<u32>,
}

/// `POST /api/embeddings` (Ollama's older embeddings endpoint).
#[derive(Debug, Clone, Deserialize)]
pub struct EmbeddingsRequest {
    pub model: String,
    #[serde(default, deserialize_with = "nullable")]
    pub prompt: String,
}

/// `POST /api/show`: the model as `model` (or the older `name`).
#[derive(Debug, Clone, Deserialize)]
pub struct ShowRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

/// Parses a body of one of the request types; the error names the field.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse_typed(body)
}

/// The generation options the edge reads, checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Options {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Vec<String>,
    /// `num_predict` when it is a limit (zero or more).
    pub max_tokens: Option<u64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
}

impl Options {
    /// Reads `options`; a known option of the wrong type is a 400 naming it.
    pub fn read(options: Option<&Map<String, Value>>) -> Result<Self, ApiError> {
        let Some(options) = options else {
            return Ok(Self::default());
        };
        let wrong = |key: &str, what: &str| {
            ApiError::invalid_param(
                &format!("options.{key}"),
                format!("`options.{key}` must be {what}"),
            )
        };
        let number = |key: &str| match options.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| wrong(key, "a number")),
        };
        let integer = |key: &str| match options.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_i64().map(Some).ok_or_else(|| wrong(key, "an integer")),
        };
        let stop = match options.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| s.as_str().map(String::from))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| wrong("stop", "an array of strings"))?,
            Some(_) => return Err(wrong("stop", "an array of strings")),
        };
        Ok(Self {
            temperature: number("temperature")?,
            top_p: number("top_p")?,
            seed: integer("seed")?,
            stop,
            max_tokens: integer("num_predict")?.and_then(|n| u64::try_from(n).ok()),
            frequency_penalty: number("frequency_penalty")?,
            presence_penalty: number("presence_penalty")?,
        })
    }
}

/// `format` as OpenAI's `response_format`: `None` for no format.
pub fn response_format(format: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(json!({"type": "json_object"}))),
        Some(schema @ Value::Object(_)) => Ok(Some(json!({
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": schema},
        }))),
        Some(_) => Err(ApiError::invalid_param(
            "format",
            "`format` must be \"json\" or a JSON schema object",
        )),
    }
}

/// `think` checked: a boolean or `"low"`, `"medium"`, `"high"`; the level, if one.
pub fn think_level(think: Option<&Think>) -> Result<Option<&str>, ApiError> {
    match think {
        None | Some(Think::On(_)) => Ok(None),
        Some(Think::Level(l)) if matches!(l.as_str(), "low" | "medium" | "high") => {
            Ok(Some(l.as_str()))
        }
        Some(Think::Level(_)) => Err(ApiError::invalid_param(
            "think",
            "`think` must be true, false, \"low\", \"medium\" or \"high\"",
        )),
    }
}

/// Whether `keep_alive` asks to unload the model at once (`0`, `"0"`, `"0s"`, ...).
pub fn unloads(keep_alive: Option<&Value>) -> bool {
    match keep_alive {
        Some(Value::Number(n)) => n.as_f64() == Some(0.0),
        Some(Value::String(s)) => {
            let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
            !digits.is_empty() && digits.parse::<f64>().ok() == Some(0.0)
        }
        _ => false,
    }
}

impl EmbedRequest {
    pub fn texts(&self) -> Vec<&str> {
        match &self.input {
            EmbedInput::One(s) => vec![s.as_str()],
            EmbedInput::Many(items) => items.iter().map(String::as_str).collect(),
        }
    }
}

impl ShowRequest {
    pub fn model(&self) -> Option<&str> {
        self.model
            .as_deref()
            .or(self.name.as_deref())
            .filter(|m| !m.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> ChatRequest {
        ChatRequest::parse(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn stream_defaults_to_true_as_in_ollama() {
        assert!(chat(json!({"model": "m"})).generation.stream());
        assert!(
            !chat(json!({"model": "m", "stream": false}))
                .generation
                .stream()
        );
        assert!(
            chat(json!({"model": "m", "stream": null}))
                .generation
                .stream()
        );
    }

    #[test]
    fn a_wrong_option_is_a_400_naming_it() {
        for (options, param) in [
            (json!({"temperature": "hot"}), "options.temperature"),
            (json!({"num_predict": 1.5}), "options.num_predict"),
            (json!({"stop": [1]}), "options.stop"),
            (json!({"seed": "x"}), "options.seed"),
        ] {
            let r = chat(json!({"model": "m", "options": options}));
            let e = r.canonical().unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param));
        }
        let e = ChatRequest::parse(br#"{"model": "m", "messages": [{"role": 1}]}"#).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.param.unwrap().contains("messages[0].role"));
        let e = ChatRequest::parse(br#"{"messages": []}"#).unwrap_err();
        assert!(e.message.contains("model"), "{}", e.message);
    }

    #[test]
    fn keep_alive_zero_unloads() {
        for zero in [json!(0), json!(0.0), json!("0"), json!("0s"), json!("0m")] {
            assert!(unloads(Some(&zero)), "{zero}");
        }
        for other in [json!(-1), json!("5m"), json!("s"), json!(null), json!(true)] {
            assert!(!unloads(Some(&other)), "{other}");
        }
        assert!(!unloads(None));
    }

    #[test]
    fn embed_input_is_one_text_or_many() {
        let e: EmbedRequest = parse(br#"{"model": "m", "input": "a"}"#).unwrap();
        assert_eq!(e.canonical()["input"], json!(["a"]));
        let e: EmbedRequest =
            parse(br#"{"model": "m", "input": ["a", "b"], "dimensions": 8}"#).unwrap();
        assert_eq!(e.canonical()["dimensions"], 8);
        assert!(parse::<EmbedRequest>(br#"{"model": "m", "input": 3}"#).is_err());
        let s: ShowRequest = parse(br#"{"name": "old"}"#).unwrap();
        assert_eq!(s.model(), Some("old"));
    }
}
