//! Compiles `proto/iop/runtime.proto` with protox (no system `protoc` needed).

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("iop/runtime.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&root]).expect("compile runtime.proto");
    prost_build::Config::new()
        .bytes([
            ".iop.runtime.v1.ProviderTunnelFrame.body",
            ".iop.runtime.v1.ProviderTunnelRequest.body",
        ])
        .compile_fds(descriptors)
        .expect("generate Rust from runtime.proto");
}
