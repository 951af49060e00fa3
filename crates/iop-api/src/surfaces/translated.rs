//! The requests of the APIs the edge translates into the canonical (chat) form — the
//! Responses and Messages APIs: what the edge itself reads of them is checked for every
//! member (a bad `stream` or token count is a 400 wherever it would go); the translation
//! is made once, and one it refuses leaves the request to members that serve the API
//! themselves.
//!
//! Pure: no I/O.

use serde_json::{Map, Value, json};

use crate::canonical::fields::{invalid, opt_array, opt_bool, opt_number, opt_string, string};
use crate::canonical::{ApiError, Canonical, ClientRequest, Decoded, Native, NativeApi, Operation};
use crate::provider_api::ProviderApi;
use crate::surfaces::openai::requested_group;

/// What the edge itself reads of a translatable request, checked for every member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    pub stream: bool,
    /// The most tokens the answer may have, if the request says.
    pub max_output_tokens: Option<u64>,
}

/// How one translated API reads its requests.
pub struct Api {
    pub api: ProviderApi,
    /// What the edge reads of a request, for every member.
    pub check: fn(&ClientRequest) -> Result<Checked, ApiError>,
    /// The chat request a request means (its `model` kept: the dispatch rewrites it).
    pub to_chat: fn(&ClientRequest) -> Result<Map<String, Value>, ApiError>,
}

impl Api {
    /// Reads and checks a request and translates it. `headers`: the client headers a
    /// provider that serves the API itself gets.
    pub fn decode<'a>(
        &self,
        body: &'a [u8],
        headers: Vec<iop_proto::pb::Header>,
    ) -> Result<Decoded<'a>, ApiError> {
        let request = ClientRequest::parse(body)?;
        let model = requested_group(&request)?;
        let checked = (self.check)(&request)?;
        let canonical = match (self.to_chat)(&request) {
            Ok(chat) => Canonical::Translated(
                serde_json::to_vec(&Value::Object(chat)).expect("JSON values serialize"),
            ),
            Err(refused) => Canonical::Refused(refused),
        };
        Ok(Decoded {
            model,
            op: Operation::Chat,
            stream: checked.stream,
            native: Native {
                api: NativeApi::Provider(self.api),
                request,
                headers,
            },
            canonical,
            max_output_tokens: checked.max_output_tokens,
            immediate: None,
        })
    }
}

/// The request's `stream` flag (absent: false).
pub fn stream(request: &ClientRequest) -> Result<bool, ApiError> {
    Ok(request
        .typed::<bool>("stream")
        .map_err(|_| invalid("stream", "a boolean"))?
        .unwrap_or(false))
}

/// The 400 for a required field the request lacks.
pub fn missing(param: &str, code: &str, message: &str) -> ApiError {
    ApiError::bad_request(code, message).with_param(param)
}

/// `temperature` and `top_p`, if numbers, as they are.
pub fn temperature_and_top_p(
    body: &Map<String, Value>,
    chat: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    for key in ["temperature", "top_p"] {
        if opt_number(body, key, "")?.is_some() {
            chat.insert(key.into(), body[key].clone());
        }
    }
    Ok(())
}

/// `tools`, each read by `tool`, as chat's `tools` (left out when there are none).
pub fn tools(
    body: &Map<String, Value>,
    chat: &mut Map<String, Value>,
    tool: fn(&Value, &str) -> Result<Value, ApiError>,
) -> Result<(), ApiError> {
    if let Some(tools) = opt_array(body, "tools", "")? {
        let tools = tools
            .iter()
            .enumerate()
            .map(|(i, t)| tool(t, &format!("tools[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        if !tools.is_empty() {
            chat.insert("tools".into(), Value::Array(tools));
        }
    }
    Ok(())
}

/// A chat function tool: `t`'s name, description and `strict`, with `parameters`.
pub fn function_tool(
    t: &Map<String, Value>,
    at: &str,
    parameters: Option<Value>,
) -> Result<Value, ApiError> {
    let mut function = json!({"name": string(t, "name", at)?});
    if let Some(d) = opt_string(t, "description", at)? {
        function["description"] = d.into();
    }
    if let Some(p) = parameters {
        function["parameters"] = p;
    }
    if let Some(s) = opt_bool(t, "strict", at)? {
        function["strict"] = s.into();
    }
    Ok(json!({"type": "function", "function": function}))
}
