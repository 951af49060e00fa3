//! Node commands (capabilities, transport, usage, sessions, the Ollama family), run cancel
//! and session termination: request/response exchanges correlated by `command_id`.

use std::time::Duration;

use iop_proto::{ErrorCode, pb};

use super::Edge;
use super::errors::SubmitError;
use crate::auth::Caller;
use crate::canonical::ApiError;
use crate::session::CommandReply;

/// How long the edge waits for a node's answer to a command.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error("no active run `{0}`")]
    UnknownRun(String),
    #[error("node did not answer within {}s", COMMAND_TIMEOUT.as_secs())]
    Timeout,
    /// The node answered with an error.
    #[error("{message}")]
    Failed { code: ErrorCode, message: String },
}

impl From<CommandError> for ApiError {
    fn from(err: CommandError) -> Self {
        let message = err.to_string();
        match err {
            CommandError::Submit(e) => e.into(),
            CommandError::UnknownRun(_) => ApiError::not_found("run_not_found", message),
            CommandError::Timeout => ApiError::of(ErrorCode::NodeTimeout, message),
            // A command the node knows but does not serve.
            CommandError::Failed {
                code: ErrorCode::NotSupported,
                message,
            } => ApiError::of(ErrorCode::NotImplemented, message).with_detail("not_supported"),
            CommandError::Failed { code, message } => ApiError::of(code, message),
        }
    }
}

impl Edge {
    /// Runs a node command and returns its JSON result.
    pub async fn node_command(
        &self,
        node_id: &str,
        name: &str,
        adapter: &str,
        args: std::collections::HashMap<String, String>,
    ) -> Result<serde_json::Value, CommandError> {
        let session = self.pick_node(Some(node_id))?;
        let command_id = self.new_id();
        let request = pb::NodeCommandRequest {
            command_id: command_id.clone(),
            name: name.to_string(),
            adapter: adapter.to_string(),
            args,
        };
        match self.exchange(&session, &command_id, request.into()).await? {
            CommandReply::Command(resp) if resp.ok => Ok(serde_json::from_str(&resp.result_json)
                .unwrap_or(serde_json::Value::String(resp.result_json))),
            CommandReply::Command(resp) => Err(failed(resp.error)),
            CommandReply::Cancel(_) => Err(CommandError::Failed {
                code: ErrorCode::NodeProtocol,
                message: "node answered a command with a cancel response".into(),
            }),
        }
    }

    /// Cancels an active run wherever it runs. A run `caller` may not touch (another client
    /// key's) is reported as unknown, exactly like one that does not exist.
    pub async fn cancel_run(&self, run_id: &str, caller: &Caller) -> Result<(), CommandError> {
        if !caller.may_touch(self.keys.run_owner(run_id).as_deref()) {
            return Err(CommandError::UnknownRun(run_id.to_string()));
        }
        let session = self
            .nodes
            .ready_sessions()
            .into_iter()
            .find(|s| s.has_stream(run_id))
            .ok_or_else(|| CommandError::UnknownRun(run_id.to_string()))?;
        self.cancel(
            &session,
            pb::CancelRequest::run(run_id, "cancelled by request"),
        )
        .await
    }

    /// Ends a logical session on an adapter that supports it.
    pub async fn terminate_session(
        &self,
        node_id: &str,
        adapter: &str,
        target: &str,
        session_id: &str,
    ) -> Result<(), CommandError> {
        let session = self.pick_node(Some(node_id))?;
        self.cancel(
            &session,
            pb::CancelRequest {
                kind: pb::CancelKind::TerminateSession as i32,
                adapter: adapter.to_string(),
                target: target.to_string(),
                session_id: session_id.to_string(),
                reason: "terminated by request".into(),
                ..Default::default()
            },
        )
        .await
    }

    async fn cancel(
        &self,
        session: &crate::session::NodeSession,
        mut request: pb::CancelRequest,
    ) -> Result<(), CommandError> {
        let command_id = self.new_id();
        request.command_id = command_id.clone();
        match self.exchange(session, &command_id, request.into()).await? {
            CommandReply::Cancel(resp) if resp.ok => Ok(()),
            CommandReply::Cancel(resp) => Err(failed(resp.error)),
            CommandReply::Command(_) => Err(CommandError::Failed {
                code: ErrorCode::NodeProtocol,
                message: "node answered a cancel with a command response".into(),
            }),
        }
    }

    async fn exchange(
        &self,
        session: &crate::session::NodeSession,
        command_id: &str,
        envelope: pb::Envelope,
    ) -> Result<CommandReply, CommandError> {
        let send_failed =
            |reason: String| CommandError::Submit(SubmitError::send_failed(session, reason));
        let rx = session
            .open_command(command_id)
            .map_err(|e| send_failed(e.to_string()))?;
        if session.outbound.send(envelope).await.is_err() {
            session.forget_command(command_id);
            return Err(send_failed("the connection closed".into()));
        }
        match tokio::time::timeout(COMMAND_TIMEOUT, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(send_failed(
                session
                    .close_reason()
                    .unwrap_or_else(|| "the connection closed".into()),
            )),
            Err(_) => {
                session.forget_command(command_id);
                Err(CommandError::Timeout)
            }
        }
    }
}

fn failed(error: Option<pb::RunError>) -> CommandError {
    let error = error.unwrap_or_default();
    CommandError::Failed {
        code: error.error_code(),
        message: error.message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_the_node_does_not_serve_is_501() {
        let e = ApiError::from(CommandError::Failed {
            code: ErrorCode::NotSupported,
            message: "no".into(),
        });
        assert_eq!(e.status, 501);
    }
}
