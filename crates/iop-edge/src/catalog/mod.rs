//! The model groups as the client APIs list them: OpenAI's `/v1/models` ([`models`]) and
//! Ollama's tags, running models and `show` ([`ollama`]), from the edge's config and what
//! a caller may see.

pub mod models;
pub mod ollama;
