//! The model groups as Ollama models: `/api/tags` (every group the key may use),
//! `/api/ps` (the groups a connected node serves now), `/api/show` (one group's details,
//! `model_info` with its context length, capabilities) and `/api/version`.
//!
//! A group has no weights of its own, so `size` is 0, `digest` is the SHA-256 of its name
//! and `modified_at` the stable stand-in time of `/v1/models`' `created`. `/api/show` of a
//! group served by an Ollama member asks that member's Ollama (`ollama.show`, briefly) for
//! the model's details, `model_info`, capabilities, template and parameters; one served by
//! an OpenAI-compatible member asks what its `/v1/models` says (`models.show`: details,
//! parameter count, quantization, trained context); otherwise it says what the config
//! knows. A configured `context_length` wins either way.
//!
//! Pure: the config and the caller in, Ollama's JSON out.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

use super::models::{created, digest};
use crate::auth::Caller;
use crate::config::{EdgeConfig, ModelGroupConfig};
use crate::surfaces::ollama::render::timestamp;

/// The Ollama API version whose surface this edge serves (`/api/version`).
pub const OLLAMA_API_VERSION: &str = "0.12.0";

/// The `model_info` architecture of groups iop describes itself.
const ARCHITECTURE: &str = "iop";

/// The group a client's model name means, if the key may use it: the group of that name,
/// or of that name without Ollama's default `:latest` tag.
pub fn resolve<'a>(
    config: &'a EdgeConfig,
    caller: &Caller,
    name: &str,
) -> Option<&'a ModelGroupConfig> {
    config
        .resolve_group(name)
        .filter(|g| caller.may_use_model(&g.name))
}

fn modified_at(group: &ModelGroupConfig) -> String {
    timestamp(UNIX_EPOCH + Duration::from_secs(created(&group.name)))
}

fn details() -> Value {
    json!({
        "parent_model": "",
        "format": "",
        "family": "",
        "families": null,
        "parameter_size": "",
        "quantization_level": "",
    })
}

/// One group as an `/api/tags` entry.
pub fn tag(group: &ModelGroupConfig) -> Value {
    json!({
        "name": group.name,
        "model": group.name,
        "modified_at": modified_at(group),
        "size": 0,
        "digest": digest(&group.name),
        "details": details(),
    })
}

/// `/api/tags`.
pub fn tags(config: &EdgeConfig, caller: &Caller) -> Value {
    let models: Vec<Value> = config
        .model_groups
        .iter()
        .filter(|g| caller.may_use_model(&g.name))
        .map(tag)
        .collect();
    json!({"models": models})
}

/// `/api/ps`: the groups `served` says have a member on a connected node (`expires_at`
/// far ahead: a group stays served while its nodes are).
pub fn ps(
    config: &EdgeConfig,
    caller: &Caller,
    served: impl Fn(&ModelGroupConfig) -> bool,
    now: SystemTime,
) -> Value {
    let far = timestamp(now + Duration::from_secs(365 * 24 * 3600));
    let models: Vec<Value> = config
        .model_groups
        .iter()
        .filter(|g| caller.may_use_model(&g.name))
        .filter(|g| served(g))
        .map(|g| {
            let mut entry = tag(g);
            entry["expires_at"] = json!(far);
            entry["size_vram"] = json!(0);
            if let Some(n) = g.context_length {
                entry["context_length"] = json!(n);
            }
            entry
        })
        .collect();
    json!({"models": models})
}

/// `/api/show` from the config alone.
pub fn show_from_config(group: &ModelGroupConfig) -> Value {
    let mut info = Map::new();
    info.insert("general.architecture".into(), json!(ARCHITECTURE));
    info.insert("general.name".into(), json!(group.name));
    if let Some(n) = group.context_length {
        info.insert(format!("{ARCHITECTURE}.context_length"), json!(n));
    }
    json!({
        "license": "",
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": details(),
        "model_info": info,
        "capabilities": ["completion"],
        "modified_at": modified_at(group),
    })
}

/// `/api/show` from an Ollama member's own answer: its details, `model_info`,
/// capabilities, template, parameters and license (not its modelfile, which names the
/// node's files), under the group's name, with a configured context length put in.
pub fn show_from_member(group: &ModelGroupConfig, member: &Value) -> Value {
    let mut out = show_from_config(group);
    for key in [
        "details",
        "capabilities",
        "template",
        "parameters",
        "license",
    ] {
        if let Some(v) = member.get(key).filter(|v| !v.is_null()) {
            out[key] = v.clone();
        }
    }
    if let Some(info) = member.get("model_info").and_then(Value::as_object) {
        let mut info = info.clone();
        if let Some(n) = group.context_length {
            let arch = info
                .get("general.architecture")
                .and_then(Value::as_str)
                .unwrap_or(ARCHITECTURE)
                .to_string();
            info.insert(format!("{arch}.context_length"), json!(n));
        }
        out["model_info"] = Value::Object(info);
    }
    out
}

/// `/api/show` from what an OpenAI-compatible member's `/v1/models` says of the model
/// (the node's `models.show`: `{"data", "ollama"}`): the details llama-server lists in its
/// Ollama-style entry; the parameter count, quantization and trained context from the
/// entry's `meta` (llama-server) or its `max_model_len` (vLLM); a family the server does
/// not name is the leading letters of the model's name (`Qwen2.5-7B` → `qwen`). A
/// configured context length wins.
pub fn show_from_openai(group: &ModelGroupConfig, model: &str, member: &Value) -> Value {
    let mut out = show_from_config(group);
    let mut details = details();
    if let Some(reported) = member.pointer("/ollama/details").and_then(Value::as_object) {
        for (key, value) in reported {
            let empty = match value {
                Value::String(s) => s.is_empty(),
                Value::Array(a) => a.iter().all(|v| v.as_str().is_some_and(str::is_empty)),
                Value::Null => true,
                _ => false,
            };
            if !empty && details.get(key).is_some() {
                details[key.as_str()] = value.clone();
            }
        }
    }
    let meta = member.pointer("/data/meta");
    let unset = |details: &Value, key: &str| details[key].as_str().is_none_or(str::is_empty);
    if unset(&details, "parameter_size")
        && let Some(n) = meta.and_then(|m| m.get("n_params")).and_then(Value::as_u64)
    {
        details["parameter_size"] = json!(human_number(n));
    }
    if unset(&details, "quantization_level")
        && let Some(ftype) = meta.and_then(|m| m.get("ftype")).and_then(Value::as_str)
    {
        details["quantization_level"] = json!(quantization(ftype));
    }
    if unset(&details, "family") {
        let family = family_of(model);
        if !family.is_empty() {
            details["family"] = json!(family);
        }
    }
    if details["families"].is_null()
        && let Some(family) = details["family"].as_str().filter(|f| !f.is_empty())
    {
        details["families"] = json!([family]);
    }
    out["details"] = details;
    if let Some(caps) = member
        .pointer("/ollama/capabilities")
        .and_then(Value::as_array)
        .filter(|c| c.iter().any(|v| v.as_str().is_some_and(|s| !s.is_empty())))
    {
        out["capabilities"] = Value::Array(caps.clone());
    }
    let context = group.context_length.or_else(|| {
        let data = member.get("data")?;
        data.get("max_model_len")
            .or_else(|| data.pointer("/meta/n_ctx_train"))
            .and_then(Value::as_u64)
    });
    if let Some(n) = context {
        out["model_info"][format!("{ARCHITECTURE}.context_length")] = json!(n);
    }
    out
}

/// A count as Ollama writes parameter sizes: `8B`, `7.6B`, `137M`, `146.9K`.
fn human_number(n: u64) -> String {
    let (value, unit) = match n {
        n if n >= 1_000_000_000 => (n as f64 / 1e9, "B"),
        n if n >= 1_000_000 => (n as f64 / 1e6, "M"),
        n if n >= 1_000 => (n as f64 / 1e3, "K"),
        n => return n.to_string(),
    };
    if value.fract() == 0.0 {
        format!("{value:.0}{unit}")
    } else {
        format!("{value:.1}{unit}")
    }
}

/// llama.cpp's file type as Ollama names quantizations: `all F32` → `F32`,
/// `Q4_K - Medium` → `Q4_K_M`.
fn quantization(ftype: &str) -> String {
    let ftype = ftype
        .trim_start_matches("all ")
        .trim_start_matches("mostly ");
    match ftype.split_once(" - ") {
        Some((base, size)) => format!("{base}_{}", &size[..1.min(size.len())]),
        None => ftype.to_string(),
    }
}

/// The leading letters of a model's name (after any `org/`), lower-cased.
fn family_of(model: &str) -> String {
    let name = model.rsplit('/').next().unwrap_or(model);
    name.chars()
        .take_while(char::is_ascii_alphabetic)
        .collect::<String>()
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> EdgeConfig {
        EdgeConfig::from_yaml(
            r#"
nodes:
  - id: n1
    token: node-token-0123456789
    providers: [{id: p, kind: mock}]
model_groups:
  - {name: small, members: [{node: n1, provider: p}], context_length: 4096}
  - {name: "big:70b", members: [{node: n1, provider: p}]}
"#,
            "test",
        )
        .unwrap()
    }

    #[test]
    fn tags_list_every_group_as_an_ollama_model() {
        let c = config();
        let t = tags(&c, &Caller::anonymous());
        let models = t["models"].as_array().unwrap();
        assert_eq!(models.len(), 2);
        assert_eq!(models[0]["name"], "small");
        assert_eq!(models[0]["model"], "small");
        assert_eq!(models[0]["size"], 0);
        assert_eq!(models[0]["digest"].as_str().unwrap().len(), 64);
        assert!(
            models[0]["modified_at"]
                .as_str()
                .unwrap()
                .starts_with("2024-")
        );
        assert!(models[0]["details"].is_object());
    }

    #[test]
    fn names_resolve_with_or_without_latest() {
        let c = config();
        let anyone = Caller::anonymous();
        assert_eq!(resolve(&c, &anyone, "small").unwrap().name, "small");
        assert_eq!(resolve(&c, &anyone, "small:latest").unwrap().name, "small");
        assert_eq!(resolve(&c, &anyone, "big:70b").unwrap().name, "big:70b");
        assert!(resolve(&c, &anyone, "big").is_none());
        assert!(resolve(&c, &anyone, "nope:latest").is_none());
    }

    #[test]
    fn an_openai_compatible_members_report_fills_the_details() {
        let group = &config().model_groups[0];
        let llama = json!({
            "data": {"id": "tiny", "meta": {"n_params": 146880, "ftype": "all F32", "n_ctx_train": 4096}},
            "ollama": {"details": {"format": "gguf", "family": "", "families": [""], "parameter_size": ""},
                       "capabilities": ["completion"]}
        });
        let s = show_from_openai(group, "tiny", &llama);
        assert_eq!(s["details"]["format"], "gguf");
        assert_eq!(s["details"]["family"], "tiny");
        assert_eq!(s["details"]["families"], json!(["tiny"]));
        assert_eq!(s["details"]["parameter_size"], "146.9K");
        assert_eq!(s["details"]["quantization_level"], "F32");
        let vllm = json!({"data": {"id": "Qwen/Qwen2.5-7B-Instruct", "max_model_len": 32768}, "ollama": null});
        let s = show_from_openai(group, "Qwen/Qwen2.5-7B-Instruct", &vllm);
        assert_eq!(s["details"]["family"], "qwen");
        assert_eq!(
            s["model_info"]["iop.context_length"], 4096,
            "a configured context length wins"
        );
        let mut unsized_group = group.clone();
        unsized_group.context_length = None;
        let s = show_from_openai(&unsized_group, "Qwen/Qwen2.5-7B-Instruct", &vllm);
        assert_eq!(s["model_info"]["iop.context_length"], 32768);
        assert_eq!(human_number(8_000_000_000), "8B");
        assert_eq!(human_number(7_615_616_512), "7.6B");
        assert_eq!(quantization("Q4_K - Medium"), "Q4_K_M");
    }

    #[test]
    fn show_reports_the_context_length_and_takes_a_members_details() {
        let c = config();
        let s = show_from_config(&c.model_groups[0]);
        assert_eq!(s["model_info"]["iop.context_length"], 4096);
        assert_eq!(s["capabilities"], json!(["completion"]));
        let member = json!({
            "modelfile": "FROM /home/node/.ollama/blobs/sha256-secret",
            "details": {"family": "llama", "parameter_size": "8B"},
            "model_info": {"general.architecture": "llama", "llama.context_length": 131072},
            "capabilities": ["completion", "tools"],
            "template": "{{ .Prompt }}",
        });
        let s = show_from_member(&c.model_groups[0], &member);
        assert_eq!(s["details"]["family"], "llama");
        assert_eq!(s["capabilities"], json!(["completion", "tools"]));
        assert_eq!(
            s["model_info"]["llama.context_length"], 4096,
            "the config wins"
        );
        assert_eq!(s["modelfile"], "", "node paths stay on the node");
        let s = show_from_member(&c.model_groups[1], &member);
        assert_eq!(s["model_info"]["llama.context_length"], 131072);
    }
}
