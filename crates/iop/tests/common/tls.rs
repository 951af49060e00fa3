//! TLS helpers for the real-process tests: the pin of every edge a test started (so
//! `start_node` verifies the edge the way users do), join tokens and revocation through
//! the `iop` subcommands, a raw TLS connection (or handshake) to a node listener for tests
//! that speak the wire by hand, a relay that records every byte between node and edge, a
//! fake TLS edge that records what it received, and an operator CA made with rcgen for
//! mTLS tests.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::{DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};
use tokio::net::TcpStream;

use super::{EdgeProc, IOP, Proc};

/// Node listener address → its pin (`None`: plaintext), learnt from each edge's start line.
fn pins() -> &'static Mutex<HashMap<String, Option<String>>> {
    static PINS: OnceLock<Mutex<HashMap<String, Option<String>>>> = OnceLock::new();
    PINS.get_or_init(Default::default)
}

pub fn remember_pin(nodes_addr: &str, pin: Option<&str>) {
    pins()
        .lock()
        .unwrap()
        .insert(nodes_addr.to_string(), pin.map(String::from));
}

/// A proxy at `alias` in front of `upstream` is verified by the upstream's pin.
pub fn alias_pin(alias: &str, upstream: &str) {
    let pin = pins().lock().unwrap().get(upstream).cloned();
    if let Some(pin) = pin {
        pins().lock().unwrap().insert(alias.to_string(), pin);
    }
}

pub fn pin_for(nodes_addr: &str) -> Option<Option<String>> {
    pins().lock().unwrap().get(nodes_addr).cloned()
}

/// The node config lines that make a node trust the edge at `edge_nodes` and keep its
/// state in the test's directory. For an edge not started yet, the CA it will load from
/// the test directory's default state dir is made now (as `iop edge --print-pin` does).
pub fn node_trust_yaml(name: &str, dir: &Path, edge_nodes: &str) -> String {
    let mut yaml = format!(
        "state_file: \"{}\"\n",
        dir.join(format!("{name}-state.json")).display()
    );
    match pin_for(edge_nodes) {
        Some(Some(pin)) => yaml.push_str(&format!("edge_pin: \"{pin}\"\n")),
        Some(None) => yaml.push_str("insecure_plaintext: true\n"),
        None => yaml.push_str(&format!("edge_pin: \"{}\"\n", pin_of_future_edge(dir))),
    }
    yaml
}

/// The pin of the edge a test will start in `dir` (its CA is created on first use).
pub fn pin_of_future_edge(dir: &Path) -> String {
    let probe = dir.join(".pin-probe.yaml");
    std::fs::write(&probe, "nodes: []\n").unwrap();
    let out = std::process::Command::new(IOP)
        .args(["edge", "--config", probe.to_str().unwrap(), "--print-pin"])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&probe);
    assert!(
        out.status.success(),
        "iop edge --print-pin: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The state file `start_node(name, dir, ...)` uses.
pub fn state_file(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}-state.json"))
}

/// Runs an `iop` admin subcommand against `edge` and returns (success, stdout, stderr).
pub async fn iop_admin(edge: &EdgeProc, args: &[&str]) -> (bool, String, String) {
    let url = format!("http://{}", edge.http);
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new(IOP)
            .args(args)
            .args(["--url", &url, "--api-key", super::TEST_API_KEY])
            .output(),
    )
    .await
    .expect("the iop admin command finishes")
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Creates a join token with `iop join-token` and returns the join string.
pub async fn join_token(edge: &EdgeProc, node: &str, extra: &[&str]) -> String {
    let mut args = vec!["join-token", "--node", node];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = iop_admin(edge, &args).await;
    assert!(ok, "iop join-token failed: {stderr}");
    let join = stdout.trim().to_string();
    assert!(
        join.starts_with("iop1:"),
        "not a join string: {join:?} ({stderr})"
    );
    join
}

/// Revokes a node with `iop revoke`.
pub async fn revoke(edge: &EdgeProc, node: &str) -> String {
    let (ok, stdout, stderr) = iop_admin(edge, &["revoke", node]).await;
    assert!(ok, "iop revoke failed: {stderr}");
    stdout
}

/// `iop node --join <join>` with its db and state file in `dir`; `args` are added.
pub fn start_joining_node(name: &str, dir: &Path, join: &str, args: &[&str]) -> Proc {
    let db = dir.join(format!("{name}.db"));
    let state = state_file(dir, name);
    let mut all = vec![
        "node".to_string(),
        "--join".into(),
        join.into(),
        "--db".into(),
        db.display().to_string(),
        "--state-file".into(),
        state.display().to_string(),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    Proc::spawn(name, &all)
}

/// Accepts any server certificate (raw wire tests only).
#[derive(Debug)]
struct AcceptAnything;

impl ServerCertVerifier for AcceptAnything {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Opens a TLS connection to a node listener without verifying it, for tests that write
/// frames by hand.
pub async fn raw_tls_connect(addr: &str) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    raw_tls_handshake(tcp)
        .await
        .expect("TLS handshake with the node listener")
}

/// Runs a TLS handshake (without verifying the server) over `tcp`; an error when the
/// listener closes the connection first.
pub async fn raw_tls_handshake(
    tcp: TcpStream,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    raw_handshake(tcp, None).await
}

/// [`raw_tls_handshake`] presenting a client certificate (PEM certificate and key).
pub async fn raw_tls_handshake_with_cert(
    tcp: TcpStream,
    cert_pem: &str,
    key_pem: &str,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    raw_handshake(tcp, Some((cert_pem, key_pem))).await
}

async fn raw_handshake(
    tcp: TcpStream,
    client_cert: Option<(&str, &str)>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAnything));
    let config = match client_cert {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain: Vec<CertificateDer<'static>> =
                rustls_pki_types::pem::PemObject::pem_slice_iter(cert.as_bytes())
                    .collect::<Result<_, _>>()
                    .unwrap();
            let key: PrivateKeyDer<'static> =
                rustls_pki_types::pem::PemObject::from_pem_slice(key.as_bytes()).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("iop-edge").unwrap(), tcp)
        .await
}

/// A TCP relay that records every byte in both directions.
pub struct RecordingRelay {
    pub addr: String,
    recorded: Arc<Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RecordingRelay {
    pub async fn start(upstream: &str) -> RecordingRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        alias_pin(&addr, upstream);
        let recorded: Arc<Mutex<Vec<u8>>> = Arc::default();
        let upstream = upstream.to_string();
        let sink = recorded.clone();
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = outbound.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(ir) as Box<dyn AsyncRead + Send + Unpin>,
                        Box::new(ow) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                    ),
                    (Box::new(or), Box::new(iw)),
                ] {
                    let sink = sink.clone();
                    tokio::spawn(async move {
                        use tokio::io::AsyncWriteExt;
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            sink.lock().unwrap().extend_from_slice(&buf[..n]);
                            if to.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown().await;
                    });
                }
            }
        });
        RecordingRelay {
            addr,
            recorded,
            task,
        }
    }

    pub fn recorded(&self) -> Vec<u8> {
        self.recorded.lock().unwrap().clone()
    }
}

impl Drop for RecordingRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether `needle` occurs in `haystack`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// An operator CA (rcgen) that issues server and client certificates.
pub struct TestCa {
    pub cert_pem: String,
    key: KeyPair,
    params: CertificateParams,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            cert_pem: cert.pem(),
            key,
            params,
        }
    }

    /// A certificate (PEM) and key (PEM) for `names` (server) or common name `cn`
    /// (client).
    fn issue(
        &self,
        cn: &str,
        names: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        params.use_authority_key_identifier_extension = true;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    pub fn server_cert(&self, names: &[&str]) -> (String, String) {
        self.issue(
            "test edge",
            names.iter().map(|n| n.to_string()).collect(),
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    pub fn client_cert(&self, node_id: &str) -> (String, String) {
        self.issue(node_id, Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// The pin of this CA, as `iop` prints pins.
    pub fn pin(&self) -> String {
        let der = CertificateDer::from(
            rustls_pki_types::pem::PemObject::from_pem_slice(self.cert_pem.as_bytes())
                .map(|c: CertificateDer<'static>| c.to_vec())
                .unwrap(),
        );
        let parsed = rustls::server::ParsedCertificate::try_from(&der).unwrap();
        iop_proto::trust::Pin::of_spki(parsed.subject_public_key_info().as_ref()).to_string()
    }
}

/// Records what a TLS client sent: raw bytes on the socket, and the application data it
/// sent once a handshake completed.
struct Recording<S> {
    inner: S,
    raw: Arc<Mutex<Vec<u8>>>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Recording<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        let new = buf.filled()[before..].to_vec();
        self.raw.lock().unwrap().extend_from_slice(&new);
        poll
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Recording<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A fake edge: a TLS server under its own CA that records every byte nodes send.
pub struct FakeTlsEdge {
    pub addr: String,
    pub ca: TestCa,
    raw: Arc<Mutex<Vec<u8>>>,
    app: Arc<Mutex<Vec<u8>>>,
    handshakes: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeTlsEdge {
    pub async fn start() -> FakeTlsEdge {
        let ca = TestCa::new("impostor CA");
        let (cert, key) = ca.server_cert(&["iop-edge", "127.0.0.1"]);
        let mut chain: Vec<CertificateDer<'static>> =
            rustls_pki_types::pem::PemObject::pem_slice_iter(cert.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap();
        chain.push(
            rustls_pki_types::pem::PemObject::from_pem_slice(ca.cert_pem.as_bytes()).unwrap(),
        );
        let key: PrivateKeyDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(key.as_bytes()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let raw: Arc<Mutex<Vec<u8>>> = Arc::default();
        let app: Arc<Mutex<Vec<u8>>> = Arc::default();
        let handshakes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (raw2, app2, hs2) = (raw.clone(), app.clone(), handshakes.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let stream = Recording {
                    inner: tcp,
                    raw: raw2.clone(),
                };
                let (acceptor, app, hs) = (acceptor.clone(), app2.clone(), hs2.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    hs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let mut buf = vec![0u8; 4096];
                    while let Ok(n) = tls.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        app.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                });
            }
        });
        FakeTlsEdge {
            addr,
            ca,
            raw,
            app,
            handshakes,
            task,
        }
    }

    /// Every byte nodes sent on the socket.
    pub fn raw(&self) -> Vec<u8> {
        self.raw.lock().unwrap().clone()
    }

    /// Application data nodes sent after a completed handshake.
    pub fn app_data(&self) -> Vec<u8> {
        self.app.lock().unwrap().clone()
    }

    /// Completed TLS handshakes.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for FakeTlsEdge {
    fn drop(&mut self) {
        self.task.abort();
    }
}
