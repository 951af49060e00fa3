//! How the mocks play a model an agent drives, deterministically: whether a request is
//! answered with a tool call or with text, and which tool is called. Shared by the mock
//! server's OpenAI and Ollama modes and by the node's mock adapter.
//!
//! One tool call per turn: a turn starts after the model's last text answer (or at the
//! start of the conversation). If the turn already holds a tool result, the mock answers
//! in text, whatever came after it (agents append reminders or system turns after a tool
//! result); otherwise it calls a tool. So an agent's turn ends after one round trip and
//! its next prompt starts another.

/// One message of a conversation, as far as the turn rule looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn<'a> {
    pub role: &'a str,
    /// An assistant message that called tools.
    pub calls_tools: bool,
}

/// Whether the mock calls a tool for a conversation (oldest message first): no tool result
/// since the model's last text answer.
pub fn calls_a_tool<'a>(conversation: impl DoubleEndedIterator<Item = Turn<'a>>) -> bool {
    for message in conversation.rev() {
        match message.role {
            "tool" => return false,
            "assistant" if !message.calls_tools => return true,
            _ => {}
        }
    }
    true
}

/// Which of the offered tools the mock calls: the first (in the order offered) whose name
/// the prompt mentions as a word, ignoring case, else the first offered.
pub fn chosen_tool(names: &[&str], prompt: &str) -> usize {
    let words: Vec<String> = prompt
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-'))
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect();
    names
        .iter()
        .position(|name| words.iter().any(|w| *w == name.to_lowercase()))
        .unwrap_or(0)
}

/// For a chat body in the OpenAI or Ollama shape (`messages`, `tools[].function`): the
/// tool the mock calls and its function object, or `None` when it answers in text.
pub fn json_tool_call(body: &serde_json::Value) -> Option<&serde_json::Value> {
    let tools = body.get("tools")?.as_array()?;
    let messages = body.get("messages")?.as_array()?;
    let turns = messages.iter().map(|m| Turn {
        role: m
            .get("role")
            .and_then(serde_json::Value::as_str)
            .unwrap_or(""),
        calls_tools: m
            .get("tool_calls")
            .and_then(serde_json::Value::as_array)
            .is_some_and(|calls| !calls.is_empty()),
    });
    if tools.is_empty() || !calls_a_tool(turns) {
        return None;
    }
    let names: Vec<&str> = tools
        .iter()
        .map(|t| {
            t.pointer("/function/name")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("")
        })
        .collect();
    let prompt = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(serde_json::Value::as_str) == Some("user"))
        .map(message_text)
        .unwrap_or_default();
    tools[chosen_tool(&names, &prompt)].get("function")
}

/// A message's text: its string content, or its text parts joined.
fn message_text(message: &serde_json::Value) -> String {
    match message.get("content") {
        Some(serde_json::Value::String(text)) => text.clone(),
        Some(serde_json::Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(serde_json::Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turns<'a>(roles: &[(&'a str, bool)]) -> Vec<Turn<'a>> {
        roles
            .iter()
            .map(|&(role, calls_tools)| Turn { role, calls_tools })
            .collect()
    }

    #[test]
    fn one_tool_call_per_turn() {
        let call = |c: &[(&str, bool)]| calls_a_tool(turns(c).into_iter());
        assert!(call(&[("user", false)]));
        assert!(call(&[("system", false), ("user", false)]));
        assert!(!call(&[
            ("user", false),
            ("assistant", true),
            ("tool", false)
        ]));
        // What an agent appends after a tool result does not start a new turn.
        assert!(!call(&[
            ("user", false),
            ("assistant", true),
            ("tool", false),
            ("user", false),
            ("system", false),
        ]));
        // A text answer ends the turn; the next prompt starts another.
        assert!(call(&[
            ("user", false),
            ("assistant", true),
            ("tool", false),
            ("assistant", false),
            ("user", false),
        ]));
    }

    #[test]
    fn the_tool_the_prompt_names_is_called() {
        let names = ["Agent", "Bash", "Read"];
        assert_eq!(chosen_tool(&names, "List the files with the bash tool."), 1);
        assert_eq!(chosen_tool(&names, "Read it, then use Bash"), 1);
        assert_eq!(chosen_tool(&names, "what is here?"), 0);
        assert_eq!(chosen_tool(&names, "bashful"), 0);
        assert_eq!(chosen_tool(&[], "anything"), 0);
    }

    #[test]
    fn a_json_chat_picks_its_call() {
        let tool = |name: &str| serde_json::json!({"type": "function", "function": {"name": name}});
        let body = serde_json::json!({
            "tools": [tool("read"), tool("shell")],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "run shell"}]}]
        });
        assert_eq!(json_tool_call(&body).unwrap()["name"], "shell");
        let answered = serde_json::json!({
            "tools": [tool("read")],
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [{"id": "1"}]},
                {"role": "tool", "content": "done"},
                {"role": "user", "content": "<reminder>"}
            ]
        });
        assert_eq!(json_tool_call(&answered), None);
        assert_eq!(json_tool_call(&serde_json::json!({"messages": []})), None);
    }
}
