//! The model groups an edge makes of its Ollama providers' own models (`models:` on an
//! Ollama provider, `auto` by default): each model a provider's server holds, and its
//! `models:` lets through, becomes a group named after it (without Ollama's default
//! `:latest` tag, which the APIs accept either way) whose members are every such provider
//! that holds it, in config order. A configured group of the same name wins. The config
//! the edge serves is the file's with these groups added ([`with_local_groups`]); what
//! each provider holds is learnt by the service (`service::models`). A provider's list
//! is bounded: only valid Ollama names, at most `limits.models_per_provider` of them
//! ([`listed_names`]), and at most `limits.local_model_groups` groups in all.

use std::collections::BTreeMap;

use crate::config::{EdgeConfig, MemberConfig, ModelGroupConfig, QueueConfig};

/// The models each Ollama provider holds, by (node, provider), as its server names them.
pub type Held = BTreeMap<(String, String), Vec<String>>;

/// The group name of a model an Ollama server holds.
pub fn group_name(model: &str) -> &str {
    model.strip_suffix(":latest").unwrap_or(model)
}

/// `name` with Ollama's default tag (`llama3.2` → `llama3.2:latest`), as its
/// `/api/tags` lists it.
pub fn full_name(name: &str) -> String {
    let last = name.rsplit('/').next().unwrap_or(name);
    if last.contains(':') {
        name.to_string()
    } else {
        format!("{name}:latest")
    }
}

/// `file` with a group for each model `held` that a provider's `models:` lets through, at
/// most `limits.local_model_groups` (a provider's list was already cut to valid names and
/// `limits.models_per_provider` by [`listed_names`]).
pub fn with_local_groups(file: &EdgeConfig, held: &Held) -> EdgeConfig {
    let mut config = file.clone();
    let mut made: BTreeMap<String, ModelGroupConfig> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for node in &file.nodes {
        for provider in &node.providers {
            let Some(exposed) = provider.local_models() else {
                continue;
            };
            let Some(models) = held.get(&(node.id.clone(), provider.id.clone())) else {
                continue;
            };
            for model in models.iter().filter(|m| exposed.exposes(m)) {
                let name = group_name(model).to_string();
                if file.resolve_group(&name).is_some() || file.resolve_group(model).is_some() {
                    continue;
                }
                if !made.contains_key(&name) && made.len() >= file.limits.local_model_groups {
                    continue;
                }
                let group = made.entry(name.clone()).or_insert_with(|| {
                    order.push(name.clone());
                    ModelGroupConfig {
                        name: name.clone(),
                        members: Vec::new(),
                        long_context_tokens: None,
                        queue: QueueConfig::default(),
                        context_length: None,
                        owned_by: Some("ollama".into()),
                        routing: Default::default(),
                        local: true,
                    }
                });
                group.members.push(MemberConfig {
                    node: node.id.clone(),
                    provider: provider.id.clone(),
                    model: Some(model.clone()),
                });
            }
        }
    }
    config
        .model_groups
        .extend(order.iter().filter_map(|name| made.remove(name)));
    config
}

/// What a provider's list makes of `names`: the valid Ollama names
/// ([`iop_proto::model_name::check`]: no control characters, markup or path tricks,
/// bounded length), the first `cap` of them; and how many were left out.
pub fn listed_names<'a>(
    names: impl IntoIterator<Item = &'a str>,
    cap: usize,
) -> (Vec<String>, usize) {
    let mut kept = Vec::new();
    let mut left_out = 0;
    for name in names {
        if kept.len() < cap && iop_proto::model_name::check(name).is_ok() {
            kept.push(name.to_string());
        } else {
            left_out += 1;
        }
    }
    (kept, left_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> EdgeConfig {
        let yaml = format!(
            r#"
nodes:
  - id: a
    token: token-a-0123456789
    providers:
      - {{id: ol, kind: ollama, base_url: "http://127.0.0.1:11434"}}
      - {{id: picky, kind: ollama, base_url: "http://127.0.0.1:11435", models: ["qwen*"]}}
      - {{id: off, kind: ollama, base_url: "http://127.0.0.1:11436", models: []}}
  - id: b
    token: token-b-0123456789
    providers:
      - {{id: ol, kind: ollama, base_url: "http://127.0.0.1:11434"}}
{extra}"#
        );
        EdgeConfig::from_yaml(&yaml, "edge.yaml").unwrap()
    }

    fn held(entries: &[(&str, &str, &[&str])]) -> Held {
        entries
            .iter()
            .map(|(n, p, models)| {
                (
                    (n.to_string(), p.to_string()),
                    models.iter().map(|m| m.to_string()).collect(),
                )
            })
            .collect()
    }

    fn members(config: &EdgeConfig, group: &str) -> Vec<(String, String, String)> {
        config
            .model_groups
            .iter()
            .find(|g| g.name == group)
            .unwrap_or_else(|| panic!("no group {group}"))
            .members
            .iter()
            .map(|m| (m.node.clone(), m.provider.clone(), m.model.clone().unwrap()))
            .collect()
    }

    #[test]
    fn each_held_model_is_a_group_merged_across_providers() {
        let file = config("");
        let held = held(&[
            ("a", "ol", &["llama3.2:latest", "qwen2.5:7b"]),
            ("b", "ol", &["llama3.2:latest"]),
        ]);
        let served = with_local_groups(&file, &held);
        assert_eq!(
            members(&served, "llama3.2"),
            [
                ("a".into(), "ol".into(), "llama3.2:latest".into()),
                ("b".into(), "ol".into(), "llama3.2:latest".into())
            ]
        );
        assert_eq!(members(&served, "qwen2.5:7b").len(), 1);
        assert!(served.model_groups.iter().all(|g| g.local));
        assert!(served.resolve_group("llama3.2:latest").is_some());
    }

    #[test]
    fn patterns_narrow_and_an_empty_list_turns_it_off() {
        let file = config("");
        let held = held(&[
            ("a", "picky", &["qwen2.5:7b", "llama3.2:latest"]),
            ("a", "off", &["gemma:2b"]),
        ]);
        let served = with_local_groups(&file, &held);
        let names: Vec<&str> = served
            .model_groups
            .iter()
            .map(|g| g.name.as_str())
            .collect();
        assert_eq!(names, ["qwen2.5:7b"]);
    }

    #[test]
    fn a_configured_group_of_the_same_name_wins() {
        let file = config(
            "model_groups:\n  - {name: llama3.2, members: [{node: b, provider: ol, model: other}]}\n",
        );
        let held = held(&[("a", "ol", &["llama3.2:latest"])]);
        let served = with_local_groups(&file, &held);
        assert_eq!(served.model_groups.len(), 1);
        assert!(!served.model_groups[0].local);
        assert_eq!(members(&served, "llama3.2")[0].2, "other");
    }
}
