//! Managing an Ollama server's models through its own API: `POST /api/pull` (NDJSON
//! progress), `DELETE /api/delete`, `POST /api/copy`, `POST /api/create` (from an existing
//! model, with system prompt, template and parameters) and loading or unloading a model
//! (`POST /api/generate` with no prompt; `keep_alive: 0` unloads).
//!
//! Model names are checked before anything is sent ([`check_model_name`]). A streamed
//! answer is read line by line with a cap on each line ([`MAX_LINE_BYTES`]) and on the
//! silence between lines ([`LINE_IDLE`]); an `{"error": …}` line inside a 200 stream is
//! a failure with Ollama's text, and a stream that ends without `success` is a broken one.

use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use iop_proto::ErrorCode;
use serde::Serialize;
use serde_json::{Value, json};

use super::OllamaAdapter;
use crate::error::AdapterError;
use crate::http::HeadWait;

/// The longest NDJSON line read from a management stream (Ollama's are a few hundred
/// bytes).
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// The longest silence between two lines of a management stream: Ollama is quiet while it
/// verifies a large download's digest, so this is generous.
pub const LINE_IDLE: Duration = Duration::from_secs(10 * 60);

/// Where a pull (or create) is: one progress line of Ollama's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Progress {
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completed: Option<u64>,
}

/// A model name as Ollama takes it (see [`iop_proto::model_name::check`]).
pub fn check_model_name(name: &str) -> Result<(), AdapterError> {
    iop_proto::model_name::check(name).map_err(|why| AdapterError::new(ErrorCode::BadRequest, why))
}

impl OllamaAdapter {
    /// One `POST /api/pull` of `model`, calling `progress` with each progress line, up to
    /// Ollama's `success`.
    pub async fn pull(
        &self,
        model: &str,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), AdapterError> {
        check_model_name(model)?;
        let request = self
            .provider
            .request(reqwest::Method::POST, "/api/pull")
            .json(&json!({"model": model, "stream": true}));
        self.streamed(request, progress).await
    }

    /// `POST /api/create` of `model` from the existing model `from`, with what `options`
    /// holds of `system`, `template` and `parameters` (an object).
    pub async fn create(
        &self,
        model: &str,
        from: &str,
        options: &serde_json::Map<String, Value>,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), AdapterError> {
        check_model_name(model)?;
        check_model_name(from)?;
        let mut body = json!({"model": model, "from": from, "stream": true});
        for key in ["system", "template", "parameters"] {
            if let Some(value) = options.get(key) {
                body[key] = value.clone();
            }
        }
        let request = self
            .provider
            .request(reqwest::Method::POST, "/api/create")
            .json(&body);
        self.streamed(request, progress).await
    }

    /// `DELETE /api/delete`: Ollama's 404 for a model it does not hold is `not_found`.
    pub async fn delete(&self, model: &str) -> Result<Value, AdapterError> {
        check_model_name(model)?;
        let request = self
            .provider
            .request(reqwest::Method::DELETE, "/api/delete")
            .json(&json!({"model": model}));
        self.provider
            .accepted(request, HeadWait::Whole)
            .await
            .map_err(model_missing)?;
        Ok(json!({"deleted": model}))
    }

    /// `POST /api/copy`.
    pub async fn copy(&self, source: &str, destination: &str) -> Result<Value, AdapterError> {
        check_model_name(source)?;
        check_model_name(destination)?;
        let request = self
            .provider
            .request(reqwest::Method::POST, "/api/copy")
            .json(&json!({"source": source, "destination": destination}));
        self.provider
            .accepted(request, HeadWait::Whole)
            .await
            .map_err(model_missing)?;
        Ok(json!({"copied": source, "to": destination}))
    }

    /// Loads `model` (kept for `keep_alive`, Ollama's default when `None`), or unloads it
    /// with a `keep_alive` of `0`: `POST /api/generate` with no prompt. Returns Ollama's
    /// `done_reason` (`load` / `unload`).
    pub async fn load(
        &self,
        model: &str,
        keep_alive: Option<Value>,
    ) -> Result<Value, AdapterError> {
        check_model_name(model)?;
        let mut body = json!({"model": model, "stream": false});
        if let Some(keep_alive) = keep_alive {
            body["keep_alive"] = keep_alive;
        }
        let request = self
            .provider
            .request(reqwest::Method::POST, "/api/generate")
            .json(&body);
        let answer: Value = self
            .provider
            .accepted(request, HeadWait::Streamed)
            .await?
            .json()
            .await
            .map_err(|e| self.provider.transport_error(&e))?;
        Ok(json!({"model": model, "done_reason": answer.get("done_reason")}))
    }

    /// Sends a streamed management request and reads its NDJSON answer to `success`.
    async fn streamed(
        &self,
        request: reqwest::RequestBuilder,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), AdapterError> {
        let response = self
            .provider
            .accepted(request, HeadWait::Streamed)
            .await
            .map_err(model_missing)?;
        let provider = self.provider.clone();
        let body = response
            .bytes_stream()
            .map(move |chunk| chunk.map_err(|e| provider.transport_error(&e)));
        read_progress(body, &self.provider.id, LINE_IDLE, progress).await
    }
}

/// Ollama's 404 to a management call: the model is not there (`not_found`).
fn model_missing(e: AdapterError) -> AdapterError {
    if e.code == ErrorCode::UnknownTarget {
        AdapterError::new(ErrorCode::NotFound, e.message)
    } else {
        e
    }
}

/// Reads an Ollama management stream to its `success` line, handing every other line to
/// `progress`. An `error` line, a line over [`MAX_LINE_BYTES`], a line that is not JSON,
/// `idle` without a line, or an end before `success` fail it.
pub async fn read_progress(
    body: impl Stream<Item = Result<Bytes, AdapterError>>,
    provider: &str,
    idle: Duration,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<(), AdapterError> {
    let failed = |code: ErrorCode, what: String| {
        Err(AdapterError::new(
            code,
            format!("provider {provider}: {what}"),
        ))
    };
    let mut body = std::pin::pin!(body);
    let mut pending: Vec<u8> = Vec::new();
    loop {
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = line.trim_ascii();
            if line.is_empty() {
                continue;
            }
            let Ok(value) = serde_json::from_slice::<Value>(line) else {
                return failed(
                    ErrorCode::ProviderError,
                    "sent a line that is not JSON".into(),
                );
            };
            if let Some(error) = value.get("error") {
                let text = error
                    .as_str()
                    .map_or_else(|| error.to_string(), String::from);
                return failed(ErrorCode::ProviderError, text);
            }
            let status = value.get("status").and_then(Value::as_str).unwrap_or("");
            if status == "success" {
                return Ok(());
            }
            progress(Progress {
                status: status.to_string(),
                digest: value
                    .get("digest")
                    .and_then(Value::as_str)
                    .map(String::from),
                total: value.get("total").and_then(Value::as_u64),
                completed: value.get("completed").and_then(Value::as_u64),
            });
        }
        if pending.len() > MAX_LINE_BYTES {
            return failed(
                ErrorCode::ResponseTooLarge,
                format!("sent a line longer than {MAX_LINE_BYTES} bytes"),
            );
        }
        match tokio::time::timeout(idle, body.next()).await {
            Ok(Some(Ok(chunk))) => pending.extend_from_slice(&chunk),
            // The body broke off: the stream is cut (a timeout stays one).
            Ok(Some(Err(e))) if e.code == ErrorCode::ProviderTimeout => return Err(e),
            Ok(Some(Err(e))) => return Err(AdapterError::new(ErrorCode::BrokenStream, e.message)),
            Ok(None) => {
                return failed(
                    ErrorCode::BrokenStream,
                    "the stream ended before `success`".into(),
                );
            }
            Err(_) => {
                return failed(
                    ErrorCode::ProviderTimeout,
                    format!("sent nothing for {}s", idle.as_secs()),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_checked() {
        for ok in [
            "llama3.2",
            "llama3.2:3b",
            "library/llama3.2:latest",
            "registry.example:5000/team/model:v1.0",
            "qwen2.5-coder:7b-instruct-q4_K_M",
        ] {
            assert!(check_model_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a b",
            "../etc/passwd",
            "model:",
            "model:t/a",
            "-rm",
            "a//b",
            "model;rm",
            "host:port/model",
            &"x".repeat(iop_proto::model_name::MAX_MODEL_NAME + 1),
        ] {
            let err = check_model_name(bad).unwrap_err();
            assert_eq!(err.code, ErrorCode::BadRequest, "{bad}");
        }
    }

    fn lines(text: &'static [&'static str]) -> impl Stream<Item = Result<Bytes, AdapterError>> {
        futures::stream::iter(text.iter().map(|l| Ok(Bytes::from_static(l.as_bytes()))))
    }

    async fn read(
        body: impl Stream<Item = Result<Bytes, AdapterError>>,
    ) -> (Result<(), AdapterError>, Vec<Progress>) {
        let mut seen = Vec::new();
        let result = read_progress(body, "ol", LINE_IDLE, &mut |p| seen.push(p)).await;
        (result, seen)
    }

    #[tokio::test]
    async fn progress_lines_up_to_success() {
        let (result, seen) = read(lines(&[
            "{\"status\":\"pulling manifest\"}\n{\"status\":\"pulling ab\",\"digest\":\"sha256:ab\",",
            "\"total\":10,\"completed\":5}\n",
            "{\"status\":\"success\"}\n",
        ]))
        .await;
        result.unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[1].completed, Some(5));
        assert_eq!(seen[1].digest.as_deref(), Some("sha256:ab"));
    }

    #[tokio::test]
    async fn an_error_line_inside_the_stream_fails_with_its_text() {
        let (result, _) = read(lines(&[
            "{\"status\":\"pulling manifest\"}\n",
            "{\"error\":\"pull model manifest: file does not exist\"}\n",
        ]))
        .await;
        let err = result.unwrap_err();
        assert!(err.message.contains("file does not exist"), "{err:?}");
    }

    #[tokio::test]
    async fn a_body_that_breaks_off_is_a_broken_stream() {
        let head = lines(&["{\"status\":\"pulling manifest\"}\n"]);
        let cut = futures::stream::iter([Err(AdapterError::new(
            ErrorCode::ProviderError,
            "provider ol: the response body failed",
        ))]);
        let (result, _) = read(head.chain(cut)).await;
        assert_eq!(result.unwrap_err().code, ErrorCode::BrokenStream);
    }

    #[tokio::test]
    async fn an_end_before_success_is_a_broken_stream() {
        let (result, _) = read(lines(&["{\"status\":\"pulling manifest\"}\n"])).await;
        assert_eq!(result.unwrap_err().code, ErrorCode::BrokenStream);
    }

    #[tokio::test]
    async fn an_endless_line_is_refused() {
        let big = futures::stream::repeat_with(|| Ok(Bytes::from(vec![b'x'; 8192]))).take(100);
        let (result, _) = read(big).await;
        assert_eq!(result.unwrap_err().code, ErrorCode::ResponseTooLarge);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_stream_times_out() {
        let head = lines(&["{\"status\":\"pulling manifest\"}\n"]);
        let body = head.chain(futures::stream::pending());
        let (result, seen) = read(body).await;
        assert_eq!(result.unwrap_err().code, ErrorCode::ProviderTimeout);
        assert_eq!(seen.len(), 1);
    }
}
