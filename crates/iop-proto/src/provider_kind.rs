//! A provider kind's name, as configs, logs and status pages spell it on both daemons.

use crate::pb::ProviderKind;

impl ProviderKind {
    /// The kind as configs spell it (`openai_compat`, `vllm`, …).
    pub fn config_name(self) -> &'static str {
        match self {
            ProviderKind::Mock => "mock",
            ProviderKind::OpenaiCompat => "openai_compat",
            ProviderKind::Vllm => "vllm",
            ProviderKind::Ollama => "ollama",
            ProviderKind::Cli => "cli",
            ProviderKind::Unspecified => "unspecified",
        }
    }
}
