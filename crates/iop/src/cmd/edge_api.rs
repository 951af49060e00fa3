//! The HTTP client the admin subcommands (`status`, `join-token`, `revoke`, `usage`,
//! `models`) reach a running
//! edge with: its URL, the API key, and a CA file for an edge whose HTTPS certificate is
//! not in the system's store.

use std::path::PathBuf;

use serde_json::Value;

#[derive(Debug, Clone, clap::Args)]
pub struct EdgeApi {
    /// The edge's HTTP address.
    #[arg(
        long,
        env = "IOP_URL",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub url: String,
    /// An admin API key, if the edge has keys (the admin endpoints take admin keys only).
    #[arg(long, env = "IOP_API_KEY", hide_env_values = true, global = true)]
    pub api_key: Option<String>,
    /// PEM CA certificate to verify an https:// edge by (when not in the system's store).
    #[arg(long, value_name = "FILE", global = true)]
    pub cacert: Option<PathBuf>,
}

impl EdgeApi {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url.trim_end_matches('/'))
    }

    pub fn client(&self) -> Result<reqwest::Client, String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder().no_proxy();
        if let Some(path) = &self.cacert {
            let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let cert = reqwest::Certificate::from_pem(&pem)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            builder = builder.add_root_certificate(cert);
        }
        builder.build().map_err(|e| e.to_string())
    }

    /// Sends `request` (with the API key) and returns the JSON body of a success, or the
    /// edge's error message.
    pub async fn send(&self, request: reqwest::RequestBuilder) -> Result<Value, String> {
        let request = match &self.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        };
        let response = request
            .send()
            .await
            .map_err(|e| format!("cannot reach the edge at {}: {e}", self.url))?;
        let status = response.status();
        let body: Value = response
            .json()
            .await
            .map_err(|e| format!("{}: not a JSON answer ({status}): {e}", self.url))?;
        if !status.is_success() {
            // OpenAI's error shape, or Ollama's (`{"error": "…"}`).
            let message = body["error"]["message"]
                .as_str()
                .or_else(|| body["error"].as_str())
                .map_or_else(|| body.to_string(), String::from);
            return Err(format!("the edge answered {status}: {message}"));
        }
        Ok(body)
    }
}
