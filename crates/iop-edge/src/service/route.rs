//! The one routing decision: how a request reaches the member an attempt was granted,
//! decided from that member's traits alone (its kind and the APIs it serves), never from
//! anything the client sent to pick a path.
//!
//! - **Native**: the member serves the client's API itself (an OpenAI-compatible provider
//!   and an OpenAI client, a provider whose `apis` list Responses or Messages, an `ollama`
//!   provider and an Ollama client): the client's own request goes through the raw tunnel
//!   with `model` rewritten, and the provider's bytes come back untouched.
//! - **Tunnel**: an OpenAI-compatible member that does not serve the client's API gets the
//!   canonical request through the tunnel; its answer is read as canonical events.
//! - **Run**: every other member (Ollama for non-Ollama clients, CLI, mock) gets the
//!   canonical request as a node run; its events are read as canonical events.
//!
//! [`work`] builds what is sent (a tunnel request or a run) with the provider codecs.
//! Pure: no I/O.

use iop_proto::ErrorCode;

use crate::canonical::{ApiError, ModelRequest, NativeApi, Operation};
use crate::codec::{self, RunSpec, TunnelSpec};
use crate::config::ProviderKind;
use crate::queue::MemberTraits;

/// How an attempt reaches its member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Native,
    Tunnel,
    Run,
}

impl Route {
    /// The path metrics and the ledger name: `tunnel` or `run`.
    pub fn path(self) -> &'static str {
        match self {
            Route::Native | Route::Tunnel => "tunnel",
            Route::Run => "run",
        }
    }
}

/// Whether a member with `traits` serves `api` itself.
pub fn serves_natively(traits: &MemberTraits, api: NativeApi) -> bool {
    match api {
        NativeApi::Provider(api) => traits.kind.is_tunnel() && traits.apis.contains(api),
        NativeApi::Ollama(_) => traits.kind == ProviderKind::Ollama,
    }
}

/// The route of `request` to a member with `traits`, or why that member cannot serve it
/// (an operation or API its provider lacks; the request is not retried elsewhere).
pub fn decide(
    traits: &MemberTraits,
    request: &ModelRequest,
    group: &str,
) -> Result<Route, ApiError> {
    if serves_natively(traits, request.native.api) {
        return Ok(Route::Native);
    }
    // Served natively only: the translation's refusal is the answer.
    request.canonical.map_err(Clone::clone)?;
    let op = request.op;
    if traits.kind.is_tunnel() {
        if traits.apis.contains(op.api()) {
            return Ok(Route::Tunnel);
        }
        return Err(unsupported(format!(
            "model `{group}` is served by a provider that does not serve the {} API (provider config `apis`)",
            op.api().as_str()
        )));
    }
    if op == Operation::Embedding {
        // An Ollama provider serves embeddings, but only in its own API.
        let serving = match request.native.api {
            NativeApi::Ollama(_) => "openai_compat, vllm and ollama providers",
            NativeApi::Provider(_) => "openai_compat and vllm providers",
        };
        return Err(unsupported(format!(
            "model `{group}` is served by a {} provider; embeddings are served by {serving} only",
            traits.kind.as_str()
        )));
    }
    Ok(Route::Run)
}

fn unsupported(message: String) -> ApiError {
    ApiError::of(ErrorCode::NotSupported, message).with_detail("unsupported_operation")
}

/// What an attempt sends to its member.
#[derive(Debug)]
pub enum Work {
    /// An HTTP request through the node's raw tunnel.
    Tunnel(TunnelSpec),
    /// A normalized run.
    Run(RunSpec),
}

/// The request for the member `provider` (its id on the node) whose upstream model is
/// `upstream`, by `route`.
pub fn work(
    route: Route,
    request: &ModelRequest,
    traits: &MemberTraits,
    provider: &str,
    upstream: &str,
) -> Work {
    let accept = match (request.stream, request.native.api) {
        (false, _) => codec::JSON,
        (true, NativeApi::Ollama(_)) if route == Route::Native => codec::NDJSON,
        (true, _) => codec::EVENT_STREAM,
    };
    match route {
        Route::Native => {
            let native = request.native;
            let inject = request.stream
                && native.api.takes_stream_usage()
                && traits.inject_stream_usage
                && !codec::openai_request::client_asked(&native.request);
            let mut body = codec::openai_request::provider_body(&native.request, upstream, inject);
            if request.background {
                body = codec::openai_request::in_the_foreground(body);
            }
            let mut spec = TunnelSpec::post_json(provider, native.api.path(), body, accept);
            spec.headers.extend(native.headers.iter().cloned());
            spec.usage_injected = inject;
            spec.stream = request.stream;
            Work::Tunnel(spec)
        }
        Route::Tunnel => {
            let canonical = request.canonical.expect("decided: a canonical request");
            // The edge reads the answer itself: usage it asks for stays in the stream.
            let inject = request.stream
                && request.op.generates()
                && traits.inject_stream_usage
                && !codec::openai_request::client_asked(canonical);
            let body = codec::openai_request::provider_body(canonical, upstream, inject);
            let mut spec =
                TunnelSpec::post_json(provider, request.op.api().provider_path(), body, accept);
            spec.stream = request.stream;
            Work::Tunnel(spec)
        }
        Route::Run => {
            let canonical = request.canonical.expect("decided: a canonical request");
            Work::Run(codec::run::run_spec(
                canonical, request.op, provider, upstream,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::{ClientRequest, Native};
    use crate::config::ProviderApi;
    use crate::queue::ApiSet;

    fn traits(kind: ProviderKind, apis: &[ProviderApi]) -> MemberTraits {
        MemberTraits {
            kind,
            apis: ApiSet::of(apis.iter().copied()),
            inject_stream_usage: kind.is_tunnel(),
            ..MemberTraits::default()
        }
    }

    fn with<R>(
        api: NativeApi,
        op: Operation,
        stream: bool,
        refused: bool,
        f: impl FnOnce(ModelRequest) -> R,
    ) -> R {
        let body = br#"{"model":"g","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
        let native = Native {
            api,
            request: ClientRequest::parse(body).unwrap(),
            headers: vec![codec::header("anthropic-version", "1")],
        };
        let canonical = ClientRequest::parse(body).unwrap();
        let refusal = ApiError::bad_request("unsupported_parameter", "no");
        let request = ModelRequest {
            group: "g",
            op,
            stream,
            native: &native,
            canonical: if refused {
                Err(&refusal)
            } else {
                Ok(&canonical)
            },
            max_output_tokens: None,
            session: None,
            background: false,
        };
        f(request)
    }

    #[test]
    fn the_route_follows_the_members_traits() {
        let openai = traits(ProviderKind::OpenaiCompat, &[ProviderApi::Chat]);
        let both = traits(
            ProviderKind::Vllm,
            &[ProviderApi::Chat, ProviderApi::Messages],
        );
        let ollama = traits(ProviderKind::Ollama, &[]);
        let mock = traits(ProviderKind::Mock, &[]);
        let chat = NativeApi::Provider(ProviderApi::Chat);
        let messages = NativeApi::Provider(ProviderApi::Messages);
        let ollama_api = NativeApi::Ollama("/api/chat");
        let cases = [
            (chat, &openai, Ok(Route::Native)),
            (chat, &ollama, Ok(Route::Run)),
            (chat, &mock, Ok(Route::Run)),
            (messages, &openai, Ok(Route::Tunnel)),
            (messages, &both, Ok(Route::Native)),
            (messages, &mock, Ok(Route::Run)),
            (ollama_api, &ollama, Ok(Route::Native)),
            (ollama_api, &openai, Ok(Route::Tunnel)),
        ];
        for (api, traits, want) in cases {
            let got = with(api, Operation::Chat, true, false, |r| {
                decide(traits, &r, "g")
            });
            assert_eq!(got, want, "{api:?} {:?}", traits.kind);
        }
        // Embeddings: never a run; a tunnelled member must list the API.
        let embed = with(chat, Operation::Embedding, false, false, |r| {
            decide(&mock, &r, "g")
        });
        assert_eq!(embed.unwrap_err().code(), "unsupported_operation");
        let no_embed = with(messages, Operation::Embedding, false, false, |r| {
            decide(&openai, &r, "g")
        });
        assert!(no_embed.is_err());
        // A refused translation is served natively or not at all.
        assert_eq!(
            with(messages, Operation::Chat, true, true, |r| decide(
                &both, &r, "g"
            )),
            Ok(Route::Native)
        );
        let refused = with(messages, Operation::Chat, true, true, |r| {
            decide(&openai, &r, "g")
        });
        assert_eq!(refused.unwrap_err().code(), "unsupported_parameter");
    }

    #[test]
    fn the_work_rewrites_the_model_and_asks_for_usage_only_where_it_can() {
        let openai = traits(
            ProviderKind::OpenaiCompat,
            &[ProviderApi::Chat, ProviderApi::Messages],
        );
        let chat = NativeApi::Provider(ProviderApi::Chat);
        let Work::Tunnel(spec) = with(chat, Operation::Chat, true, false, |r| {
            work(Route::Native, &r, &openai, "p", "up")
        }) else {
            panic!("a tunnel")
        };
        assert_eq!(spec.path, "/chat/completions");
        assert!(spec.usage_injected);
        let body: serde_json::Value = serde_json::from_slice(&spec.body).unwrap();
        assert_eq!(body["model"], "up");
        assert_eq!(body["stream_options"]["include_usage"], true);
        // A native Messages request goes as it is, with its API's headers.
        let messages = NativeApi::Provider(ProviderApi::Messages);
        let Work::Tunnel(spec) = with(messages, Operation::Chat, true, false, |r| {
            work(Route::Native, &r, &openai, "p", "up")
        }) else {
            panic!("a tunnel")
        };
        assert_eq!(spec.path, "/messages");
        assert!(!spec.usage_injected);
        assert!(spec.headers.iter().any(|h| h.name == "anthropic-version"));
        // Translated: the canonical chat, usage kept in the stream the edge reads.
        let Work::Tunnel(spec) = with(messages, Operation::Chat, true, false, |r| {
            work(Route::Tunnel, &r, &openai, "p", "up")
        }) else {
            panic!("a tunnel")
        };
        assert_eq!(spec.path, "/chat/completions");
        assert!(!spec.usage_injected);
        assert!(spec.body.windows(13).any(|w| w == b"include_usage"));
        let Work::Run(run) = with(chat, Operation::Chat, false, false, |r| {
            work(Route::Run, &r, &openai, "p", "up")
        }) else {
            panic!("a run")
        };
        assert_eq!((run.adapter.as_str(), run.target.as_str()), ("p", "up"));
    }
}
