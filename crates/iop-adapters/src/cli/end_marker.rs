//! The session end marker in a turn's input: a line the program would take as the end of
//! the input, so an input holding it is refused before the session is touched (no sound
//! escaping exists that every program would undo).

use crate::error::AdapterError;
use iop_proto::ErrorCode;

/// Every line break a common reader honours (`\n`, `\r`, and the ones Python's
/// `str.splitlines` adds).
fn is_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r'
            | '\u{0b}'
            | '\u{0c}'
            | '\u{1c}'
            | '\u{1d}'
            | '\u{1e}'
            | '\u{85}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

/// Refuses an input holding the end-marker line: the program would take it as the end of
/// the input and the session would answer out of step from then on. Lines are split at
/// every line break a program's reader may honour and compared without surrounding
/// whitespace, so neither a shell's `read`, nor Python's universal newlines, nor a reader
/// that strips lines sees the marker.
pub fn refuse_end_marker(prompt: &str, marker: &str) -> Result<(), AdapterError> {
    let marker = marker.trim();
    if prompt
        .split(is_line_break)
        .any(|line| line.trim() == marker)
    {
        return Err(AdapterError::new(
            ErrorCode::BadRequest,
            format!(
                "the input holds a line {marker:?}, the session's end marker (cli.end_marker): it would end the input early, so the run is refused; remove or change that line"
            ),
        ));
    }
    Ok(())
}
