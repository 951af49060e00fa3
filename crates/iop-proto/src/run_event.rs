//! The names run event kinds go by outside the wire: the native runs API's `kind` and SSE
//! `event:`, and the edge's event log.

use crate::pb::RunEventKind;

impl RunEventKind {
    /// The snake_case name (`start`, `delta`, `tool_call`, …).
    pub const fn name(self) -> &'static str {
        match self {
            RunEventKind::Unspecified => "unspecified",
            RunEventKind::Start => "start",
            RunEventKind::Delta => "delta",
            RunEventKind::ReasoningDelta => "reasoning_delta",
            RunEventKind::Complete => "complete",
            RunEventKind::Error => "error",
            RunEventKind::Cancelled => "cancelled",
            RunEventKind::ToolCall => "tool_call",
            RunEventKind::Accepted => "accepted",
        }
    }
}
