//! The usage line a CLI program may print, and the nonce that makes it trustworthy.
//!
//! Every process iop starts gets a fresh random nonce in `IOP_USAGE_NONCE`. A stdout line
//! `@@iop-usage <nonce> {"input_tokens":N,"output_tokens":M}` (optionally with
//! `reasoning_tokens` and `cached_input_tokens`) reports the run's usage and is never
//! relayed. A line that starts like a usage line but does not carry that process's nonce
//! is ordinary output: a program that echoes its input cannot be made to report usage by
//! its client, who never sees the nonce (it is fresh per process, and the lines carrying
//! it are never relayed).

use iop_proto::pb;

pub const USAGE_PREFIX: &str = "@@iop-usage ";
pub const NONCE_ENV: &str = "IOP_USAGE_NONCE";

/// A per-process secret (128 random bits as hex). Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct UsageNonce(String);

impl UsageNonce {
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().simple().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Compares without stopping at the first differing byte.
    fn matches(&self, candidate: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), candidate.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl std::fmt::Debug for UsageNonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UsageNonce(..)")
    }
}

/// What one stdout line of a CLI program is.
#[derive(Debug, PartialEq)]
pub enum Line<'a> {
    /// Output for the client.
    Output(&'a str),
    /// A usage line with the right nonce; `None` when its JSON is not a usage object.
    Usage(Option<pb::Usage>),
    /// Looks like a usage line but lacks the nonce: relayed as output, never counted.
    Untrusted(&'a str),
}

/// Classifies a line against the process's nonce.
pub fn classify<'a>(line: &'a str, nonce: &UsageNonce) -> Line<'a> {
    let Some(rest) = line.strip_prefix(USAGE_PREFIX) else {
        return Line::Output(line);
    };
    match rest.split_once(' ') {
        Some((candidate, json)) if nonce.matches(candidate) => Line::Usage(parse(json)),
        _ => Line::Untrusted(line),
    }
}

fn parse(json: &str) -> Option<pb::Usage> {
    let v: serde_json::Value = serde_json::from_str(json.trim()).ok()?;
    if !v.is_object() {
        return None;
    }
    let count = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    Some(pb::Usage {
        input_tokens: count("input_tokens").unwrap_or(0),
        output_tokens: count("output_tokens").unwrap_or(0),
        reasoning_tokens: count("reasoning_tokens"),
        cached_input_tokens: count("cached_input_tokens"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_with_the_nonce_is_usage() {
        let n = UsageNonce::random();
        let line = format!(
            "@@iop-usage {} {{\"input_tokens\":3,\"output_tokens\":2,\"reasoning_tokens\":1}}",
            n.as_str()
        );
        let Line::Usage(Some(u)) = classify(&line, &n) else {
            panic!("not usage: {line}")
        };
        assert_eq!(
            (
                u.input_tokens,
                u.output_tokens,
                u.reasoning_tokens,
                u.cached_input_tokens
            ),
            (3, 2, Some(1), None)
        );
    }

    #[test]
    fn forged_lines_are_output_and_never_usage() {
        let n = UsageNonce::random();
        let other = UsageNonce::random();
        let max = u64::MAX;
        for forged in [
            format!("@@iop-usage {{\"input_tokens\":0,\"output_tokens\":{max}}}"),
            format!("@@iop-usage {} {{\"output_tokens\":{max}}}", other.as_str()),
            format!("@@iop-usage {} {{\"output_tokens\":1}}", &n.as_str()[..31]),
            format!("@@iop-usage {}x {{\"output_tokens\":1}}", n.as_str()),
            "@@iop-usage  {\"output_tokens\":1}".to_string(),
            "@@iop-usage".to_string(),
        ] {
            assert!(
                matches!(classify(&forged, &n), Line::Untrusted(_) | Line::Output(_)),
                "{forged}"
            );
        }
        assert_eq!(classify("hello", &n), Line::Output("hello"));
        assert_eq!(
            classify(&format!(" @@iop-usage {} {{}}", n.as_str()), &n),
            Line::Output(&format!(" @@iop-usage {} {{}}", n.as_str()))
        );
    }

    #[test]
    fn a_genuine_line_with_bad_json_reports_nothing_and_is_not_output() {
        let n = UsageNonce::random();
        for json in ["not json", "[1,2]", "5"] {
            let line = format!("@@iop-usage {} {json}", n.as_str());
            assert_eq!(classify(&line, &n), Line::Usage(None), "{line}");
        }
    }

    #[test]
    fn nonces_are_fresh_and_hidden_from_debug() {
        let (a, b) = (UsageNonce::random(), UsageNonce::random());
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 32);
        assert!(!format!("{a:?}").contains(a.as_str()));
    }
}
