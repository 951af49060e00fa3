//! Reading a translated request's fields strictly: each helper returns the value or a
//! 400 naming the field by its path (`input[2].content[0].text`), so every translator
//! reports mistakes the same way.
//!
//! Pure: no I/O.

use serde_json::{Map, Value};

use super::error::ApiError;

/// A field that is not what the API accepts.
pub fn invalid(path: &str, what: &str) -> ApiError {
    ApiError::invalid_param(path, format!("`{path}` must be {what}"))
}

/// A field the API has but iop cannot honour.
pub fn unsupported(path: &str, why: impl Into<String>) -> ApiError {
    ApiError::bad_request("unsupported_parameter", why).with_param(path)
}

/// `value` as an object.
pub fn object<'v>(value: &'v Value, path: &str) -> Result<&'v Map<String, Value>, ApiError> {
    value.as_object().ok_or_else(|| invalid(path, "an object"))
}

/// A required string member.
pub fn string<'v>(
    object: &'v Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<&'v str, ApiError> {
    match object.get(key) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(ApiError::bad_request(
            "missing_parameter",
            format!("`{}` is required", join(at, key)),
        )
        .with_param(join(at, key))),
        Some(_) => Err(invalid(&join(at, key), "a string")),
    }
}

/// An optional string member.
pub fn opt_string<'v>(
    object: &'v Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'v str>, ApiError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(&join(at, key), "a string")),
    }
}

/// An optional member that must be present-and-not-null to count.
pub fn present<'v>(object: &'v Map<String, Value>, key: &str) -> Option<&'v Value> {
    object.get(key).filter(|v| !v.is_null())
}

/// `at.key`, or `key` at the top level.
pub fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_string()
    } else {
        format!("{at}.{key}")
    }
}

/// Refuses a member of `object` not in `known` (the API would reject it too, and a field
/// silently dropped is a request answered differently from what was asked).
pub fn only_known(object: &Map<String, Value>, known: &[&str], at: &str) -> Result<(), ApiError> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(key) => {
            let path = join(at, key);
            Err(
                ApiError::bad_request("unknown_parameter", format!("unknown parameter `{path}`"))
                    .with_param(path),
            )
        }
    }
}

/// An optional number member.
pub fn opt_number(
    object: &Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<f64>, ApiError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| invalid(&join(at, key), "a number")),
    }
}

/// An optional boolean member.
pub fn opt_bool(
    object: &Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<bool>, ApiError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(&join(at, key), "a boolean")),
    }
}

/// An optional integer member from `min` to `max`.
pub fn opt_count(
    object: &Map<String, Value>,
    key: &str,
    at: &str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, ApiError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(invalid(
                &join(at, key),
                &format!("an integer from {min} to {max}"),
            )),
        },
    }
}

/// An optional array member.
pub fn opt_array<'v>(
    object: &'v Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'v Vec<Value>>, ApiError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(_) => Err(invalid(&join(at, key), "an array")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn errors_name_the_path() {
        let o = json!({"a": 1, "s": "x", "n": -1, "b": "yes"});
        let o = o.as_object().unwrap();
        assert_eq!(
            string(o, "a", "x[0]").unwrap_err().param.as_deref(),
            Some("x[0].a")
        );
        assert_eq!(string(o, "zz", "").unwrap_err().code(), "missing_parameter");
        assert_eq!(opt_string(o, "s", "").unwrap(), Some("x"));
        assert_eq!(
            opt_count(o, "n", "", 0, 5).unwrap_err().param.as_deref(),
            Some("n")
        );
        assert_eq!(
            opt_bool(o, "b", "").unwrap_err().param.as_deref(),
            Some("b")
        );
        let e = only_known(o, &["a", "s", "n"], "").unwrap_err();
        assert_eq!(
            (e.code(), e.param.as_deref()),
            ("unknown_parameter", Some("b"))
        );
    }
}
