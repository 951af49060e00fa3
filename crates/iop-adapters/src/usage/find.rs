//! Where a provider's `usage` lies in raw JSON text, found without parsing the text: the
//! key, and where its value begins.

use std::sync::LazyLock;

use memchr::memmem;

/// Where the key `"usage"` occurs. A `"usage"` inside a JSON string is escaped
/// (`\"usage\"`) and never matches.
pub(super) fn usage_keys(text: &[u8]) -> memmem::FindIter<'_, 'static> {
    static KEY: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(USAGE_KEY));
    KEY.find_iter(text)
}

pub(super) const USAGE_KEY: &[u8] = b"\"usage\"";

/// Where the value of the key at `key` begins (after spaces and the colon); `text.len()`
/// if the line ends first.
pub(super) fn value_start(text: &[u8], key: usize) -> usize {
    let after = key + USAGE_KEY.len();
    text[after..]
        .iter()
        .position(|b| !(b.is_ascii_whitespace() && *b != b'\n') && *b != b':')
        .map_or(text.len(), |p| after + p)
}
