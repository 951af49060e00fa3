//! Compiles `proto/iop/runtime.proto` with protox (no system `protoc` needed).

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("iop/runtime.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&root]).expect("compile runtime.proto");
    let mut config = prost_build::Config::new();
    // The envelope is moved several times per frame on both daemons: its size is the
    // size of its largest message, so the messages bigger than a tunnel frame (the frame
    // the relay moves most) are boxed, which keeps every envelope as small as a frame.
    for message in BOXED_IN_ENVELOPE {
        config.boxed(format!(".iop.runtime.v1.Envelope.message.{message}"));
    }
    config
        .bytes([
            ".iop.runtime.v1.ProviderTunnelFrame.body",
            ".iop.runtime.v1.ProviderTunnelRequest.body",
        ])
        .compile_fds(descriptors)
        .expect("generate Rust from runtime.proto");
}

/// The envelope's messages larger than a `ProviderTunnelFrame` (checked by the envelope
/// size test in `iop-proto`).
const BOXED_IN_ENVELOPE: &[&str] = &[
    "register_request",
    "register_response",
    "run_request",
    "run_event",
    "cancel_request",
    "cancel_response",
    "node_command_request",
    "node_command_response",
    "provider_tunnel_request",
    "edge_node_event",
    "stream_resume",
    "orphan_usage",
];
