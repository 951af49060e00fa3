//! Model names as Ollama takes them, checked alike by the node (names it is asked to pull,
//! copy or delete) and the edge (names a provider lists, which become model groups and
//! metric labels): no control characters, no markup, no path tricks, a bounded length.

/// The longest model name accepted.
pub const MAX_MODEL_NAME: usize = 256;

/// At most this much of a refused name is shown in a message.
const SHOWN: usize = 80;

/// `name` cut for a message.
fn shown(name: &str) -> String {
    name.chars().take(SHOWN).collect()
}

/// A model name as Ollama takes it: `[host[:port]/][namespace/]model[:tag]` — letters,
/// digits and `._-` in each part, no empty part, no `..`, at most [`MAX_MODEL_NAME`]
/// bytes.
pub fn check(name: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("invalid model name {:?}: {why}", shown(name)));
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.len() > MAX_MODEL_NAME {
        return bad(&format!("longer than {MAX_MODEL_NAME} bytes"));
    }
    if name.contains("..") {
        return bad("`..` is not allowed");
    }
    let (path, tag) = match name.rsplit_once(':') {
        // A colon after the last slash is the tag's; one before it is a registry port.
        Some((path, tag)) if !tag.contains('/') => (path, Some(tag)),
        _ => (name, None),
    };
    let part_ok = |part: &str| {
        !part.is_empty()
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
            && !part.starts_with(['.', '-'])
    };
    let mut parts = path.split('/').peekable();
    let mut first = true;
    while let Some(part) = parts.next() {
        // The first of several parts may be a registry host with a port.
        let part = match part.split_once(':') {
            Some((host, port)) if first && parts.peek().is_some() => {
                if port.is_empty() || !port.chars().all(|c| c.is_ascii_digit()) {
                    return bad("a registry port must be digits");
                }
                host
            }
            _ => part,
        };
        if !part_ok(part) {
            return bad("each part takes letters, digits, `.`, `-` and `_`");
        }
        first = false;
    }
    if let Some(tag) = tag
        && !part_ok(tag)
    {
        return bad("the tag takes letters, digits, `.`, `-` and `_`");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn ollama_names_pass_and_hostile_ones_do_not() {
        for good in [
            "llama3.2",
            "qwen2.5:0.5b",
            "library/llama3:latest",
            "reg.example:5000/ns/m:tag",
        ] {
            assert!(check(good).is_ok(), "{good}");
        }
        let long = "a".repeat(super::MAX_MODEL_NAME + 1);
        for bad in [
            "",
            "../../etc/passwd",
            "a\nb",
            "a\0b",
            "<script>",
            "a b",
            "x:",
            ":y",
            &long,
        ] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
    }
}
