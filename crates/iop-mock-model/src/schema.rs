//! Values that fit a JSON schema, for the mocks' deterministic tool calls: the arguments
//! a mock model passes to the tool it calls.

use serde_json::{Value, json};

/// A value that fits the JSON schema `schema` (its required properties only).
pub fn fitting_value(schema: &Value) -> Value {
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return first.clone();
    }
    let kind = match schema.get("type") {
        Some(Value::Array(kinds)) => kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|k| *k != "null")
            .unwrap_or("null"),
        Some(Value::String(kind)) => kind.as_str(),
        _ if schema.get("properties").is_some() => "object",
        _ => "string",
    };
    match kind {
        "object" => {
            let properties = schema.get("properties").and_then(Value::as_object);
            let required = schema.get("required").and_then(Value::as_array);
            let mut object = serde_json::Map::new();
            for name in required.into_iter().flatten().filter_map(Value::as_str) {
                let property = properties.and_then(|p| p.get(name)).unwrap_or(&Value::Null);
                object.insert(name.to_string(), fitting_value(property));
            }
            Value::Object(object)
        }
        "integer" | "number" => json!(1),
        "boolean" => json!(true),
        "array" => json!([]),
        "null" => Value::Null,
        _ => json!("mock"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_fit_the_tools_schema() {
        let schema = json!({
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "path": {"type": "string"},
                "mode": {"enum": ["fast", "slow"]},
                "depth": {"type": "integer"},
                "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
                "optional": {"type": "string"}
            },
            "required": ["command", "path", "mode", "depth", "opts"]
        });
        assert_eq!(
            fitting_value(&schema),
            json!({"command": [], "path": "mock", "mode": "fast", "depth": 1, "opts": {"x": true}})
        );
        assert_eq!(
            fitting_value(&json!({"type": ["null", "number"]})),
            json!(1)
        );
    }
}
